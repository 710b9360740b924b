"""A reasoning model's thought: opened and closed where the tokens say, closed by force at its budget
(the same tokens with speculative decoding on), and a grammar that shapes the answer only after it."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from kvserve.config import SpeculativeConfig
from kvserve.engine.constraints import Constraint
from kvserve.engine.engine import LLMEngine
from kvserve.engine.reasoning import Reasoning, ThoughtState, split_thought, thought_so_far
from kvserve.engine.sampling_params import SamplingParams
from tests.support import make_engine

END, START = (7, 8), (5,)


def _state(spec: Reasoning, tokens: list[int]) -> ThoughtState:
    state = ThoughtState(spec)
    state.update(tokens)
    return state


def test_the_thought_is_followed_token_by_token():
    assert _state(Reasoning(END, START), [5, 1, 2]).phase == "inside"
    assert _state(Reasoning(END, START), [1, 5]).phase == "done"  # the answer began without a thought
    done = _state(Reasoning(END, START), [5, 1, 7, 7, 8, 3])
    assert done.answering and done.count == 4 and done.thought_tokens == 2
    assert _state(Reasoning(END), [1, 7]).thought_tokens == 1  # a close begun is not thought
    assert _state(Reasoning(END), [1, 7]).phase == "inside"  # opened by the prompt


def test_the_budget_forces_the_closing_tokens():
    spec = Reasoning(END, budget=3)
    tokens = [1, 2]
    assert _state(spec, tokens).forced() is None
    tokens.append(7)  # the model began a close itself: it counts as thought until whole
    assert _state(spec, tokens).forced() is None
    tokens.append(1)
    assert _state(spec, tokens).forced() == 7
    tokens.append(7)
    assert _state(spec, tokens).forced() == 8
    tokens.append(8)
    assert _state(spec, tokens).answering and _state(spec, tokens).forced() is None
    assert _state(Reasoning(END, budget=0), []).forced() == 7
    with pytest.raises(ValueError):
        Reasoning(())


def test_split_whole_and_streamed():
    assert split_thought("<think>\nhm</think>\n\nYes.", opened=False) == ("hm", "Yes.")
    assert split_thought("hm</think>Yes.", opened=True) == ("hm", "Yes.")
    assert split_thought("Yes.", opened=False) == (None, "Yes.")
    assert split_thought("cut off", opened=True) == ("cut off", "")
    assert thought_so_far("<thi", opened=False) == (None, "", False)
    assert thought_so_far("<think>so</thi", opened=False) == ("so", "", True)
    assert thought_so_far("so</think> Yes", opened=True) == ("so", "Yes", True)
    assert thought_so_far("Yes", opened=False) == (None, "Yes", True)


@pytest.mark.slow
def test_a_budget_closes_the_thought_alone_batched_and_speculated(smollm2_q4, check_no_leaks):
    engine = make_engine(smollm2_q4, num_ctx=512)
    check_no_leaks.append(engine)
    tok = engine.tokenizer
    end = tuple(tok.encode("\n</think>\n\n", add_special=False))
    prompt = tok.encode_chat([{"role": "user", "content": "Count to twenty."}])
    params = SamplingParams(temperature=0, max_tokens=30, reasoning=Reasoning(end, budget=6))
    first = engine.add_request(prompt, params).request_id
    plain = engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=30)).request_id
    final = engine.run_to_completion()
    out = final[first].token_ids
    assert list(out[:6]) == list(final[plain].token_ids[:6])  # the thought as the model writes it
    assert tuple(out[6 : 6 + len(end)]) == end  # then closed
    speculating = LLMEngine(replace(engine.config, speculative=SpeculativeConfig("ngram", 3, 1, 3)),
                            engine.loaded)
    check_no_leaks.append(speculating)
    again = speculating.add_request(prompt, params).request_id
    assert speculating.run_to_completion()[again].token_ids == out


@pytest.mark.slow
def test_a_grammar_shapes_the_answer_after_the_thought(smollm2_q4):
    engine = make_engine(smollm2_q4, num_ctx=512)
    tok = engine.tokenizer
    end = tuple(tok.encode("</think>", add_special=False))
    prompt = tok.encode_chat([{"role": "user", "content": "Describe a cat as JSON."}])
    params = SamplingParams(temperature=0, max_tokens=80, reasoning=Reasoning(end, budget=4),
                            constraint=Constraint("json_object"))
    rid = engine.add_request(prompt, params).request_id
    out = engine.run_to_completion()[rid]
    thought, answer = split_thought(out.text, opened=True)
    assert thought and out.text.count("</think>") == 1
    if out.finish_reason == "stop":
        assert isinstance(json.loads(answer), dict)
    else:
        assert answer.startswith("{")
