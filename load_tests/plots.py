"""PNG figures of the load tests (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from load_tests.common import percentile


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(plt: Any, fig: Any, path: Path) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    print(f"wrote {path}")


def plot_loadgen(records: Sequence[Any], samples: Sequence[dict[str, Any]], path: Path, title: str) -> None:
    """Top: TTFT and per-request ITL p50 at each request's send time. Bottom: KV usage and queue depths."""
    plt = _pyplot()
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(10, 7), sharex=True)
    ok = [r for r in records if r.ttft_s is not None]
    ax1.scatter([r.t_send for r in ok], [r.ttft_s * 1e3 for r in ok], s=10, label="TTFT")
    itl = [r for r in ok if r.itl_s]
    ax1.scatter([r.t_send for r in itl], [percentile(r.itl_s, 50) * 1e3 for r in itl], s=10, marker="x",
                label="ITL p50 of the request")  # fmt: skip
    if ok:
        ax1.set_yscale("log")
    ax1.set_ylabel("ms")
    ax1.legend()
    ax1.set_title(title)
    ts = [x["t"] for x in samples]
    ax2.plot(ts, [100 * x["kv_usage"] for x in samples], label="KV usage %")
    ax2.set_ylabel("KV usage %")
    ax2.set_ylim(0, 105)
    ax3 = ax2.twinx()
    ax3.plot(ts, [x["running"] for x in samples], "g--", label="running")
    ax3.plot(ts, [x["waiting"] for x in samples], "r:", label="waiting")
    ax3.set_ylabel("requests")
    ax2.set_xlabel("s since start")
    handles = ax2.get_legend_handles_labels()[0] + ax3.get_legend_handles_labels()[0]
    ax2.legend(handles, [h.get_label() for h in handles], loc="upper left")
    _save(plt, fig, path)


def plot_ttft_by_turn(results: dict[str, list[dict[str, Any]]], path: Path, title: str) -> None:
    """TTFT (log scale) against the turn number, one line per caching mode."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 5))
    for mode, rows in results.items():
        ax.plot([r["turn"] for r in rows], [r["ttft_ms"] for r in rows], marker="o", label=mode)
    ax.set_xlabel("turn")
    ax.set_ylabel("TTFT (ms)")
    ax.set_yscale("log")
    ax.set_title(title)
    ax.legend()
    _save(plt, fig, path)
