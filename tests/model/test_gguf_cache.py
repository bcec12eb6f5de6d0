"""The GGUF cache: a later load of the same file reads transformers' saved load and builds the same model.

The real-model test checks the cached load against transformers' own load of
the GGUF (the session oracle) bitwise. The others drive the cache's bookkeeping
with the tiny model standing in for a de-quantized GGUF.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from streamkv.config import ModelConfig
from streamkv.model.gguf_cache import MANIFEST, GGUFCache
from streamkv.model.gguf_codes import GGUFTensor, gguf_tensor_table
from streamkv.model.loader import HFCheckpoint, default_model_path, from_hf, load_hf_checkpoint
from tests.model.built import built_tensors

GiB = 1 << 30
TEXTS = [
    "Hello world",
    "The capital of France is Paris.",
    "  spaces\n\ttabs ünïcode 中文 🙂 <|im_start|>user\nhi<|im_end|>",
]
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}]


def test_a_cached_load_is_transformers_gguf_load_bitwise(tmp_path: Path, smollm2_checkpoint: HFCheckpoint) -> None:
    cache = GGUFCache(tmp_path / "cache", 4 * GiB)
    first = load_hf_checkpoint(None, cache=cache)
    second = load_hf_checkpoint(None, cache=cache)
    assert (first.source, second.source) == ("gguf", "gguf_cache")
    assert second.gguf == first.gguf == smollm2_checkpoint.gguf and second.name == smollm2_checkpoint.name
    assert second.gguf_tensors == first.gguf_tensors == gguf_tensor_table(Path(default_model_path()))

    oracle, cached = smollm2_checkpoint.model.state_dict(), second.model.state_dict()
    assert oracle.keys() == cached.keys()
    assert [k for k in oracle if not torch.equal(oracle[k], cached[k])] == []
    # save_pretrained names the architecture, and the cached model is no longer marked "gguf"-quantized.
    marks = ("architectures", "quantization_config")
    want = {k: v for k, v in smollm2_checkpoint.model.config.to_diff_dict().items() if k not in marks}
    assert {k: v for k, v in second.model.config.to_diff_dict().items() if k not in marks} == want
    assert second.model.generation_config.to_dict() == smollm2_checkpoint.model.generation_config.to_dict()

    theirs, ours = smollm2_checkpoint.tokenizer, second.tokenizer
    ids = [theirs(t).input_ids for t in TEXTS]
    assert [ours(t).input_ids for t in TEXTS] == ids
    assert [ours.decode(i) for i in ids] == [theirs.decode(i) for i in ids]
    chat: dict[str, Any] = {"add_generation_prompt": True, "tokenize": False}
    assert ours.apply_chat_template(CHAT, **chat) == theirs.apply_chat_template(CHAT, **chat)
    assert (ours.eos_token_id, ours.bos_token_id, ours.all_special_tokens, len(ours)) == (
        theirs.eos_token_id, theirs.bos_token_id, theirs.all_special_tokens, len(theirs),
    )  # fmt: skip

    # What the engine runs: the same tensors, packed copies and GGUF codes included.
    from_cache = from_hf(second, torch.float32, torch.device("cpu"))
    from_gguf = from_hf(smollm2_checkpoint, torch.float32, torch.device("cpu"))
    assert (from_cache.eos_token_ids, from_cache.max_model_len) == (from_gguf.eos_token_ids, from_gguf.max_model_len)
    a, b = built_tensors(from_cache.model), built_tensors(from_gguf.model)
    assert a.keys() == b.keys()
    assert [k for k in a if a[k].shape != b[k].shape or not torch.equal(a[k], b[k])] == []


@pytest.fixture
def tiny_load(tiny_model_dir: str) -> tuple[Any, Any]:
    """The tiny model and tokenizer, standing in for what transformers de-quantized from a GGUF."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32, local_files_only=True)
    return model, AutoTokenizer.from_pretrained(tiny_model_dir, local_files_only=True)


def fake_gguf(folder: Path, name: str, content: bytes) -> Path:
    """A file that plays a GGUF's part: the cache keys on its bytes and never parses it."""
    path = folder / f"{name}.gguf"
    path.write_bytes(content.ljust(64, b"\0"))  # room for TABLE's tensor
    return path


TABLE = {"blk.0.attn_q.weight": GGUFTensor(type=3, offset=24, rows=2, nbytes=40)}  # Q4_1, two 20-byte rows


def stored(cache: GGUFCache, gguf: Path, tiny_load: tuple[Any, Any]) -> Path:
    folder, identity = cache.entry(gguf)
    assert cache.store(folder, identity, *tiny_load, TABLE)
    return folder


def test_store_then_load_gives_the_weights_tokenizer_and_table(tmp_path: Path, tiny_load: tuple[Any, Any]) -> None:
    cache = GGUFCache(tmp_path / "cache", GiB)
    gguf = fake_gguf(tmp_path, "m", b"gguf bytes")
    folder = stored(cache, gguf, tiny_load)
    assert folder.parent == cache.root and folder.name.startswith("gguf-")
    assert not list(cache.root.glob(".*.tmp"))
    hit = cache.load(*cache.entry(gguf))
    assert hit is not None
    model, tokenizer, table = hit
    want = tiny_load[0].state_dict()
    assert (
        all(torch.equal(want[k], v) for k, v in model.state_dict().items()) and want.keys() == model.state_dict().keys()
    )
    assert tokenizer(TEXTS[2]).input_ids == tiny_load[1](TEXTS[2]).input_ids
    assert table == TABLE
    assert cache.total_bytes() > sum(v.numel() * 4 for v in want.values())


def test_other_bytes_miss_and_the_store_leaves_the_model_as_it_was(tmp_path: Path, tiny_load: tuple[Any, Any]) -> None:
    cache = GGUFCache(tmp_path / "cache", GiB)
    gguf = fake_gguf(tmp_path, "m", b"version 1")
    model = tiny_load[0]
    model.hf_quantizer = "marker"  # what transformers' GGUF load sets; the store saves a copy without it
    stored(cache, gguf, tiny_load)
    assert model.hf_quantizer == "marker"
    gguf.write_bytes(b"version 2".ljust(64, b"\0"))
    assert cache.load(*cache.entry(gguf)) is None
    assert len(list(cache.root.iterdir())) == 1  # the other bytes' entry stays until it is least recently used


@pytest.mark.parametrize(
    "damage", ["weights", "truncated", "missing_file", "manifest", "not_a_dict", "version", "table", "no_manifest"]
)
def test_an_entry_that_does_not_load_is_removed(
    tmp_path: Path, tiny_load: tuple[Any, Any], damage: str, caplog: pytest.LogCaptureFixture
) -> None:
    cache = GGUFCache(tmp_path / "cache", GiB)
    gguf = fake_gguf(tmp_path, "m", b"gguf bytes")
    folder = stored(cache, gguf, tiny_load)
    manifest = json.loads((folder / MANIFEST).read_text())
    weights = folder / "model.safetensors"
    if damage == "weights":  # the same size, other bytes
        weights.write_bytes(b"\0" * weights.stat().st_size)
    elif damage == "truncated":
        os.truncate(weights, weights.stat().st_size // 2)
    elif damage == "missing_file":
        (folder / "chat_template.jinja").unlink()
    elif damage == "manifest":
        (folder / MANIFEST).write_text("{not json")
    elif damage == "not_a_dict":
        (folder / MANIFEST).write_text("[1, 2]")
    elif damage == "version":
        (folder / MANIFEST).write_text(json.dumps({**manifest, "transformers": "0.0.1"}))
    elif damage == "table":  # a tensor past the end of the file
        tensors = {name: {**t, "offset": 10**9} for name, t in manifest["tensors"].items()}
        (folder / MANIFEST).write_text(json.dumps({**manifest, "tensors": tensors}))
    else:
        (folder / MANIFEST).unlink()
    with caplog.at_level(logging.WARNING, logger="streamkv.model.gguf_cache"):
        assert cache.load(*cache.entry(gguf)) is None
    assert not folder.exists()
    assert "is not usable" in caplog.text
    stored(cache, gguf, tiny_load)  # the next load writes it again
    assert cache.load(*cache.entry(gguf)) is not None


def test_a_copy_of_the_file_elsewhere_hits(tmp_path: Path, tiny_load: tuple[Any, Any]) -> None:
    cache = GGUFCache(tmp_path / "cache", GiB)
    folder = stored(cache, fake_gguf(tmp_path, "m", b"the same bytes"), tiny_load)
    (tmp_path / "elsewhere").mkdir()
    copy = fake_gguf(tmp_path / "elsewhere", "renamed", b"the same bytes")
    assert cache.entry(copy)[0] == folder and cache.load(*cache.entry(copy)) is not None


def test_a_cache_this_user_cannot_write_still_serves(
    tmp_path: Path, tiny_load: tuple[Any, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = GGUFCache(tmp_path / "cache", GiB)
    gguf = fake_gguf(tmp_path, "m", b"m")
    stored(cache, gguf, tiny_load)

    def read_only(*args: Any, **kwargs: Any) -> None:
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(os, "utime", read_only)  # the last-use stamp cannot be written
    assert cache.load(*cache.entry(gguf)) is not None


def test_the_least_recently_used_entries_go_first(tmp_path: Path, tiny_load: tuple[Any, Any]) -> None:
    probe = GGUFCache(tmp_path / "probe", GiB)
    stored(probe, fake_gguf(tmp_path, "p", b"p"), tiny_load)
    size = probe.total_bytes()
    cache = GGUFCache(tmp_path / "cache", int(2.5 * size))  # room for two entries
    a, b, c = (fake_gguf(tmp_path, n, n.encode()) for n in "abc")
    folder_a, folder_b = stored(cache, a, tiny_load), stored(cache, b, tiny_load)
    os.utime(folder_a / MANIFEST, (1, 1))
    os.utime(folder_b / MANIFEST, (2, 2))
    assert cache.load(*cache.entry(a)) is not None  # a is now the most recently used
    folder_c = stored(cache, c, tiny_load)
    assert folder_a.exists() and folder_c.exists() and not folder_b.exists()
    assert cache.total_bytes() <= cache.max_bytes


def test_a_lowered_bound_takes_effect_at_the_next_hit(tmp_path: Path, tiny_load: tuple[Any, Any]) -> None:
    """Lowering --gguf-cache-space removes the least recently used others when a load hits, not at the next write."""
    roomy = GGUFCache(tmp_path / "cache", GiB)
    a, b, c = (fake_gguf(tmp_path, n, n.encode()) for n in "abc")
    folders = [stored(roomy, f, tiny_load) for f in (a, b, c)]
    for i, folder in enumerate(folders):
        os.utime(folder / MANIFEST, (i + 1, i + 1))  # a is the least recently used, c the most
    size = roomy.total_bytes() // 3
    tight = GGUFCache(tmp_path / "cache", int(2.5 * size))  # the next start, with room for two
    assert tight.load(*tight.entry(c)) is not None
    assert [f.exists() for f in folders] == [False, True, True]
    assert tight.total_bytes() <= tight.max_bytes
    tiny = GGUFCache(tmp_path / "cache", size // 2)  # not even the hit fits: it still serves, the others go
    assert tiny.load(*tiny.entry(b)) is not None
    assert [f.exists() for f in folders] == [False, True, False]


def test_an_entry_over_the_bound_is_not_written(
    tmp_path: Path, tiny_load: tuple[Any, Any], caplog: pytest.LogCaptureFixture
) -> None:
    cache = GGUFCache(tmp_path / "cache", 1000)
    folder, identity = cache.entry(fake_gguf(tmp_path, "m", b"m"))
    with caplog.at_level(logging.INFO, logger="streamkv.model.gguf_cache"):
        assert not cache.store(folder, identity, *tiny_load, TABLE)
    assert "over --gguf-cache-space" in caplog.text
    assert cache.total_bytes() == 0 and not folder.exists()


def test_a_rename_lost_to_another_writer_keeps_its_entry(tmp_path: Path, tiny_load: tuple[Any, Any]) -> None:
    cache = GGUFCache(tmp_path / "cache", GiB)
    gguf = fake_gguf(tmp_path, "m", b"m")
    folder = stored(cache, gguf, tiny_load)
    before = (folder / MANIFEST).read_bytes()
    folder_again, identity = cache.entry(gguf)
    assert cache.store(folder_again, identity, *tiny_load, TABLE)  # its rename fails: the entry is there
    assert (folder / MANIFEST).read_bytes() == before
    assert not list(cache.root.glob(".*.tmp"))


def test_model_config_checks_the_cache_options() -> None:
    assert ModelConfig().gguf_cache_dir == str(Path.home() / ".cache" / "streamkv" / "gguf")
    with pytest.raises(ValueError, match="gguf_cache_dir must not be empty"):
        ModelConfig(gguf_cache_dir=" ")
    with pytest.raises(ValueError, match="gguf_cache_space must be at least 1 byte"):
        ModelConfig(gguf_cache_space=0)
