"""Shared fixtures: a tiny random Llama (fast) and the real SmolLM2 (truth, loaded once)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import PreTrainedTokenizerBase

from streamkv.config import ModelConfig
from streamkv.model.loader import HFCheckpoint, LoadedModel, from_hf, load_hf_checkpoint, load_model
from streamkv.model.mkl_vml import resolve_vml_dispatch

torch.set_num_threads(2)
# Before any test's first sizable cos or exp, transformers' (the oracle's) too: streamkv.model.mkl_vml.
resolve_vml_dispatch()

OUTPUT_DIR = Path(__file__).resolve().parent.parent / "test-output"


@pytest.fixture(scope="session")
def output_dir() -> Path:
    """Where tests leave artefacts (screenshots, logs) for people to look at."""
    OUTPUT_DIR.mkdir(exist_ok=True)
    return OUTPUT_DIR


@pytest.fixture(scope="session")
def smollm2_checkpoint() -> HFCheckpoint:
    """transformers' own SmolLM2 (the oracle) and tokenizer, de-quantized from the GGUF to float32.

    GGUF parsing takes seconds, so the file is read once per run and every
    SmolLM2 fixture is built from this one load.
    """
    return load_hf_checkpoint(None, torch.float32)


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_checkpoint: HFCheckpoint) -> PreTrainedTokenizerBase:
    return smollm2_checkpoint.tokenizer


@pytest.fixture(scope="session")
def smollm2(smollm2_checkpoint: HFCheckpoint) -> LoadedModel:
    """Our SmolLM2 as the engine runs it on the CPU (the real default model)."""
    return from_hf(smollm2_checkpoint, torch.float32, torch.device("cpu"))


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory, smollm2: LoadedModel) -> str:
    """A tiny random Llama checkpoint with the SmolLM2 tokenizer."""
    from tests.tiny_model import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "tiny-llama", tokenizer=smollm2.tokenizer)


@pytest.fixture(scope="session")
def tiny(tiny_model_dir: str) -> LoadedModel:
    """The tiny model, loaded once; engines share it (each has its own KV pool)."""
    return load_model(ModelConfig(model=tiny_model_dir, dtype="float32", device="cpu"), torch.device("cpu"))
