"""streamkv against llama.cpp (through llama-cpp-python) on the same GGUF, same prompts, same concurrency.

llama.cpp runs batched through its low-level API: one ``llama_batch`` per
step carrying one token of every live sequence (each with its own
``seq_id``), one ``llama_decode`` call per step, greedy by argmax over the
returned logits. Prefill packs the prompts of all sequences into batches of
``--n-batch`` tokens (logits only for each prompt's last token). The model is
loaded with ``use_extra_bufts=False`` (llama.cpp's AMX/repacked weight path
crashes on the first decode on these machines) and run with flash attention
off and on. ``--f32`` adds an all-fp32 GGUF made from the Q4_1 file by
llama.cpp's own ``llama_model_quantize`` (``LLAMA_FTYPE_ALL_F32``): the same
weights our engine and transformers run, fp32 to fp32.

Our engine runs the same prompts at the same concurrency in the same process
(every request submitted at once, greedy, exactly ``--new-tokens`` tokens).

Goals: streamkv >= 3x llama.cpp output tokens/s at 32 sequences, and
single-stream decode within 1.5x of llama.cpp's (llama.cpp tok/s / ours <= 1.5).
Both are judged against the faster llama.cpp configuration of the shipped Q4_1
file. Skips with a message (exit 0) when ``llama_cpp`` is not installed
(``pip install -e '.[bench]'``; it builds from source, ~5 minutes).

    python -m load_tests.bench_llamacpp                  # batches 1 and 32, flash off/on
    python -m load_tests.bench_llamacpp --f32            # plus the fp32 GGUF
    python -m load_tests.bench_llamacpp --quick          # smoke run
"""

from __future__ import annotations

import argparse
import ctypes
import json
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

if not __package__:  # run as a file: make `load_tests` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402

from load_tests.bench_common_throughput import (  # noqa: E402
    Workload,
    goal_line,
    greedy_agreement,
    load_models,
    machine_banner,
    make_llm,
    make_prompts,
    run_engine,
)
from load_tests.common import load_warning  # noqa: E402

GOAL_BATCHED = 3.0
GOAL_SINGLE = 1.5


@dataclass(slots=True)
class Result:
    """One engine configuration at one concurrency."""

    engine: str
    batch: int
    output_tok_s: float
    decode_tok_s: float
    ttft_mean_s: float
    ttft_max_s: float
    wall_s: float
    token_ids: list[list[int]] = field(default_factory=list, repr=False)


# ------------------------------------------------------------------ llama.cpp

_QUIET_LOG: Any = None


def quiet_llama_logs() -> None:
    """Drop llama.cpp's own log lines (model loading, quantize progress)."""
    global _QUIET_LOG
    import llama_cpp as lc

    if _QUIET_LOG is None:
        # keep a reference: ctypes must not free the callback while llama.cpp holds it
        _QUIET_LOG = lc.llama_log_callback(lambda level, text, user: None)
        lc.llama_log_set(_QUIET_LOG, ctypes.c_void_p(0))


class LlamaCpp:
    """A llama.cpp model loaded once (extra buffer types off); contexts made per run."""

    def __init__(self, path: str, threads: int) -> None:
        import llama_cpp as lc

        self.lc = lc
        self.threads = threads
        lc.llama_backend_init()
        mparams = lc.llama_model_default_params()
        mparams.use_extra_bufts = False
        self.model = lc.llama_model_load_from_file(path.encode(), mparams)
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {path}")
        self.n_vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(self.model))

    def close(self) -> None:
        self.lc.llama_model_free(self.model)

    def run(self, prompts: list[list[int]], new_tokens: int, flash: bool, n_batch: int) -> Result:
        """Prefill every prompt, then ``new_tokens - 1`` steps of one ``llama_decode`` for all sequences."""
        lc = self.lc
        num = len(prompts)
        per_seq = max(len(p) for p in prompts) + new_tokens + 8
        cparams = lc.llama_context_default_params()
        cparams.n_ctx = num * per_seq
        cparams.n_batch = max(n_batch, num)
        cparams.n_ubatch = max(n_batch, num)
        cparams.n_seq_max = num
        cparams.n_threads = self.threads
        cparams.n_threads_batch = self.threads
        cparams.flash_attn_type = lc.LLAMA_FLASH_ATTN_TYPE_ENABLED if flash else lc.LLAMA_FLASH_ATTN_TYPE_DISABLED
        cparams.no_perf = True
        ctx = lc.llama_init_from_model(self.model, cparams)
        if not ctx:
            raise RuntimeError("llama.cpp could not create a context")
        cap = max(n_batch, num)
        batch = lc.llama_batch_init(cap, 0, 1)
        try:
            self._warm(ctx, batch)
            outputs: list[list[int]] = [[] for _ in prompts]
            first = [0.0] * num
            t0 = time.perf_counter()
            # prefill: all prompts' tokens, packed into batches of `cap`
            flat = [(s, pos, tok) for s, p in enumerate(prompts) for pos, tok in enumerate(p)]
            for lo in range(0, len(flat), cap):
                chunk = flat[lo : lo + cap]
                wants = []
                for i, (s, pos, tok) in enumerate(chunk):
                    last = pos == len(prompts[s]) - 1
                    self._set(batch, i, tok, pos, s, last)
                    if last:
                        wants.append((i, s))
                batch.n_tokens = len(chunk)
                self._decode(ctx, batch)
                now = time.perf_counter()
                for i, s in wants:
                    row = np.ctypeslib.as_array(lc.llama_get_logits_ith(ctx, i), shape=(self.n_vocab,))
                    outputs[s].append(int(row.argmax()))
                    first[s] = now - t0
            t_prefill = time.perf_counter()
            for _ in range(new_tokens - 1):
                for s in range(num):
                    self._set(batch, s, outputs[s][-1], len(prompts[s]) + len(outputs[s]) - 1, s, True)
                batch.n_tokens = num
                self._decode(ctx, batch)
                logits = np.ctypeslib.as_array(lc.llama_get_logits(ctx), shape=(num, self.n_vocab))
                for s, tok in enumerate(logits.argmax(axis=1).tolist()):
                    outputs[s].append(tok)
            t_end = time.perf_counter()
        finally:
            lc.llama_batch_free(batch)
            lc.llama_free(ctx)
        wall = t_end - t0
        decode_s = t_end - t_prefill
        return Result(
            engine=f"llama.cpp fa={'on' if flash else 'off'}",
            batch=num,
            output_tok_s=num * new_tokens / wall,
            decode_tok_s=num * (new_tokens - 1) / decode_s if decode_s > 0 else float("nan"),
            ttft_mean_s=sum(first) / num,
            ttft_max_s=max(first),
            wall_s=wall,
            token_ids=outputs,
        )

    def _warm(self, ctx: Any, batch: Any) -> None:
        """One short decode (thread pool, graph allocation), then forget it."""
        lc = self.lc
        for i in range(8):
            self._set(batch, i, 200 + i, i, 0, i == 7)
        batch.n_tokens = 8
        self._decode(ctx, batch)
        lc.llama_memory_clear(lc.llama_get_memory(ctx), True)

    @staticmethod
    def _set(batch: Any, i: int, token: int, pos: int, seq: int, logits: bool) -> None:
        batch.token[i] = token
        batch.pos[i] = pos
        batch.n_seq_id[i] = 1
        batch.seq_id[i][0] = seq
        batch.logits[i] = 1 if logits else 0

    def _decode(self, ctx: Any, batch: Any) -> None:
        rc = self.lc.llama_decode(ctx, batch)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc}")


def make_f32_gguf(src: str, out_dir: Path, threads: int) -> Path:
    """An all-fp32 copy of ``src`` via llama.cpp's quantize call (cached in ``out_dir``)."""
    import llama_cpp as lc

    out = out_dir / (Path(src).stem.replace("Q4_1", "").rstrip(".") + ".ALL_F32.gguf")
    if out.exists() and out.stat().st_mtime >= Path(src).stat().st_mtime:
        return out
    out_dir.mkdir(parents=True, exist_ok=True)
    params = lc.llama_model_quantize_default_params()
    params.nthread = threads
    params.ftype = lc.LLAMA_FTYPE_ALL_F32
    params.allow_requantize = True  # the inputs are Q4_1: de-quantize them
    params.quantize_output_tensor = True
    tmp = out.with_suffix(".tmp")
    rc = lc.llama_model_quantize(src.encode(), str(tmp).encode(), ctypes.byref(params))
    if rc != 0:
        raise RuntimeError(f"llama_model_quantize to ALL_F32 returned {rc}")
    tmp.rename(out)
    return out


# --------------------------------------------------------------------- ours


def run_ours(
    loaded: Any, prompts: list[list[int]], new_tokens: int, max_num_batched_tokens: int, repeats: int = 1
) -> Result:
    wl = Workload("llamacpp-peer", prompts, [new_tokens] * len(prompts), "random", 0)
    blocks = sum(-(-(len(p) + new_tokens) // 16) for p in prompts) + 16
    llm = make_llm(loaded, max_num_seqs=max(64, len(prompts)), max_num_batched_tokens=max_num_batched_tokens,
                   num_blocks=blocks)  # fmt: skip
    warm = Workload("warm", [p[:32] for p in prompts[:4]], [8] * min(4, len(prompts)), "random", 0)
    run_engine(llm, warm)
    r = min((run_engine(llm, wl) for _ in range(repeats)), key=lambda x: x.wall_s)
    return Result(
        engine="streamkv",
        batch=len(prompts),
        output_tok_s=r.output_tok_s,
        decode_tok_s=r.decode_tok_s,
        ttft_mean_s=sum(r.ttft_s) / len(r.ttft_s),
        ttft_max_s=max(r.ttft_s),
        wall_s=r.wall_s,
        token_ids=r.token_ids,
    )


# --------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", default=None, help="comma-separated concurrencies (default 1,32; quick 1,4)")
    p.add_argument("--prompt-len", type=int, default=None, help="prompt tokens (default 128; quick 32)")
    p.add_argument("--new-tokens", type=int, default=None, help="new tokens per sequence (default 128; quick 16)")
    p.add_argument("--flash", choices=("off", "on", "both"), default="both", help="llama.cpp flash attention")
    p.add_argument("--f32", action="store_true", help="also run an ALL_F32 GGUF made with llama_model_quantize")
    p.add_argument("--f32-dir", type=Path, default=Path.home() / ".cache" / "streamkv-bench")
    p.add_argument("--n-batch", type=int, default=512, help="llama.cpp tokens per llama_decode in prefill")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048, help="our engine's token budget per step")
    p.add_argument("--repeats", type=int, default=1, help="timed runs per configuration; the fastest is kept")
    p.add_argument("--skip-engine", action="store_true", help="llama.cpp only")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="smoke sizes")
    p.add_argument("--verbose", action="store_true", help="keep llama.cpp's own log")
    p.add_argument("--out", "--json", dest="out", type=Path, default=None, help="write every figure to this JSON file")
    args = p.parse_args(argv)
    q = args.quick
    batches = [int(x) for x in (args.batches or ("1,4" if q else "1,32")).split(",")]
    plen = args.prompt_len or (32 if q else 128)
    new = args.new_tokens or (16 if q else 128)
    flashes = {"off": [False], "on": [True], "both": [False, True]}[args.flash]

    info = machine_banner(
        args.threads, "streamkv vs llama.cpp (llama-cpp-python), same GGUF", "load_tests.bench_llamacpp"
    )
    try:
        import llama_cpp  # noqa: F401
    except ImportError as e:
        print(f"SKIP: llama_cpp is not importable ({e}). Install the bench extra: "
              "CMAKE_ARGS='-DGGML_NATIVE=ON' .venv/bin/pip install -e '.[bench]' "
              "(builds from source, ~5 min)")  # fmt: skip
        return 0

    from streamkv.model.loader import default_model_path

    if not args.verbose:
        quiet_llama_logs()
    gguf = default_model_path()
    files = [("Q4_1", gguf)]
    if args.f32:
        t = time.perf_counter()
        f32 = make_f32_gguf(gguf, args.f32_dir, args.threads)
        print(f"ALL_F32 GGUF: {f32} ({f32.stat().st_size / 1e6:.0f} MB, {time.perf_counter() - t:.1f} s)")
        files.append(("F32", str(f32)))
    print(f"workload: batches {batches}, {plen}-token random prompts (seed {args.seed}), exactly {new} new tokens, "
          f"greedy; llama.cpp prefill n_batch {args.n_batch}\n", flush=True)  # fmt: skip

    results: list[Result] = []
    for label, path in files:
        lcpp = LlamaCpp(path, args.threads)
        vocab = lcpp.n_vocab
        for b in batches:
            prompts = make_prompts([plen] * b, args.seed, vocab)
            for fa in flashes:
                runs = [lcpp.run(prompts, new, fa, args.n_batch) for _ in range(args.repeats)]
                r = min(runs, key=lambda x: x.wall_s)  # contention only ever slows a run down
                r.engine = f"llama.cpp {label} fa={'on' if fa else 'off'}"
                results.append(r)
                _print(r)
        lcpp.close()

    if not args.skip_engine:
        models = load_models()
        vocab = models.loaded.model.config.vocab_size
        for b in batches:
            prompts = make_prompts([plen] * b, args.seed, vocab)
            r = run_ours(models.loaded, prompts, new, args.max_num_batched_tokens, args.repeats)
            results.append(r)
            _print(r)
    print()

    verdicts = _compare(results, batches)
    note = load_warning(info)
    if note:
        print("NOTE: " + note)
    if args.out is not None:
        rows = [{k: v for k, v in asdict(r).items() if k != "token_ids"} for r in results]
        doc = {"machine": info, "contention": note, "rows": rows, "goals": verdicts}
        args.out.write_text(json.dumps(doc, indent=2))
        print(f"wrote {args.out}")
    return 0


def _print(r: Result) -> None:
    print(
        f"  {r.engine:26s} batch {r.batch:3d}: {r.output_tok_s:7.1f} output tok/s (prefill incl.), "
        f"{r.decode_tok_s:7.1f} decode tok/s, TTFT mean {_secs(r.ttft_mean_s)} / max {_secs(r.ttft_max_s)}, "
        f"wall {r.wall_s:.2f} s",
        flush=True,
    )


def _secs(s: float) -> str:
    return f"{s * 1e3:.0f} ms" if s < 1 else f"{s:.2f} s"


def _compare(results: list[Result], batches: list[int]) -> list[str]:
    """Ratios against every llama.cpp row, and the goals against the faster Q4_1 configuration."""
    ours = {r.batch: r for r in results if r.engine == "streamkv"}
    lines: list[str] = []
    if not ours:
        return lines
    print("ratios streamkv / llama.cpp (>1: streamkv faster)")
    for r in results:
        if r.engine == "streamkv" or r.batch not in ours:
            continue
        o = ours[r.batch]
        exact, prefix = greedy_agreement(o.token_ids, r.token_ids)
        print(
            f"  batch {r.batch:3d} vs {r.engine:26s}: output {o.output_tok_s / r.output_tok_s:5.2f}x, "
            f"decode {o.decode_tok_s / r.decode_tok_s:5.2f}x, TTFT mean ours {_secs(o.ttft_mean_s)} vs "
            f"{_secs(r.ttft_mean_s)}; greedy agreement {exact:.0%} identical, {prefix:.0%} common prefix"
        )
    print()

    def best(batch: int, key: str) -> Result | None:
        rows = [r for r in results if r.batch == batch and r.engine.startswith("llama.cpp Q4_1")]
        return max(rows, key=lambda r: getattr(r, key)) if rows else None

    big = max(batches)
    if big > 1 and (peer := best(big, "output_tok_s")) is not None and big in ours:
        lines.append(goal_line(f"output tok/s at {big} sequences vs {peer.engine}",
                               ours[big].output_tok_s / peer.output_tok_s, GOAL_BATCHED))  # fmt: skip
    if 1 in batches and (peer := best(1, "decode_tok_s")) is not None and 1 in ours:
        lines.append(goal_line(f"single-stream decode, {peer.engine} tok/s / ours",
                               peer.decode_tok_s / ours[1].decode_tok_s, GOAL_SINGLE,
                               higher_is_better=False))  # fmt: skip
    for line in lines:
        print(line)
    for r in results:  # every configuration that beats us on some figure, said plainly
        o = ours.get(r.batch)
        if r.engine == "streamkv" or o is None:
            continue
        compared = (("output tok/s", r.output_tok_s, o.output_tok_s), ("decode tok/s", r.decode_tok_s, o.decode_tok_s))
        wins = [f"{n} {a:.1f} vs {c:.1f}" for n, a, c in compared if a > c]
        if r.ttft_mean_s < o.ttft_mean_s:
            wins.append(f"TTFT mean {_secs(r.ttft_mean_s)} vs {_secs(o.ttft_mean_s)}")
        if wins:
            print(f"  llama.cpp wins at batch {r.batch} ({r.engine}): {'; '.join(wins)}")
    return lines


if __name__ == "__main__":
    raise SystemExit(main())
