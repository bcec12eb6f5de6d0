"""Building the C++ ops: a build killed mid-way must not leave every later load waiting forever, and every
kernel the CPU can run is in the build."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest

from streamkv.model.precision import cpu_flags
from streamkv.ops import cpu_ops
from streamkv.ops.cpu_ops import _build, load_cpu_ops, load_linear_ops

SOURCE = """
#include <pybind11/pybind11.h>
int answer() { return 42; }
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("answer", &answer); }
"""


@pytest.mark.timeout(300)
def test_a_lock_file_left_by_a_killed_build_is_removed_and_the_build_runs(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    source = tmp_path / "answer.cpp"
    source.write_text(SOURCE)
    folder = tmp_path / "build"
    folder.mkdir()
    (folder / "lock").touch()  # what cpp_extension leaves when its process dies mid-build (Ctrl-C, OOM kill)

    with caplog.at_level(logging.WARNING, logger="streamkv.ops.cpu_ops"):
        module = _build("streamkv_test_stale_lock", (source,), folder, "nothing")

    assert module is not None and module.answer() == 42  # without the mend, cpp_extension waits on the file forever
    assert not (folder / "lock").exists()
    assert "left by a build that was killed" in caplog.text


def test_the_small_batch_linear_build_has_every_kernel_this_cpu_can_run() -> None:
    # -march=native: a kernel is left out of the build exactly when the CPU lacks an instruction it uses. A gate
    # on a flag a kernel does not use leaves it out silently: until round 20 the fp32 kernel also asked for
    # AVX512-BF16, so AVX-512 CPUs without it (Skylake-SP to Ice Lake) ran every fp32 matmul on oneDNN.
    flags = cpu_flags()
    if flags is None or load_cpu_ops() is None:
        pytest.skip("no /proc/cpuinfo, or no compiler (the attention ops did not build either)")
    if "avx512f" in flags:
        isa = "avx512"
    elif {"avx2", "fma"} <= flags:
        isa = "avx2"
    else:
        pytest.skip("no AVX-512 or AVX2 with FMA: no small-batch kernel to build")
    ops = load_linear_ops()
    assert ops is not None and ops.small_linear_isa() == isa
    assert ops.small_linear_bf16_supported() == ("avx512_bf16" in flags)
    assert ops.small_linear_int8_supported() == ({"avx512f", "avx512_vnni"} <= flags)


def _compiled_files(sources: tuple[Path, ...]) -> set[Path]:
    """``sources`` and every header they include (``#include "..."``, followed into headers)."""
    found, todo = set(), list(sources)
    while todo:
        path = todo.pop()
        if path not in found:
            found.add(path)
            todo += [path.parent / h for h in re.findall(r'^#include "([^"]+)"', path.read_text(), re.MULTILINE)]
    return found


def test_each_build_folder_is_keyed_by_its_sources_and_every_header_they_include(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Checkouts sharing a home folder build side by side (a shared folder rebuilds on every load) only when a
    change to any file a build compiles, headers included, changes that build's folder name."""
    keyed: dict[str, tuple[Path, ...]] = {}
    real_digest = cpu_ops._source_digest

    def digest(paths: tuple[Path, ...]) -> str:
        keyed[real_digest(paths)] = paths
        return real_digest(paths)

    builds: dict[str, tuple[tuple[Path, ...], Path]] = {}

    def build(name: str, sources: tuple[Path, ...], folder: Path, fallback: str, defines: tuple[str, ...] = ()) -> None:
        builds[name] = (sources, folder)

    loaders = [cpu_ops.load_cpu_ops, cpu_ops.load_fused_ops, cpu_ops.load_linear_ops, cpu_ops.load_decode_ops]
    monkeypatch.setattr(cpu_ops, "_source_digest", digest)
    monkeypatch.setattr(cpu_ops, "_build", build)
    monkeypatch.setattr(cpu_ops, "load_linear_ops", lambda: object())  # the decode op is built only beside it
    for loader in loaders:
        loader.__wrapped__()  # the uncached body: builds nothing here

    assert len(builds) == 4
    assert len({folder.name for _, folder in builds.values()}) == 4
    for name, (sources, folder) in builds.items():
        digests = [d for d in keyed if folder.name.endswith(d)]
        assert len(digests) == 1, f"{name}: folder {folder.name} is not keyed by a digest of its files"
        missing = _compiled_files(sources) - set(keyed[digests[0]])
        assert not missing, f"{name}: a change to {sorted(p.name for p in missing)} would not change its folder"


@pytest.mark.timeout(300)
def test_the_sources_compile_for_cpus_without_amx_or_avx512() -> None:
    """-march=native builds only this CPU's branches: a name defined under one ISA's #if and used outside it breaks
    other CPUs' builds unseen here (round 33's fused gate_up did, on AVX-512 without BF16, and round 38's key split of
    the prefill attention on AVX2). Syntax only, in parallel: Ice Lake (AVX-512 with VNNI, no BF16) and Haswell
    (AVX2)."""
    import shutil
    import subprocess
    import sysconfig

    from torch.utils.cpp_extension import include_paths

    compiler = shutil.which("g++")
    if compiler is None:
        pytest.skip("no g++ here")
    csrc = Path(cpu_ops.__file__).parent / "csrc"
    flags = [f"-I{p}" for p in [*include_paths(), sysconfig.get_paths()["include"]]]
    flags += ["-std=c++20", "-fsyntax-only", "-fopenmp", "-w", "-DTORCH_EXTENSION_NAME=x"]
    jobs = {
        (source, arch): subprocess.Popen(
            [compiler, *flags, f"-march={arch}", str(csrc / source)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT
        )
        for source in ("small_linear.cpp", "fused_layers.cpp", "paged_attention.cpp", "paged_prefill.cpp")
        for arch in ("icelake-server", "haswell")
    }
    outputs = {key: job.communicate(timeout=280)[0].decode()[-2000:] for key, job in jobs.items()}
    failed = {key: out for key, out in outputs.items() if jobs[key].returncode != 0}
    assert not failed, failed
