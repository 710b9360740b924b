"""``kvserve run [MODEL] [PROMPT]``: stream an answer, or chat interactively, and report the speed."""

from __future__ import annotations

import argparse
import json
import sys
from typing import TYPE_CHECKING

from kvserve.cli.options import add_engine_args, load_engine
from kvserve.models.registry import REGISTRY

if TYPE_CHECKING:  # the engine's modules are imported when a command runs, not for --help
    from kvserve.engine.sampling_params import SamplingParams


def add_parser(sub, name: str) -> None:
    p = sub.add_parser("run", help="generate from a prompt, or chat when no prompt is given")
    p.add_argument("model", nargs="?", default=None,
                   help="registry name, .gguf file or HF folder (default smollm2)")
    p.add_argument("prompt", nargs="?", default=None,
                   help="prompt (default: read stdin, or chat on a terminal)")
    p.add_argument("--max-tokens", "-n", type=int, default=512, help="tokens to generate at most")
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("--top-k", type=int, default=40)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--repeat-penalty", dest="repetition_penalty", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--system", default=None, help="system message for the chat template")
    p.add_argument("--raw", action="store_true", help="send the prompt as is, without the chat template")
    p.add_argument("--json", action="store_true", help="print one JSON object with the text and the timings")
    add_engine_args(p, max_num_seqs=1)
    p.set_defaults(handler=run)


def sampling_params(args: argparse.Namespace) -> SamplingParams:
    from kvserve.engine.sampling_params import SamplingParams

    return SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        repetition_penalty=args.repetition_penalty,
        seed=args.seed,
    )


def _looks_like_model(text: str) -> bool:
    from pathlib import Path

    return text in REGISTRY or text.endswith(".gguf") or Path(text).expanduser().exists()


def no_template_warning(model: str, tokenizer) -> str:
    """What a chat prompt to a model whose file has no chat template gets told (a base model echoes or
    rambles on a format it was never trained on)."""
    guessed = "its architecture's usual turns" if tokenizer.chat_template else "plain 'role: text' lines"
    return (f"warning: {model} has no chat template in its file (a pretrained base model?): the "
            f"chat is formatted with {guessed}, which it may only echo or continue; --raw gives it the text "
            "to continue")


def run(args: argparse.Namespace) -> int:
    from kvserve.cli.chat import interactive_chat
    from kvserve.cli.live import generate_streaming, result_record, stats_line

    if args.model is not None and args.prompt is None and not _looks_like_model(args.model):
        args.model, args.prompt = None, args.model  # `kvserve run "a question"` uses the default model
    params = sampling_params(args)
    prompt = args.prompt
    if prompt is None and not sys.stdin.isatty():
        prompt = sys.stdin.read()
        if not prompt.strip():
            raise ValueError("no prompt: give one as an argument or on stdin")
    if prompt is None and args.context_overflow is None:
        args.context_overflow = "shift"  # a chat goes on past the context, as Ollama's does
    engine = load_engine(args)
    if not args.raw and not engine.tokenizer.template_from_file:
        print(no_template_warning(args.model or engine.config.model, engine.tokenizer), file=sys.stderr)
    if prompt is None:
        return interactive_chat(engine, params, args.system)
    messages = [{"role": "system", "content": args.system}] if args.system else []
    messages.append({"role": "user", "content": prompt})
    prompt_ids = engine.tokenizer.encode(prompt) if args.raw else engine.tokenizer.encode_chat(messages)
    final = generate_streaming(engine, prompt_ids, params, echo=not args.json)
    if args.json:
        print(json.dumps(result_record(engine, final)))
    else:
        print(file=sys.stdout, flush=True)
        print(stats_line(engine, final), file=sys.stderr)
    return 0
