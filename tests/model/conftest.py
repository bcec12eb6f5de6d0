"""Session-wide checkpoints: the real SmolLM2 GGUF (loaded once) and tiny random models.

``smollm2_checkpoint`` (transformers' model, the oracle), ``smollm2_tokenizer``
and ``smollm2`` come from the root conftest, all from a single GGUF load.
"""

from __future__ import annotations

import pytest
import torch
from transformers import PreTrainedTokenizerBase

from streamkv.model.loader import HFCheckpoint, LoadedModel, from_hf
from tests.tiny_model import TINY_ARCHS, make_tiny_model


@pytest.fixture(scope="session")
def smollm2_plain(smollm2_checkpoint: HFCheckpoint) -> LoadedModel:
    """Our SmolLM2 on torch's default matmuls (``F.linear``), as on devices without oneDNN."""
    return from_hf(smollm2_checkpoint, torch.float32, torch.device("cpu"), prepack=False)


@pytest.fixture(scope="session")
def tiny_model_dirs(
    tmp_path_factory: pytest.TempPathFactory, smollm2_tokenizer: PreTrainedTokenizerBase
) -> dict[str, str]:
    """One tiny random checkpoint folder per architecture."""
    root = tmp_path_factory.mktemp("tiny")
    return {
        arch: make_tiny_model(root / arch, seed=i, arch=arch, tokenizer=smollm2_tokenizer)
        for i, arch in enumerate(TINY_ARCHS)
    }
