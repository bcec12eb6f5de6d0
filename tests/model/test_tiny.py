"""make_tiny_model: a real-looking checkpoint folder, deterministic per seed."""

from __future__ import annotations

from pathlib import Path

import pytest
from safetensors.torch import load_file
from transformers import AutoConfig, AutoTokenizer, GenerationConfig, PreTrainedTokenizerBase

from tests.tiny_model import make_tiny_model


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_folder_is_a_transformers_checkpoint(tiny_model_dirs: dict[str, str], arch: str) -> None:
    folder = Path(tiny_model_dirs[arch])
    config = AutoConfig.from_pretrained(folder)
    assert config.model_type == arch
    assert (config.num_hidden_layers, config.hidden_size, config.num_attention_heads) == (2, 64, 4)
    assert (config.num_key_value_heads, config.intermediate_size, config.max_position_embeddings) == (2, 128, 2048)
    tok = AutoTokenizer.from_pretrained(folder)
    assert config.vocab_size == len(tok) == 49152
    assert tok.chat_template and tok.eos_token == "<|im_end|>"
    assert GenerationConfig.from_pretrained(folder).eos_token_id == tok.eos_token_id


def test_same_seed_same_weights(tmp_path: Path, smollm2_tokenizer: PreTrainedTokenizerBase) -> None:
    a = load_file(Path(make_tiny_model(tmp_path / "a", seed=3, tokenizer=smollm2_tokenizer)) / "model.safetensors")
    b = load_file(Path(make_tiny_model(tmp_path / "b", seed=3, tokenizer=smollm2_tokenizer)) / "model.safetensors")
    c = load_file(Path(make_tiny_model(tmp_path / "c", seed=4, tokenizer=smollm2_tokenizer)) / "model.safetensors")
    assert a.keys() == b.keys() == c.keys()
    assert all((a[k] == b[k]).all() for k in a)
    assert any((a[k] != c[k]).any() for k in a)


def test_unknown_arch_is_rejected(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="arch must be one of"):
        make_tiny_model(tmp_path, arch="gpt2")
