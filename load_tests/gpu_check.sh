#!/usr/bin/env bash
# GPU acceptance for the Triton kernels, sized for ~5 minutes on one H200:
#   1. the compiled kernel tests (pytest -m gpu tests/kernels, TRITON_INTERPRET=0), including
#      tests/kernels/test_kv_quant_triton.py: store_kv / decode / prefill on int8 and fp8_e4m3 KV
#      caches against the torch path (byte-identical stored rows, outputs within rounding; all pass
#      on an H200 since 2026-12-04, docs/benchmarks.md "Round 18");
#   2. load_tests/gpu_check.py microbenchmarks (bf16 Triton kernels against SDPA) and
#      --e2e: the server default (--dtype auto = bf16 on the GPU, Triton attention)
#      end to end, with its greedy output compared to the torch backend's;
#      extra arguments go to it (e.g. --out DIR, --e2e-dtype float32).
# Exit status: the tests' if they failed, else the benchmark script's.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
export TRITON_INTERPRET=0
# streamkv (and its Triton kernels, streamkv.kernels) must import:
# install a bare checkout in place, offline (no build isolation, no dependencies).
if ! "$PY" -c "import importlib.util as u, sys; sys.exit(u.find_spec('streamkv.kernels') is None)" 2>/dev/null; then
  "$PY" -m pip install -q --no-deps --no-build-isolation -e . || exit 1
fi

"$PY" -m pytest -m gpu tests/kernels -q -p no:cacheprovider
tests_rc=$?
# The quantized KV kernels again, named, so their result shows on its own line in the log.
"$PY" -m pytest -m gpu tests/kernels/test_kv_quant_triton.py -q -p no:cacheprovider -rA | tail -n 15
"$PY" load_tests/gpu_check.py --e2e "$@"
bench_rc=$?
if [ "$tests_rc" -ne 0 ]; then
  exit "$tests_rc"
fi
exit "$bench_rc"
