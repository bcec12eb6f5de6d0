"""Shared bits of the load tests and benchmarks.

Machine description (every script, the throughput family included, prints
it with its exact command line through :func:`print_header`), percentiles,
markdown tables, goal lines, model loading (``--model tiny`` builds the tiny
random Llama once) and a ``streamkv serve`` subprocess on 127.0.0.1 with
bounded start and stop.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from streamkv.model.loader import LoadedModel

REPO_ROOT = Path(__file__).resolve().parent.parent
TINY_MODEL_DIR = Path(tempfile.gettempdir()) / "streamkv-load-tests" / "tiny-llama"

# Common short English words: about one token each for BPE vocabularies (prompt filler).
WORDS = ("the a of and to in is it for on that with as was at by this be from or have an are not we can one all "
         "time data model cache block token memory server request user answer system page table queue stream "
         "batch step list value state engine thread event loop turn session chat write read keep make give "
         "small large first last next long short fast slow new old good clear simple early late").split()  # fmt: skip

# ------------------------------------------------------------------ machine


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_info(**extra: Any) -> dict[str, Any]:
    """Where and when a benchmark ran. ``contended`` flags a 1-min load above half the cores.

    ``extra`` (library versions, flags of the run) is appended as given.
    """
    info: dict[str, Any] = {
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "usable_cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    if "torch" in sys.modules:  # the load generator never imports torch
        torch = sys.modules["torch"]
        info["torch"] = torch.__version__
        info["torch_threads"] = torch.get_num_threads()
    try:
        load1, _, _ = os.getloadavg()
        info["loadavg_1m"] = round(load1, 2)
        info["contended"] = load1 > 0.5 * (os.cpu_count() or 1)
    except OSError:
        pass
    info.update(extra)
    return info


def command_line(module: str) -> str:
    return shlex.join(["python", "-m", module, *sys.argv[1:]])


def print_header(title: str, module: str, **extra: Any) -> dict[str, Any]:
    """Print the benchmark title, the machine and the exact command; return both for the JSON.

    ``extra`` goes into the machine record and is printed on its own line.
    """
    info = machine_info(**extra)
    print(f"# {title}")
    print(f"command: {command_line(module)}")
    torch_part = "torch not loaded"
    if "torch" in info:
        torch_part = f"torch {info['torch']} with {info['torch_threads']} threads"
    print(
        f"machine: {info['cpu']}, {info['cores']} cores ({info['usable_cores']} usable), {torch_part}, "
        f"python {info['python']}, {info['date']}, load avg {info.get('loadavg_1m', '?')}"
    )
    if extra:
        print("with: " + ", ".join(f"{k} {v}" for k, v in extra.items()))
    if info.get("contended"):
        print("WARNING: the machine is busy (load average above half the cores): timings are provisional")
    return {"title": title, "command": command_line(module), "machine": info}


def load_warning(machine: dict[str, Any]) -> str | None:
    """A contention note when the load average at the end exceeds what this run adds (its torch threads).

    ``machine`` is :func:`machine_info`'s record from the start of the run.
    """
    try:
        load1 = os.getloadavg()[0]
    except OSError:
        return None
    threads = machine.get("torch_threads") or 1
    if load1 > threads + 0.5:
        return (
            f"load average {load1:.1f} at the end of the run on {machine.get('cores')} cores (this benchmark alone "
            f"adds ~{threads}): contended, figures PROVISIONAL"
        )
    return None


# -------------------------------------------------------------- statistics


def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q``-th percentile (0..100) with linear interpolation (numpy's default); ``None`` if empty."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def mean(values: Sequence[float]) -> float | None:
    return sum(values) / len(values) if values else None


def fmt(value: Any, digits: int = 1) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]], digits: int = 1) -> str:
    """A markdown table (pastes into docs/benchmarks.md as is)."""
    cells = [[str(h) for h in headers]] + [[fmt(c, digits) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(r, widths, strict=False)) + " |" for r in cells]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)


def goal(name: str, passed: bool, detail: str) -> dict[str, Any]:
    print(f"GOAL {'PASS' if passed else 'FAIL'}: {name} ({detail})")
    return {"goal": name, "passed": passed, "detail": detail}


def write_json(path: str | Path, obj: Any) -> None:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(obj, indent=1, default=str))
    print(f"wrote {p}")


# ------------------------------------------------------------------- models


def make_parser(doc: str | None) -> argparse.ArgumentParser:
    """An argparse parser described by the module docstring's first paragraph, defaults shown."""
    return argparse.ArgumentParser(
        description=(doc or "").split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )


def add_model_args(parser: argparse.ArgumentParser, default_model: str | None = None) -> None:
    parser.add_argument(
        "--model", default=default_model,
        help="'tiny' (random 2-layer Llama, built once under the temp dir), a model folder / .gguf, "
        "or omit for the default SmolLM2-135M GGUF",
    )  # fmt: skip
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads")


def load(model: str | None, threads: int) -> LoadedModel:
    """Load ``model`` on the CPU (``tiny``: build the tiny checkpoint first if missing)."""
    import torch

    from streamkv.config import ModelConfig
    from streamkv.model.loader import load_model

    torch.set_num_threads(threads)
    if model == "tiny":
        model = ensure_tiny_model()
    t0 = time.perf_counter()
    loaded = load_model(ModelConfig(model=model, device="cpu"), torch.device("cpu"))
    print(f"model: {loaded.name} ({time.perf_counter() - t0:.1f} s to load)")
    return loaded


def ensure_tiny_model(path: Path = TINY_MODEL_DIR) -> str:
    if not (path / "config.json").is_file():
        from tests.tiny_model import make_tiny_model

        make_tiny_model(path)
    return str(path)


# ------------------------------------------------------------------- server


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def http_get_json(url: str, timeout: float = 5.0) -> Any:
    with urllib.request.urlopen(url, timeout=timeout) as resp:  # noqa: S310 - our own loopback server
        return json.loads(resp.read())


def metric_value(http_url: str, sample: str, timeout: float = 5.0) -> float | None:
    """The value of the unlabelled sample ``sample`` (e.g. ``streamkv_engine_thread_drops_total``) on a server's
    ``/metrics``, or ``None`` when it has none."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(http_url + "/metrics", timeout=timeout) as resp:  # noqa: S310 - our loopback server
        text = resp.read().decode()
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == sample and not s.labels:
                return float(s.value)
    return None


class SpawnedServer:
    """``python -m streamkv serve`` on 127.0.0.1 and a free port, for the life of a ``with`` block.

    Waits (bounded) for ``/healthz``; on exit sends SIGINT, then SIGKILL after
    ``stop_timeout_s``. The server's output goes to ``log_path``; its tail is
    printed when it fails to start.
    """

    def __init__(self, serve_args: Sequence[str], start_timeout_s: float = 300.0, stop_timeout_s: float = 15.0):
        if any(a in ("--host", "--port") or a.startswith(("--host=", "--port=")) for a in serve_args):
            raise ValueError("--serve-args must not set --host/--port: the spawned server binds 127.0.0.1:<free>")
        self.port = free_port()
        self.args = [sys.executable, "-m", "streamkv", "serve", "--host", "127.0.0.1", "--port", str(self.port),
                     "--log-level", "warning", *serve_args]  # fmt: skip
        self.start_timeout_s = start_timeout_s
        self.stop_timeout_s = stop_timeout_s
        fd, name = tempfile.mkstemp(prefix="streamkv-serve-", suffix=".log")
        os.close(fd)
        self.log_path = Path(name)
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def http_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def ws_url(self) -> str:
        return f"ws://127.0.0.1:{self.port}/ws/chat"

    def __enter__(self) -> SpawnedServer:
        print(f"spawning: {shlex.join(self.args)} (log: {self.log_path})", file=sys.stderr)
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(self.args, stdout=log, stderr=subprocess.STDOUT, cwd=REPO_ROOT)
        deadline = time.monotonic() + self.start_timeout_s
        while True:
            if self.proc.poll() is not None:
                self._fail(f"server exited with code {self.proc.returncode} before it was healthy")
            try:
                http_get_json(self.http_url + "/healthz", timeout=2.0)
                return self
            except OSError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                self._fail(f"server not healthy within {self.start_timeout_s:.0f} s")
            time.sleep(0.25)

    def __exit__(self, exc_type: object, *exc: object) -> None:
        self.stop()
        if exc_type is None:  # keep the log only when something went wrong
            self.log_path.unlink(missing_ok=True)

    def stop(self) -> None:
        proc = self.proc
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(self.stop_timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)

    def log_tail(self, n: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def _fail(self, why: str) -> None:
        raise RuntimeError(f"{why}; last lines of {self.log_path}:\n{self.log_tail()}")
