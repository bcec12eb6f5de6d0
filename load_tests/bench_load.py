"""How long a model load takes, in fresh processes: parsing the GGUF, writing the GGUF cache, reading it.

    python load_tests/bench_load.py [--model PATH] [--runs 3]

Each load runs ``load_model`` (what ``streamkv serve`` and ``LLM()`` call) in
a new Python process, so no module, file or parser cache of an earlier load
in the same process helps it; the OS page cache does, as it does for a
restart. Three cases, in this order:

* ``no cache``: ``gguf_cache_dir=None``, the file parsed every time;
* ``first load``: an empty cache folder, parsed and then saved;
* ``cached``: the same folder again.

The C++ ops must already be built (a first ``streamkv serve`` or ``make
test`` builds them), or the first run pays for it. Prints the load's wall
time (``LoadedModel.load_seconds``) and the process's, medians over
``--runs``. The cache folder is a temporary one, removed at the end.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CHILD = """
import json, sys, time, torch
from streamkv.config import ModelConfig
from streamkv.model.loader import load_model
cache = sys.argv[2] or None
loaded = load_model(ModelConfig(model=sys.argv[1] or None, device="cpu", gguf_cache_dir=cache), torch.device("cpu"))
print(json.dumps({"load_s": loaded.load_seconds, "source": loaded.source}))
"""


def one_load(model: str | None, cache: Path | None) -> dict[str, float | str]:
    """One load in a fresh interpreter: its ``load_seconds``, source and the process's wall time."""
    start = time.perf_counter()
    out = subprocess.run(
        [sys.executable, "-c", CHILD, model or "", str(cache) if cache else ""],
        capture_output=True, text=True, check=True, timeout=600,
    )  # fmt: skip
    result = json.loads(out.stdout.strip().splitlines()[-1])
    return {**result, "process_s": time.perf_counter() - start}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="a .gguf file (default: the SmolLM2 GGUF)")
    p.add_argument("--runs", type=int, default=3, help="loads per case (medians are printed)")
    args = p.parse_args(argv)
    if args.runs < 1:
        p.error("--runs must be at least 1")
    rows = []
    with tempfile.TemporaryDirectory(prefix="streamkv-gguf-cache-") as tmp:
        cases = [("no cache", None, args.runs), ("first load", Path(tmp), 1), ("cached", Path(tmp), args.runs)]
        for label, cache, runs in cases:
            results = [one_load(args.model, cache) for _ in range(runs)]
            sources = sorted({str(r["source"]) for r in results})
            load = statistics.median(float(r["load_s"]) for r in results)
            process = statistics.median(float(r["process_s"]) for r in results)
            rows.append((label, ", ".join(sources), runs, load, process))
            print(f"{label}: load {load:.2f} s, process {process:.2f} s ({runs} runs, source {', '.join(sources)})",
                  flush=True)  # fmt: skip
    print("\n| case | source | runs | load s (median) | process s (median) |\n|---|---|---|---|---|")
    for label, source, runs, load, process in rows:
        print(f"| {label} | {source} | {runs} | {load:.2f} | {process:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
