"""``kvserve serve [MODEL ...]``: OpenAI- and Ollama-compatible HTTP APIs over one model, and more loaded
on demand (server/model_slots.py)."""

from __future__ import annotations

import argparse
import os
import socket
import sys
from pathlib import Path

from kvserve.cli.options import add_engine_args, load_engine, parse_bytes
from kvserve.models.registry import DEFAULT_MODEL, REGISTRY
from kvserve.server.server_config import DEFAULT_MAX_BODY_BYTES


class _Models(argparse.Action):
    """MODEL ...: also ``model``, the first (what the engine options read, as other commands' MODEL)."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        namespace.models = list(values or [])
        namespace.model = namespace.models[0] if namespace.models else None


def add_parser(sub, name: str) -> None:
    p = sub.add_parser(name, help="serve models over OpenAI-, Ollama- and Anthropic-compatible HTTP APIs")
    p.add_argument(
        "models", nargs="*", metavar="MODEL", action=_Models,
        help="registry name, .gguf file or HF folder (default smollm2); the first is loaded at start and "
             "answers "
        "requests that name no model, the others load when a request names them",
    )
    p.add_argument("--models-dir", "--models", dest="models_dir", default=None, metavar="DIR",
                   help="also serve every .gguf file in DIR (named by its file name less .gguf), loaded on "
                        "demand")
    p.add_argument("--keep-alive", default="-1", metavar="DURATION",
                   help="how long a model stays loaded once idle, the first too: 5m, 1h, 30s, 0 (unload "
                        "after "
                   "each answer) or -1 (until evicted; default); a request's keep_alive overrides it")
    p.add_argument("--max-loaded-models", type=int, default=0, metavar="N",
                   help="models loaded at once, the first included (0: as many as --max-memory holds)")
    p.add_argument("--max-memory", type=parse_bytes, default=None, metavar="SIZE",
                   help="memory the server may take with all its loaded models, as kvserve plan counts each "
                        "(default: "
                   "the first model's plan and what this machine has available after loading it); the least "
                   "recently used idle model is unloaded to make room")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument(
        "--api-key",
        default=os.environ.get("KVSERVE_API_KEY"),
        help="require 'Authorization: Bearer KEY' (default: $KVSERVE_API_KEY, else no key)",
    )
    p.add_argument(
        "--served-model-name",
        default=None,
        help="the model name clients send (default: the registry name or the file's stem)",
    )
    p.add_argument(
        "--max-body-size",
        type=parse_bytes,
        default=DEFAULT_MAX_BODY_BYTES,
        help="largest request body; larger ones get 413 (default 4MiB)",
    )
    p.add_argument("--max-n", type=int, default=16, help="most choices one OpenAI request may ask for (n)")
    p.add_argument(
        "--special-tokens-in-messages",
        action="store_true",
        help="read special-token strings in chat messages (e.g. '<|im_start|>') as control tokens; by "
             "default "
        "they are plain text, so a client cannot forge a system turn",
    )
    p.add_argument(
        "--embedding-model",
        default=None,
        metavar="MODEL",
        help="also serve sentence embeddings (/v1/embeddings, /api/embed) from this encoder: a registry name "
        "(all-minilm) or an HF folder of a BERT-family sentence-transformers model",
    )
    p.add_argument(
        "--embedding-weights",
        default="f32",
        choices=["f32", "int8"],
        help="the encoders' projections: f32 (sentence-transformers' vectors; default) or int8 (about twice "
             "as "
        "fast, cosine >= 0.9997 to them)",
    )
    p.add_argument(
        "--rerank-model",
        default=None,
        metavar="PATH",
        help="also serve /v1/rerank from this reranker: an HF folder of a BERT sequence-classification "
        "cross-encoder (e.g. ms-marco-MiniLM-L6-v2), or a decoder GGUF judging yes/no (Qwen3-Reranker)",
    )
    p.add_argument(
        "--reasoning-budget",
        type=int,
        default=-1,
        metavar="N",
        help="thought tokens a reasoning model (Qwen3, DeepSeek-R1 distills) may write before its thought is "
        "closed for it; -1: no limit (default), 0: thinking off",
    )
    p.add_argument(
        "--kv-events",
        default=None,
        metavar="ENDPOINT",
        help="publish the prefix cache's events (block stored / removed / all cleared) over ZeroMQ in vLLM's "
        "format, for llm-d's KV indexer or Dynamo's KV router: tcp://*:5557 binds, tcp://HOST:PORT connects",
    )
    p.add_argument(
        "--replicas",
        type=int,
        default=None,
        metavar="N",
        help="run N engine replicas as Ray Serve deployments, routed by the prompt's cached prefix, then by "
        "queue length (pip install 'kvserve[ray]'); each takes -t threads (default 1)",
    )
    p.add_argument(
        "--ray-address",
        default=None,
        metavar="ADDR",
        help="with --replicas: the Ray cluster to join (HOST:PORT of its head, or 'auto'); default: start a "
        "Ray instance on this machine",
    )
    p.add_argument("--temperature", "--temp", type=float, default=None, metavar="T",
                   help="the temperature of a request that sets none (llama.cpp's --temp; 0: greedy); "
                        "default: "
                   "each API's own (OpenAI and Anthropic 1, Ollama and /infill 0.8)")
    p.add_argument("--stream-heartbeat", type=float, default=5.0, metavar="SECONDS",
                   help="a streamed answer sends a ping (an Anthropic ping event, an SSE comment, an empty "
                        "Ollama "
                   "line) this often while its prompt is read, so agents do not drop a silent stream "
                   "(default 5)")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    p.add_argument("--no-access-log", action="store_true", help="do not log every request")
    add_engine_args(p, max_num_seqs=8)
    p.set_defaults(handler=run, num_ctx=2048)


def served_name(model: str | None, override: str | None) -> str:
    if override:
        return override
    model = model or DEFAULT_MODEL
    if model in REGISTRY:
        return model
    path = Path(model).expanduser()
    return path.stem if path.suffix == ".gguf" else path.name or model


def check_port_free(host: str, port: int) -> None:
    """Fail before the model loads, not after, when the address is taken."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            raise ValueError(f"cannot listen on {host}:{port}: {e.strerror}; pick another --port") from None


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from kvserve.engine.async_engine import AsyncLLMEngine
    from kvserve.engine.heap import resident_bytes
    from kvserve.server import ServerConfig, build_app
    from kvserve.server.graceful import EndingStreamsServer
    from kvserve.server.replicas.kv_events import check_endpoint

    if not 0 < args.port < 65536:
        raise ValueError(f"--port must be between 1 and 65535, got {args.port}")
    _encoders_among_models(args)
    args.model = args.models[0] if args.models else None
    others = other_models(args)
    config = ServerConfig(
        model_name=served_name(args.model, args.served_model_name),
        host=args.host,
        port=args.port,
        api_key=args.api_key or None,
        max_body_bytes=args.max_body_size,
        max_n=args.max_n,
        special_tokens_in_messages=args.special_tokens_in_messages,
        reasoning_budget=args.reasoning_budget,
        temperature=args.temperature,
        heartbeat_seconds=args.stream_heartbeat,
        kv_events=check_endpoint(args.kv_events) if args.kv_events else None,
    )
    if args.replicas is not None:
        from kvserve.cli.serve_replicas import run_replicas

        if others:
            raise ValueError("--replicas serves one model; give one MODEL")
        return run_replicas(args, config)
    if args.ray_address is not None:
        raise ValueError("--ray-address needs --replicas N")
    check_port_free(args.host, args.port)
    engine = load_engine(args)
    max_model_len = engine.max_model_len
    async_engine = AsyncLLMEngine(engine)
    before = resident_bytes()
    encoder = _encoder(args.embedding_model, "--embedding-model", False, args.embedding_weights)
    reranker = _encoder(args.rerank_model, "--rerank-model", True, args.embedding_weights)
    # what the encoders took (weights as held, tokenizer tables), and a decoder's KV pool,
    after = resident_bytes()
    # which is not resident until written
    beside = after - before if before is not None and after is not None else 0
    beside += sum(e.engine.engine.kv_pool_bytes for e in (encoder, reranker) if hasattr(e, "engine"))
    models = _served_models(args, others, config, beside)
    app = build_app(async_engine, config, encoder=encoder, reranker=reranker, models=models)
    del async_engine, engine  # the app's models hold it now: unloading it frees it
    url = f"http://{args.host}:{args.port}"
    print(
        f"serving {config.model_name} on {url} (OpenAI: {url}/v1, Ollama: {url}/api, metrics: {url}/metrics; "
        f"context {max_model_len} tokens, {args.max_num_seqs} at once)",
        file=sys.stderr,
        flush=True,
    )
    server_config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        access_log=not args.no_access_log,
        timeout_graceful_shutdown=5,
    )
    EndingStreamsServer(server_config, app.state.models.end_streams).run()
    return 0


def _encoders_among_models(args: argparse.Namespace) -> None:
    """An encoder named among the models (``kvserve serve smollm2 all-minilm``) is served as
    --embedding-model (or, a cross-encoder, --rerank-model) would serve it."""
    from kvserve.models.encoder_config import read_encoder_config
    from kvserve.models.gguf_encoder import is_encoder

    chat = []
    for model in args.models:
        path = Path(model).expanduser()
        entry = REGISTRY.get(model)
        if not (entry is not None and entry.kind == "embedding" or path.exists() and is_encoder(path)):
            chat.append(model)
            continue
        flag = "rerank_model" if path.is_dir() and read_encoder_config(path).num_labels else "embedding_model"
        if getattr(args, flag):
            raise ValueError(f"{model}: a second {flag.replace('_', ' ')} beside --{flag.replace('_', '-')}")
        setattr(args, flag, model)
    args.models = chat


def _encoder(name: str | None, flag: str, rerank: bool, weights: str = "f32"):
    """The encoder a flag names (a registry name or an HF folder), or None; ValueError when it is not one
    of the kind the flag serves (sentence embeddings, or a cross-encoder's relevance)."""
    if not name:
        return None
    from kvserve.embedding.encoders import open_encoder
    from kvserve.models.gguf_encoder import is_encoder
    from kvserve.models.registry import resolve

    path = resolve(name, auto_pull=True)
    if not (is_encoder(path) or rerank and path.suffix == ".gguf"):
        raise ValueError(f"{flag} {name}: not an encoder (a BERT folder or GGUF, an embedding GGUF"
                         f"{', or a decoder GGUF to rerank with' if rerank else ''})")
    encoder = open_encoder(path, served_name(name, None), weights, rerank)
    if bool(encoder.config.num_labels) != rerank:
        kind = "a cross-encoder (sequence classification)" if rerank else "a sentence-embedding model"
        raise ValueError(f"{flag} {name}: not {kind}")
    return encoder



def other_models(args: argparse.Namespace) -> list[str]:
    """The models after the first, and the .gguf files of --models-dir, each once."""
    found = list(args.models[1:])
    if args.models_dir:
        folder = Path(args.models_dir).expanduser()
        if not folder.is_dir():
            raise ValueError(f"--models-dir {args.models_dir}: no such folder")
        found += [str(p) for p in sorted(folder.glob("*.gguf"))]
    if args.max_loaded_models < 0:
        raise ValueError(f"--max-loaded-models must be >= 0, got {args.max_loaded_models}")
    return list(dict.fromkeys(m for m in found if m != args.model))


def planned_bytes(args: argparse.Namespace, source: str, with_runtime: bool = False, spec=None) -> int:
    """What ``kvserve plan`` says the engine takes for ``source`` (read as ``spec`` when the caller has it)
    at this server's settings: its weights, pool, activations and tokenizer, and (``with_runtime``) the
    Python runtime every model shares."""
    from kvserve.plan.model_spec import resolve_model
    from kvserve.plan.planner import RUNTIME_OVERHEAD_BYTES, PlanSettings, make_plan

    spec = spec or resolve_model(source)
    k, v = args.cache_type_k or args.cache_type, args.cache_type_v or args.cache_type
    settings = PlanSettings(contexts=(min(args.num_ctx, spec.config.max_position_embeddings),),
                            kv_types=((k, v),), memory=1 << 60, max_num_seqs=args.max_num_seqs,
                            max_num_batched_tokens=args.max_num_batched_tokens, block_size=args.block_size,
                            weights=args.weights, window_kv=not args.no_window_kv)
    total = make_plan(spec, settings).kv[0].contexts[0].engine_total
    return total if with_runtime else total - RUNTIME_OVERHEAD_BYTES


def _served_models(args: argparse.Namespace, others: list[str], config, beside: int = 0):
    """The factory build_app calls with the first model's Serving: every model a slot, sized by the planner
    (when there are several), loaded (again) by ``load_engine`` with this server's settings. ``beside``:
    bytes the embedding and rerank models took, which stay loaded: not the chat models' to take."""
    from kvserve.engine.async_engine import AsyncLLMEngine
    from kvserve.models.registry import resolve
    from kvserve.plan.model_spec import resolve_model
    from kvserve.plan.planner import RUNTIME_OVERHEAD_BYTES, available_memory
    from kvserve.server.model_card import ModelCard
    from kvserve.server.model_slots import ServedModels, keep_alive_seconds
    from kvserve.server.ollama.schemas import DURATION
    from kvserve.server.serving import Serving

    if not DURATION.match(args.keep_alive.strip()):
        raise ValueError(f"--keep-alive {args.keep_alive}: not a duration (use e.g. 5m, 1h, 30s, 0 or -1)")
    keep_alive = keep_alive_seconds(args.keep_alive, None)
    slots = {}
    for source in others:
        resolve(source)  # a missing file or an unknown name: said now, not at the first request
        name = served_name(source, None)
        if name in slots or name == config.model_name:
            raise ValueError(f"two models would be served as '{name}': rename a file")
        spec = resolve_model(source)  # its header, read once for the plan and the card
        slots[name] = (source, planned_bytes(args, source, spec=spec),
                       ModelCard.from_file(source, name, args.num_ctx,
                                                                                           spec))
    first_source = args.model or DEFAULT_MODEL
    first = planned_bytes(args, first_source) if slots else 0  # alone, no budget to keep
    # the first model and the runtime are loaded already: the models may take what they hold and what is left
    budget = available_memory()[0] + first
    if isinstance(args.max_memory, int):
        budget = args.max_memory - RUNTIME_OVERHEAD_BYTES - beside
        if budget < first:
            raise ValueError(
                f"--max-memory holds less than the first model, the runtime and the embedding and "
                             f"rerank models: {(first + RUNTIME_OVERHEAD_BYTES + beside) / 2**20:.0f} MiB")

    def make(primary: Serving) -> ServedModels:
        # not the first Serving: it must be freed when unloaded
        metrics, config = primary.metrics, primary.config

        def load(source: str, name: str) -> Serving:
            engine = load_engine(argparse.Namespace(**{**vars(args), "model": source}))
            return Serving(AsyncLLMEngine(engine), ModelCard.from_engine(engine, name), metrics, config)

        return ServedModels(primary, slots, load, budget=budget, max_loaded=args.max_loaded_models,
                            keep_alive=keep_alive, first_source=first_source, first_planned=first)

    return make
