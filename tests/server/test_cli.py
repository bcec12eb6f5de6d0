"""``streamkv serve`` option handling and ``streamkv chat`` against a live (fake) server."""

from __future__ import annotations

import argparse
import asyncio
import io
import signal
import socket
import subprocess
import sys
import time
import types
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import torch
from fake_engine import FakeChat, FakeEngine, token_at, token_text
from server_harness import RunningServer, wait_for
from starlette.applications import Starlette

from streamkv.chat_client import ChatOptions, interactive, one_shot
from streamkv.config import CacheConfig, ModelConfig, SchedulerConfig
from streamkv.server import cli
from streamkv.server.cli import build_configs, build_parser, main, parse_bytes

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(30)


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("4096", 4096),
        ("512MiB", 512 << 20),
        ("1GiB", 1 << 30),
        ("1.5gib", 3 << 29),
        ("2G", 2 * 10**9),
        ("64 KiB", 64 << 10),
        ("10mb", 10**7),
        ("3Mi", 3 << 20),
    ],
)
def test_parse_bytes(text: str, value: int) -> None:
    assert parse_bytes(text) == value


@pytest.mark.parametrize("text", ["", "MiB", "12XB", "-1GiB", "0", "1e9", "0.1"])
def test_parse_bytes_rejects(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError):
        parse_bytes(text)


def test_serve_defaults_match_the_configs() -> None:
    engine, server = build_configs(build_parser().parse_args(["serve"]))
    assert engine.cache == CacheConfig()
    assert engine.scheduler == SchedulerConfig()
    assert engine.model == ModelConfig()
    assert (server.host, server.port) == ("127.0.0.1", 8000)


def test_the_gguf_cache_flags_reach_the_model_config(tmp_path: Path) -> None:
    args = ["serve", "--gguf-cache-dir", str(tmp_path), "--gguf-cache-space", "2GiB"]
    model = build_configs(build_parser().parse_args(args))[0].model
    assert (model.gguf_cache_dir, model.gguf_cache_space) == (str(tmp_path), 2 << 30)
    assert build_configs(build_parser().parse_args(["serve", "--no-gguf-cache"]))[0].model.gguf_cache_dir is None


def test_serve_options_reach_the_configs() -> None:
    args = build_parser().parse_args(
        [
            "serve",
            "--model",
            "m.gguf",
            "--block-size",
            "32",
            "--kv-cache-memory",
            "256MiB",
            "--gpu-memory-utilization",
            "none",
            "--num-blocks",
            "100",
            "--max-model-len",
            "1024",
            "--max-num-seqs",
            "8",
            "--max-num-batched-tokens",
            "256",
            "--preemption-mode",
            "swap",
            "--no-prefix-caching",
            "--max-pinned-fraction",
            "0.25",
            "--session-ttl",
            "60",
            "--max-sessions",
            "7",
            "--swap-space",
            "1GiB",
            "--dtype",
            "bfloat16",
            "--device",
            "cpu",
            "--attention-backend",
            "torch",
            "--stats-interval",
            "0.5",
            "--port",
            "9000",
            "--host",
            "0.0.0.0",
        ]
    )
    engine, server = build_configs(args)
    assert engine.model.model == "m.gguf" and engine.model.dtype == "bfloat16" and engine.model.device == "cpu"
    assert engine.cache.block_size == 32 and engine.cache.kv_cache_memory == 256 << 20
    assert engine.cache.gpu_memory_utilization is None and engine.cache.num_blocks == 100
    assert not engine.cache.enable_prefix_caching and engine.cache.max_pinned_fraction == 0.25
    assert server.session_ttl == 60 and engine.cache.swap_space == 1 << 30
    assert server.max_sessions == 7
    assert build_configs(build_parser().parse_args(["serve", "--max-sessions", "none"]))[1].max_sessions is None
    assert engine.scheduler.max_model_len == 1024 and engine.scheduler.preemption_mode == "swap"
    assert engine.scheduler.max_num_seqs == 8 and engine.scheduler.max_num_batched_tokens == 256
    assert (server.host, server.port, server.stats_interval) == ("0.0.0.0", 9000, 0.5)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--block-size", "24"], "--block-size: block_size must be a power of two"),
        (["--session-ttl", "0"], "--session-ttl: session_ttl must be positive"),
        (["--max-sessions", "0"], "--max-sessions: max_sessions must be at least 1"),
        (["--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization"),
        (["--port", "70000"], "--port"),
        (["--kv-cache-memory", "lots"], "not a size in bytes"),
        (["--preemption-mode", "drop"], "invalid choice"),
        (["--gguf-cache-space", "lots"], "not a size in bytes"),
        (["--gguf-cache-dir", " "], "--gguf-cache-dir: gguf_cache_dir must not be empty"),
    ],
)
def test_bad_serve_options_are_clean_usage_errors(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as info:
        main(["serve", *argv])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_serve_wires_engine_metrics_app_and_uvicorn(monkeypatch: pytest.MonkeyPatch) -> None:
    built: dict[str, Any] = {}

    class Engine(FakeEngine):
        def __init__(self, config: Any, metrics: Any = None) -> None:
            super().__init__(metrics=metrics)
            built["config"], built["metrics"] = config, metrics

    class Server:
        def __init__(self, config: Any) -> None:
            built["uvicorn_config"] = config

        def run(self, sockets: list[socket.socket]) -> None:
            built["bound"] = sockets[0].getsockname()

    monkeypatch.setitem(sys.modules, "streamkv.engine", types.SimpleNamespace(AsyncEngine=Engine))
    import uvicorn

    monkeypatch.setattr(uvicorn, "Server", Server)
    port = free_port()
    assert main(["serve", "--port", str(port), "--num-blocks", "64", "--log-level", "warning"]) == 0
    assert built["config"].cache.num_blocks == 64 and built["metrics"] is not None
    registry = built["metrics"].registry
    assert registry.get_sample_value("streamkv_model_load_seconds", {"source": "folder"}) == 0.5  # FakeEngine's
    config = built["uvicorn_config"]
    assert isinstance(config.app, Starlette) and config.ws == "websockets-sansio"
    assert built["bound"] == ("127.0.0.1", port)  # the port was bound before uvicorn ran


def test_ctrl_c_ends_serve_without_a_traceback(monkeypatch: pytest.MonkeyPatch) -> None:
    """uvicorn shuts down gracefully on Ctrl-C, then raises the signal again (capture_signals): 130, nothing raised."""

    class Engine(FakeEngine):
        def __init__(self, config: Any, metrics: Any = None) -> None:
            super().__init__(metrics=metrics)

    class Server:
        def __init__(self, config: Any) -> None:
            pass

        def run(self, sockets: list[socket.socket]) -> None:
            raise KeyboardInterrupt

    monkeypatch.setitem(sys.modules, "streamkv.engine", types.SimpleNamespace(AsyncEngine=Engine))
    import uvicorn

    monkeypatch.setattr(uvicorn, "Server", Server)
    assert main(["serve", "--port", str(free_port()), "--num-blocks", "64", "--log-level", "warning"]) == 130


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_busy_port_fails_fast_in_one_line_before_loading() -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        t0 = time.monotonic()
        proc = subprocess.run(
            [sys.executable, "-m", "streamkv", "serve", "--port", str(port)],
            capture_output=True,
            text=True,
            cwd=REPO,
            timeout=25,
        )
    assert proc.returncode == 1
    assert time.monotonic() - t0 < 20  # no model load (that takes 30 s and more here)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and f"cannot listen on 127.0.0.1:{port}" in lines[0] and "--port" in lines[0], lines
    assert "streamkv ready" not in proc.stderr and "streamkv listening" not in proc.stderr
    assert "Traceback" not in proc.stderr


def one_line_startup_error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    assert main(["serve", "--port", str(free_port()), *argv]) == 1
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    assert "listening" not in err
    return err


@pytest.mark.parametrize("model", ["/no/such/model.gguf", "NoSuchOrg/no-such-model-xyz"])
def test_model_not_found_is_one_line_with_a_cache_hint(model: str, capsys: pytest.CaptureFixture[str]) -> None:
    err = one_line_startup_error(["--model", model], capsys)
    assert f"--model {model}" in err and "local model cache" in err and "nothing is downloaded" in err


def test_model_that_is_not_a_model_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    junk = tmp_path / "weights.bin"
    junk.write_bytes(b"junk")
    assert "not a .gguf file or a transformers folder" in one_line_startup_error(["--model", str(junk)], capsys)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_device_cuda_without_cuda_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    err = one_line_startup_error(["--device", "cuda"], capsys)
    assert "--device cuda" in err and ("no CUDA" in err or "no CUDA device" in err)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_triton_backend_without_a_gpu_is_refused_at_start(capsys: pytest.CaptureFixture[str]) -> None:
    err = one_line_startup_error(["--attention-backend", "triton"], capsys)
    assert "--attention-backend triton needs a CUDA GPU" in err


def test_every_flag_has_help_and_each_default_once() -> None:
    parser = build_parser()
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for name, sub in subparsers.choices.items():
        formatter = sub._get_formatter()
        for action in sub._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            text = formatter._expand_help(action) if action.help else ""
            assert text.strip(), f"{name} {action.option_strings}: no help text"
            assert text.count("default") <= 1, f"{name} {action.option_strings}: {text!r}"
            assert "(default: None)" not in text and "(default: False)" not in text
    serve_help = subparsers.choices["serve"].format_help()
    flat = " ".join(serve_help.split())
    assert "(default: 512MiB)" in flat and "(default: 8000)" in flat and "(default: same origin only)" in flat
    print(serve_help)  # the help as a user sees it, once, in the test log


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("streamkv ") and any(ch.isdigit() for ch in out)


@pytest.mark.parametrize(
    ("url", "want"),
    [
        ("ws://127.0.0.1:8000/ws/chat", "ws://127.0.0.1:8000/ws/chat"),
        ("http://127.0.0.1:8000", "ws://127.0.0.1:8000/ws/chat"),
        ("http://127.0.0.1:8000/", "ws://127.0.0.1:8000/ws/chat"),
        ("https://chat.example.com", "wss://chat.example.com/ws/chat"),
        ("localhost:9000", "ws://localhost:9000/ws/chat"),
        ("wss://h:1/custom/path", "wss://h:1/custom/path"),
    ],
)
def test_chat_url_accepts_http_and_ws(url: str, want: str) -> None:
    assert cli.chat_url(url) == want


def test_chat_url_rejects_other_schemes(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["chat", "--url", "ftp://host", "-m", "hi"])
    assert info.value.code == 2 and "--url" in capsys.readouterr().err


def test_help_does_not_import_torch() -> None:
    code = "import sys, streamkv.server.cli as c; assert 'torch' not in sys.modules and 'uvicorn' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO, timeout=20)
    out = subprocess.run(
        [sys.executable, "-m", "streamkv", "--help"], capture_output=True, text=True, cwd=REPO, timeout=20, check=True
    )
    assert "serve" in out.stdout and "chat" in out.stdout


# ------------------------------------------------------------------ chat


def answer(prompt: list[int], n: int) -> str:
    return "".join(token_text(token_at(len(prompt), step, 0)) for step in range(n))


def test_one_shot(server: RunningServer, engine: FakeEngine, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["chat", "--url", server.ws_url(), "-m", "hi there", "--max-tokens", "4", "--system", "sys"])
    assert code == 0
    captured = capsys.readouterr()
    assert captured.out == answer(FakeChat().first_turn("hi there", "sys"), 4) + "\n"
    assert captured.err.startswith("[length; 4 tokens, 0 cached") and "total" in captured.err  # the usage footer
    req = engine.requests[0]
    assert req.params.max_tokens == 4 and req.params.temperature == 0.7


def test_one_shot_reads_streamkv_url_as_http(
    server: RunningServer, engine: FakeEngine, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("STREAMKV_URL", server.http_url)
    assert main(["chat", "-m", "hi", "--max-tokens", "2"]) == 0
    assert len(engine.requests) == 1 and "[length; 2 tokens" in capsys.readouterr().err


def test_one_shot_error_and_unreachable(server: RunningServer) -> None:
    out, err = io.StringIO(), io.StringIO()
    assert asyncio.run(one_shot(ChatOptions(url=server.ws_url(), max_tokens=5000), "hi", out, err)) == 1
    assert "prompt_too_long" in err.getvalue()
    assert asyncio.run(one_shot(ChatOptions(url="ws://127.0.0.1:9/ws/chat"), "hi", out, err)) == 2


class InterruptOnFirstText(io.StringIO):
    """Presses Ctrl-C as soon as the answer starts (inside the event loop, while the handler is set)."""

    def write(self, s: str) -> int:
        if s and not self.getvalue():
            signal.raise_signal(signal.SIGINT)
        return super().write(s)


def test_ctrl_c_cancels_the_answer(server: RunningServer, engine: FakeEngine) -> None:
    out, err = InterruptOnFirstText(), io.StringIO()
    code = asyncio.run(one_shot(ChatOptions(url=server.ws_url(), max_tokens=1000), "long", out, err))
    assert code == 130
    assert len(engine.aborted) == 1
    assert 0 < len(out.getvalue().split()) < 1000


async def lines(*items: str) -> AsyncIterator[str]:
    for item in items:
        yield item


def test_interactive_keeps_the_session_and_resets(server: RunningServer, engine: FakeEngine) -> None:
    out, err = io.StringIO(), io.StringIO()
    options = ChatOptions(url=server.ws_url(), max_tokens=3)
    code = asyncio.run(interactive(options, lines("hello", "", "more", "/reset", "fresh", "/quit", "never"), out, err))
    assert code == 0
    chat = FakeChat()
    p1 = chat.first_turn("hello", None)
    assert [r.prompt_ids[: len(p1)] == p1 for r in engine.requests] == [True, True, False]
    assert engine.requests[2].prompt_ids == chat.first_turn("fresh", None)
    # reset released the first session, closing the socket the second
    wait_for(lambda: engine.released == [engine.requests[0].session_id, engine.requests[2].session_id])
    assert out.getvalue().startswith(answer(p1, 3) + "\n")
    assert "(new conversation)" in err.getvalue() and "[length; 3 tokens" in err.getvalue()


def test_streamkv_chat_reads_stdin(server: RunningServer, engine: FakeEngine) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "streamkv", "chat", "--url", server.ws_url(), "--max-tokens", "2"],
        input="one\ntwo\n",
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=20,
    )
    assert proc.returncode == 0, proc.stderr
    assert len(engine.requests) == 2 and engine.requests[0].session_id == engine.requests[1].session_id
    assert proc.stdout.count("\n") == 2


def test_cli_module_is_the_console_script() -> None:
    assert cli.main is main
