"""glibc malloc tuning: the pages of a step's freed activations serve the next step without page faults."""

from __future__ import annotations

import subprocess
import sys

import pytest

from streamkv.ops.host_malloc import retain_freed_memory

# Three steps of a prefill's pattern of activations (buffers of 6-16 MiB made, written and freed in turn), after
# two warm-up steps; prints the minor page faults of the three. The probe first pins glibc's starting thresholds
# (128 KiB each: such blocks are their own mmap, unmapped on free, and the heap top is trimmed), which also stops
# glibc from raising them as it goes, so without retain_freed_memory every step faults its pages in again, every
# run; "tuned" then calls retain_freed_memory, which must override them.
PROBE = """
import ctypes, resource, sys, torch
from streamkv.ops.host_malloc import M_MMAP_THRESHOLD, M_TRIM_THRESHOLD, retain_freed_memory
mallopt = ctypes.CDLL(None).mallopt
assert mallopt(M_MMAP_THRESHOLD, 128 * 1024) and mallopt(M_TRIM_THRESHOLD, 128 * 1024)
if sys.argv[1] == "tuned":
    assert retain_freed_memory()
def step():
    x = torch.ones(4096, 576)
    for _ in range(4):
        qkv = torch.ones(4096, 960); qk = torch.ones(4096, 768); del qkv
        gate_up = torch.ones(1024, 3072); act = torch.ones(1024, 1536); del gate_up, act, qk
    del x
step(); step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(3):
    step()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""

glibc = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt (Linux)")


def faults(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, timeout=120, check=True)
    return int(out.stdout.split()[-1])


@glibc
def test_steps_reuse_the_pages_of_freed_activations() -> None:
    default, tuned = faults("default"), faults("tuned")
    assert default > 10_000, f"only {default} faults with glibc's starting thresholds: the probe measures nothing"
    # Reused pages fault 0 times on a quiet host; other work on the VM (its memory reclaimer) has cost a few
    # hundred (768 once in CI). Without the tuning every step faults all its buffers in again (~145,000).
    assert tuned * 20 < default, f"{tuned} page faults in three steps whose buffers should reuse freed pages"


def test_a_bad_threshold_is_refused() -> None:
    with pytest.raises(ValueError, match="trim_threshold"):
        retain_freed_memory(-1)
    with pytest.raises(ValueError, match="trim_threshold"):
        retain_freed_memory(2**31)
