"""A text three contexts long read through context shifts (the engine's rule, teacher-forced): the last
stretch's perplexity within 10% of a fresh context's on the same tokens, for a short and a long kept
start. A shift that lost the kept start's positions or the carried tokens' order would be far off."""

from __future__ import annotations

import pytest

from kvserve.quality.shift import shift_scores
from kvserve.quality.text import default_text

NUM_CTX = 256


@pytest.mark.parametrize("keep", [4, 64])
def test_shifted_context_reads_as_well_as_a_fresh_one(smollm2_q4, keep):
    tokens = smollm2_q4.tokenizer.encode(default_text())[: 3 * NUM_CTX]
    scores = shift_scores(smollm2_q4.model, tokens, NUM_CTX, keep)
    assert scores.shifts >= 3 and scores.last_stretch >= NUM_CTX // 4
    assert 0.9 <= scores.ratio <= 1.1, scores


def test_a_text_too_short_for_a_shift_is_refused(smollm2_q4):
    with pytest.raises(ValueError, match="fill the context"):
        shift_scores(smollm2_q4.model, list(range(1, 300)), NUM_CTX, 4)
