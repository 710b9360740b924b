"""Code completion's stop: the text ends before its first line (after the first) indented less than the
hole's indentation, streamed or whole (a line just begun is held back until its indentation is known)."""

from __future__ import annotations

import pytest

from kvserve.engine.output_processor import dedent_at
from kvserve.engine.sampling_params import SamplingParams
from tests.support import make_engine


def test_dedent_at():
    assert dedent_at("x\n    y\n  z", 4) == 8  # the line of z, indented 2
    assert dedent_at("x\n    y\n\n    z", 4) is None  # blank lines do not count
    assert dedent_at("x\n   ", 4) is None  # a line begun: not known yet
    assert dedent_at("  x", 4) is None  # the first line continues the prefix's
    assert dedent_at("x\n\ty\nz", 1) == 5


@pytest.mark.slow
def test_the_text_ends_where_it_leaves_the_hole(smollm2_q4, check_no_leaks):
    engine = make_engine(smollm2_q4, num_ctx=512)
    check_no_leaks.append(engine)
    prompt = engine.tokenizer.encode_chat([{"role": "user",
                                            "content": "Write three short Python functions."}])
    free = engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=120)).request_id
    held = engine.add_request(prompt,
                              SamplingParams(temperature=0, max_tokens=120, stop_at_dedent=1)).request_id
    pieces, finals = [], {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == held:
                pieces.append(out.delta_text)
            if out.finished:
                finals[out.request_id] = out
    cut, whole = finals[held], finals[free]
    assert cut.finish_reason == "stop" and "".join(pieces) == cut.text
    assert dedent_at(cut.text, 1) is None  # no line at column 0 after the first
    assert whole.text.startswith(cut.text) and dedent_at(whole.text, 1) == len(cut.text)  # cut right there
