"""The interactive chat's commands, driven through its command handler (no terminal needed)."""

from __future__ import annotations

from kvserve.cli.chat import ChatSession, _command, cache_report
from kvserve.engine.sampling_params import SamplingParams
from tests.support import make_engine


def test_show_cache_reports_blocks_and_bytes_by_k_and_v_type(tiny_llama_hd64):
    engine = make_engine(tiny_llama_hd64, num_ctx=64, max_num_seqs=2, cache_type_k="q8_0", cache_type_v="tq3")
    a = engine.add_request(list(range(3, 40)), SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    engine.add_request(list(range(3, 40)), SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    engine.step()
    report = cache_report(engine)
    in_use = len({b for rid in (a.request_id, "req-1") for b in engine.kv.block_ids(rid)})
    assert f"in use {in_use} (shared 2)" in report  # two full 16-token blocks shared by the prompts
    # per block: layers x kv_heads x block_size head-vectors, 68 bytes each (q8_0) / 26 (tq3) at head_dim 64
    per_k, per_v = 2 * 2 * 16 * 68, 2 * 2 * 16 * 26
    assert f"K q8_0: {in_use * per_k / 2**20:.2f} MiB" in report
    assert f"V tq3: {in_use * per_v / 2**20:.2f} MiB" in report
    engine.run_to_completion()
    assert "in use 0 (shared 0)" in cache_report(engine)


def test_set_parameter_and_clear(tiny_llama):
    engine = make_engine(tiny_llama)
    chat = ChatSession(SamplingParams(), None, [1])
    assert _command("/set parameter temperature 0.2", engine, chat)
    assert chat.params.temperature == 0.2 and chat.history == [1]
    _command("/set parameter num_predict 7", engine, chat)
    assert chat.params.max_tokens == 7
    before = chat.params
    _command("/set parameter top_p 5", engine, chat)  # invalid: unchanged
    assert chat.params == before
    chat.system, chat.history = "sys", [1, 2]
    _command("/clear", engine, chat)
    assert chat.history == [] and chat.system == "sys"
    _command("/set system be brief", engine, chat)
    assert chat.system == "be brief"
    assert _command("/bye", engine, chat) is False


def test_save_and_load_a_conversation_with_its_kv(tiny_llama, tmp_path, capsys):
    a = make_engine(tiny_llama)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompt = [(i * 13) % 90 + 3 for i in range(60)]
    rid = a.add_request(prompt, params).request_id
    final = a.run_to_completion()[rid]
    chat = ChatSession(params, "be brief",
                       [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}],
                       list(final.prompt_token_ids) + final.token_ids)
    path = tmp_path / "talk.kvc"
    _command(f"/save {path}", a, chat)
    assert "saved the conversation (2 messages, 64 tokens" in capsys.readouterr().err

    b = make_engine(tiny_llama)
    fresh = ChatSession(params)
    _command(f"/load {path}", b, fresh)
    assert "loaded 2 messages" in capsys.readouterr().err
    assert fresh.system == "be brief" and fresh.history == chat.history
    rid = b.add_request(prompt + final.token_ids + [5, 6], params).request_id
    assert b.run_to_completion()[rid].metrics.num_cached_tokens == 64
    _command(f"/load {tmp_path / 'missing.kvc'}", b, fresh)  # an error line, the chat goes on
    assert "error: cannot read" in capsys.readouterr().err and fresh.history == chat.history
    _command("/save x.kvc", b, ChatSession(params))
    assert "nothing to save" in capsys.readouterr().err
