"""Tiny random Llama / Qwen2 / Mistral checkpoints for tests.

A saved folder looks exactly like a real transformers checkpoint (config,
safetensors weights, generation config, the SmolLM2 tokenizer with its chat
template), so tests load it through :func:`streamkv.model.loader.load_model`
like any model. Shape: 2 layers, hidden 64, 4 heads over 2 KV heads of 16,
intermediate 128, 2048 positions, SmolLM2's vocabulary.

A test utility, outside the serving package: import it as
``tests.tiny_model`` with the repository root on ``sys.path`` (pytest's
``pythonpath``; ``load_tests``' ``--model tiny`` builds one the same way).

transformers picks the tokenizer class from the model type, so the qwen2
folder's tokenizer comes back as ``Qwen2Tokenizer`` (same vocabulary and chat
template; its pre-tokenizer splits runs of whitespace a little differently).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    GenerationConfig,
    LlamaConfig,
    MistralConfig,
    PreTrainedTokenizerBase,
    Qwen2Config,
)

from streamkv.model.loader import default_model_path

TINY_ARCHS = ("llama", "qwen2", "mistral")


def make_tiny_model(
    path: str | Path,
    *,
    seed: int = 0,
    arch: str = "llama",
    tokenizer: PreTrainedTokenizerBase | None = None,
) -> str:
    """Save a tiny random checkpoint of ``arch`` into the folder ``path``.

    Weights are random but non-trivial: norm weights and (Qwen2) q/k/v biases
    are perturbed, so a swapped or dropped tensor changes the logits. The
    llama variant uses llama3 RoPE scaling and an untied LM head, Qwen2 ties
    its embeddings, Mistral is plain.

    Args:
        path: folder to create (or overwrite).
        seed: seeds the weights; the same seed gives the same checkpoint.
        arch: ``llama``, ``qwen2`` or ``mistral``.
        tokenizer: the SmolLM2 tokenizer to save, when the caller already has
            one (loading it from the GGUF takes seconds).

    Returns:
        ``str(path)``, ready for ``ModelConfig(model=...)``.

    Raises:
        ValueError: an unknown ``arch``.
    """
    if arch not in TINY_ARCHS:
        raise ValueError(f"arch must be one of {', '.join(TINY_ARCHS)}, not {arch!r}")
    if tokenizer is None:
        gguf = Path(default_model_path())
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name, local_files_only=True)
    config = _tiny_config(arch, len(tokenizer), tokenizer)
    with torch.random.fork_rng(devices=[]), torch.no_grad():  # the caller's RNG stream is left alone
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.add_(0.1 * torch.randn_like(param))
            elif name.endswith(".bias"):
                param.normal_(0.0, 0.1)
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return str(out)


def _tiny_config(arch: str, vocab_size: int, tokenizer: PreTrainedTokenizerBase) -> Any:
    common: dict[str, Any] = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=2048,
        rms_norm_eps=1e-5,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    if arch == "llama":
        rope = {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 256,
        }
        return LlamaConfig(**common, rope_parameters=rope, tie_word_embeddings=False)
    if arch == "qwen2":
        del common["head_dim"]  # Qwen2 derives it: 64 / 4 = 16
        return Qwen2Config(
            **common, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, tie_word_embeddings=True
        )
    return MistralConfig(
        **common, rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, tie_word_embeddings=False
    )
