"""What a model load builds, tensor by tensor, for tests that compare two loads bitwise."""

from __future__ import annotations

import torch

from streamkv.model.linear import Linear
from streamkv.model.llama import LlamaForCausalLM


def built_tensors(model: LlamaForCausalLM) -> dict[str, torch.Tensor]:
    """Every tensor a load builds: parameters, buffers (RoPE tables) and the packed copies of the matmuls (oneDNN's
    blocked ones as the plain weights they hold)."""
    tensors = dict(model.named_parameters()) | dict(model.named_buffers())
    for name, module in model.named_modules():
        if isinstance(module, Linear):
            if module.packed_weight is not None:
                tensors[f"{name}.packed_weight"] = module.packed_weight
            if module.small is not None:
                tensors[f"{name}.small.packed"] = module.small.packed
    if model.packed_lm_head is not None:
        tensors["packed_lm_head"] = model.packed_lm_head
    if model.small_lm_head is not None:
        tensors["small_lm_head.packed"] = model.small_lm_head.packed
    return {name: t.to_dense() if t.is_mkldnn else t for name, t in tensors.items()}
