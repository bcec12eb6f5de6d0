"""``streamkv`` command line: ``serve`` (the server) and ``chat`` (a terminal client).

Only argparse and the config records are imported at module level, so
``streamkv --help`` does not pay for torch; the engine, uvicorn and the
websockets client are imported by the command that needs them.
"""

from __future__ import annotations

import argparse
import logging
import re
import sys
from collections.abc import Sequence

from streamkv.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, ServerConfig

logger = logging.getLogger("streamkv")

_DECIMAL = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_BINARY = {"ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}
_UNITS = {"": 1, "b": 1, **{u + s: v for u, v in (_DECIMAL | _BINARY).items() for s in ("", "b")}}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*)\s*$")


def parse_bytes(text: str) -> int:
    """``"512MiB"`` -> 536870912. Binary (KiB, MiB, GiB, TiB; Ki, Mi, Gi) and
    decimal (KB, MB, GB, TB; K, M, G) suffixes, any case; a bare number is bytes."""
    m = _SIZE.match(text)
    unit = m.group(2).lower() if m else ""
    if m is None or unit not in _UNITS:
        raise argparse.ArgumentTypeError(f"not a size in bytes: {text!r} (examples: 536870912, 512MiB, 1.5GiB)")
    value = float(m.group(1)) * _UNITS[unit]
    if value < 1:
        raise argparse.ArgumentTypeError(f"size must be at least 1 byte: {text!r}")
    return int(value)


def _fraction_or_none(text: str) -> float | None:
    if text.lower() in ("none", "off"):
        return None
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="streamkv", description="LLM serving with a paged KV cache.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="{serve,chat}")

    cache, sched = CacheConfig(), SchedulerConfig()
    serve = sub.add_parser(
        "serve", help="run the HTTP/WebSocket server", formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    serve.add_argument(
        "--model", default=None, help="transformers folder, .gguf file or hub id (default: SmolLM2-135M-Instruct GGUF)"
    )
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--block-size", type=int, default=cache.block_size, help="tokens per KV block")
    serve.add_argument(
        "--kv-cache-memory",
        type=parse_bytes,
        default=cache.kv_cache_memory,
        help="bytes of KV pool (suffixes: 512MiB, 1GiB)",
    )
    serve.add_argument(
        "--gpu-memory-utilization",
        type=_fraction_or_none,
        default=cache.gpu_memory_utilization,
        help="CUDA: fraction of device memory for the engine ('none': use --kv-cache-memory)",
    )
    serve.add_argument("--num-blocks", type=int, default=None, help="exact KV pool size (overrides the sizing)")
    serve.add_argument("--max-model-len", type=int, default=None, help="prompt + output limit (default: the model's)")
    serve.add_argument("--max-num-seqs", type=int, default=sched.max_num_seqs)
    serve.add_argument("--max-num-batched-tokens", type=int, default=sched.max_num_batched_tokens)
    serve.add_argument("--preemption-mode", choices=("recompute", "swap"), default=sched.preemption_mode)
    serve.add_argument("--no-prefix-caching", action="store_true", help="disable prefix caching")
    serve.add_argument("--max-pinned-fraction", type=float, default=cache.max_pinned_fraction)
    serve.add_argument("--session-ttl", type=float, default=cache.session_ttl, help="seconds an idle session lives")
    serve.add_argument("--swap-space", type=parse_bytes, default=cache.swap_space, help="bytes of host swap")
    serve.add_argument("--dtype", choices=("auto", "float32", "bfloat16", "float16"), default="auto")
    serve.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    serve.add_argument("--attention-backend", choices=("auto", "torch", "cpu", "triton"), default="auto")
    serve.add_argument(
        "--seed", type=int, default=None, help="seed of the engine's generator for unseeded requests (default: random)"
    )
    serve.add_argument(
        "--stats-interval",
        type=float,
        default=ServerConfig().stats_interval,
        help="seconds between /ws/stats snapshots",
    )
    serve.add_argument("--log-level", choices=("debug", "info", "warning", "error"), default="info")
    serve.set_defaults(subparser=serve)

    serve.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch CPU threads for the engine (default: torch's, one per core); "
        "fewer than the cores leaves room for other processes",
    )

    chat = sub.add_parser("chat", help="chat with a running server from the terminal")
    chat.add_argument("--url", default="ws://127.0.0.1:8000/ws/chat")
    chat.add_argument("-m", "--message", default=None, help="one-shot: ask this, print the answer, exit")
    chat.add_argument("--system", default=None, help="system prompt (first turn)")
    chat.add_argument("--max-tokens", type=int, default=256)
    chat.add_argument("--temperature", type=float, default=0.7)
    chat.add_argument("--top-p", type=float, default=None)
    chat.add_argument("--seed", type=int, default=None)
    chat.add_argument("--session-id", default=None, help="resume a resumable session")
    chat.add_argument("--resumable", action="store_true", help="keep the session after disconnecting")
    return parser


def build_configs(args: argparse.Namespace) -> tuple[EngineConfig, ServerConfig]:
    """The frozen configs of ``serve``; raises ValueError naming the bad option."""
    engine = EngineConfig(
        model=ModelConfig(
            model=args.model,
            dtype=args.dtype,
            device=args.device,
            attention_backend=args.attention_backend,
            seed=args.seed,
        ),
        cache=CacheConfig(
            block_size=args.block_size,
            kv_cache_memory=args.kv_cache_memory,
            gpu_memory_utilization=args.gpu_memory_utilization,
            num_blocks=args.num_blocks,
            enable_prefix_caching=not args.no_prefix_caching,
            max_pinned_fraction=args.max_pinned_fraction,
            session_ttl=args.session_ttl,
            swap_space=args.swap_space,
        ),
        scheduler=SchedulerConfig(
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_model_len=args.max_model_len,
            preemption_mode=args.preemption_mode,
        ),
    )
    server = ServerConfig(host=args.host, port=args.port, stats_interval=args.stats_interval)
    return engine, server


def _name_the_flag(message: str, args: argparse.Namespace) -> str:
    """Config errors start with the field name ("block_size must be ..."): name the flag instead."""
    field_name = message.split(" ", 1)[0]
    if field_name in vars(args):
        return f"argument --{field_name.replace('_', '-')}: {message}"
    return message


def serve(engine_config: EngineConfig, server_config: ServerConfig, log_level: str, threads: int | None = None) -> None:
    import torch
    import uvicorn

    from streamkv.engine import AsyncEngine
    from streamkv.metrics import EngineMetrics
    from streamkv.server.app import create_app
    from streamkv.server.protocol import WS_MAX_SIZE

    if threads is not None:
        torch.set_num_threads(threads)
    metrics = EngineMetrics()
    engine = AsyncEngine(engine_config, metrics=metrics)
    app = create_app(engine, server_config, metrics)
    host, port = server_config.host, server_config.port
    logger.info(
        "streamkv listening on http://%s:%d  (chat: ws://%s:%d/ws/chat, metrics: /metrics)", host, port, host, port
    )
    uvicorn.run(
        app,
        host=host,
        port=port,
        ws="websockets-sansio",
        ws_max_size=WS_MAX_SIZE,
        lifespan="on",
        log_level=log_level,
        timeout_graceful_shutdown=5,
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "serve":
        try:
            engine_config, server_config = build_configs(args)
        except ValueError as e:
            args.subparser.error(_name_the_flag(str(e), args))  # exits 2
        logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        if args.threads is not None and args.threads < 1:
            args.subparser.error("argument --threads: must be at least 1")
        serve(engine_config, server_config, args.log_level, args.threads)
        return 0
    from streamkv.server.chat_client import ChatOptions, run_chat

    options = ChatOptions(
        url=args.url,
        system=args.system,
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        seed=args.seed,
        session_id=args.session_id,
        resumable=args.resumable,
    )
    return run_chat(options, message=args.message)


if __name__ == "__main__":
    sys.exit(main())
