"""``kvserve cache``: save a prompt's KV to a file, and look into prompt-cache files and disk caches.

    kvserve cache save [MODEL] --prompt-file F -o S.kvc    compute a prompt once, keep its KV
    kvserve run|serve MODEL --prompt-cache S.kvc            start with it in the prefix cache
    kvserve cache info S.kvc | DIR                          what a file or a disk cache holds
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from kvserve.cli.options import add_engine_args, load_engine


def add_parser(sub, name: str) -> None:
    p = sub.add_parser(name, help="save a prompt's KV cache to a file; inspect cache files and directories")
    actions = p.add_subparsers(dest="action", metavar="ACTION", required=True)
    save = actions.add_parser("save", help="compute a prompt and save its KV blocks to a .kvc file")
    save.add_argument("model", nargs="?", default=None,
                      help="registry name, .gguf file or HF folder (default smollm2)")
    save.add_argument("--prompt-file", required=True,
                      help="text file whose content is the prompt (sent as is)")
    save.add_argument("-o", "--output", required=True, help="the .kvc file to write")
    add_engine_args(save, max_num_seqs=1)
    save.set_defaults(handler=run_save)
    info = actions.add_parser("info", help="what a .kvc file or a --kv-disk-cache directory holds")
    info.add_argument("path", help="a .kvc file or a disk cache directory")
    info.add_argument("--json", action="store_true", help="print one JSON object")
    info.set_defaults(handler=run_info)


def run_save(args: argparse.Namespace) -> int:
    from kvserve.engine.sampling_params import SamplingParams
    from kvserve.kv.prompt_cache import save_prompt_cache

    try:
        text = Path(args.prompt_file).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"cannot read --prompt-file {args.prompt_file}: {e}") from None
    engine = load_engine(args)
    prompt = engine.tokenize_prompt(text)
    # one token past the prompt: the prompt's blocks are then all computed and cached
    engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
    engine.run_to_completion()
    tokens = save_prompt_cache(engine.cache, prompt, args.output)
    size = os.path.getsize(args.output)
    print(f"saved {tokens} of the prompt's {len(prompt)} tokens (whole blocks of {engine.kv.block_size}) to "
          f"{args.output}: {size / 2**20:.1f} MiB", file=sys.stderr)
    engine.close()
    return 0


def run_info(args: argparse.Namespace) -> int:
    path = Path(args.path)
    info = _directory_info(path) if path.is_dir() else _file_info(path)
    if args.json:
        print(json.dumps(info))
    else:
        for key, value in info.items():
            print(f"{key}: {value}")
    return 0


def _file_info(path: Path) -> dict:
    from kvserve.kv.prompt_cache import read_prompt_cache

    header, payload = read_prompt_cache(path)
    identity = header.get("identity") or {}
    layout = identity.get("layout") or {}
    extra = header.get("extra") or {}
    return {
        "file": str(path),
        "tokens": len(header.get("tokens") or []),
        "blocks": header.get("blocks"),
        "bytes": len(payload),
        "cache_type_k": layout.get("cache_type_k"),
        "cache_type_v": layout.get("cache_type_v"),
        "block_size": layout.get("block_size"),
        "model_fingerprint": identity.get("model"),
        "weights": identity.get("weights"),
        "kernels": identity.get("kernels"),
        "conversation_messages": len(extra.get("history") or []),
    }


def _directory_info(path: Path) -> dict:
    setups: dict[str, list[int]] = {}
    for setup in sorted(p for p in path.iterdir() if p.is_dir()):
        sizes = [f.stat().st_size for f in setup.rglob("*.kvb")]
        setups[setup.name] = [len(sizes), sum(sizes)]
    return {
        "directory": str(path),
        "blocks": sum(n for n, _ in setups.values()),
        "bytes": sum(b for _, b in setups.values()),
        "setups": {name: {"blocks": n, "bytes": b} for name, (n, b) in setups.items()},
    }
