"""Idle-session offload: device pool -> host tier -> disk tier and back, restart, faults (tiny model)."""

from __future__ import annotations

import errno
import logging
import os
import threading
import time
from pathlib import Path

import pytest
import torch

from streamkv.cache import disk_tier
from streamkv.cache.disk_tier import DiskTier, kv_fingerprint
from streamkv.cache.kv_file import KVFileError, read_kv_file, write_kv_file
from streamkv.llm import LLM
from streamkv.model.loader import LoadedModel
from streamkv.runner import kv_bytes_per_block
from tests.engine_helpers import assert_pool_whole, greedy, make_llm, prompts_of

P_A, P_B, P_C = prompts_of([40, 40, 40], seed=11)
NEXT = prompts_of([6], seed=12)[0]
# one 3-block session fits the pin budget (4 of 64 blocks); a second pushes the first out
POOL = {"num_blocks": 64, "max_pinned_fraction": 4 / 64}


def turn(llm: LLM, prompt: list[int], session_id: str):  # type: ignore[no-untyped-def]
    return llm.generate([prompt], greedy(8), session_ids=[session_id])[0]


@pytest.fixture(scope="module")
def reference(tiny: LoadedModel) -> tuple[list[int], list[int], list[int]]:
    """Turn 1 and turn 2 of session a with a pool big enough that nothing gives way."""
    llm = make_llm(tiny, session_offload=False)
    t1 = turn(llm, P_A, "a").outputs[0].token_ids
    history = P_A + t1
    t2 = turn(llm, history + NEXT, "a").outputs[0].token_ids
    return t1, history, t2


def _kv_of_pin(llm: LLM, session_id: str) -> tuple[list[int], list[list[torch.Tensor]]]:
    pin = llm.core.kv.sessions[session_id]
    return list(pin.token_ids), llm.core.runner.read_device_blocks([b.block_id for b in pin.blocks])


def _assert_same_kv(got: list[list[torch.Tensor]], want: list[list[torch.Tensor]]) -> None:
    assert len(got) == len(want)
    for g_layer, w_layer in zip(got, want, strict=True):
        for g, w in zip(g_layer, w_layer, strict=True):
            assert g.dtype == w.dtype and g.shape == w.shape
            assert torch.equal(g, w)  # bitwise for these dtypes (no NaNs in KV)


def _release_all(llm: LLM, *sessions: str) -> None:
    for s in sessions:
        llm.core.release_session(s)
    llm.core.step()  # applies what is still pending
    assert_pool_whole(llm)
    assert llm.core.kv.host.num_free_blocks == llm.core.kv.host.num_blocks


def test_host_round_trip_is_bitwise_and_greedy_equal(tiny, reference):
    t1_ref, history, t2_ref = reference
    llm = make_llm(tiny, **POOL)
    core = llm.core
    assert turn(llm, P_A, "a").outputs[0].token_ids == t1_ref
    tokens, saved = _kv_of_pin(llm, "a")
    turn(llm, P_B, "b")  # b's pin pushes a's to the host tier
    assert core.kv.is_offloaded("a") and "a" not in core.kv.sessions
    core.step()  # no work: applies the pending device -> host copies
    assert core.snapshot()["offload"]["host_sessions"] == 1  # /api/stats carries the tiers
    host = core.kv.host_sessions.get("a")
    assert host is not None and host.token_ids == tokens
    _assert_same_kv(core.runner.read_host_blocks(host.host_block_ids), saved)
    core.kv.pool.evict_all_cached()  # no prefix-cache hit may stand in for the restore
    computed0 = core.scheduler.counters.computed_prompt_tokens
    out = turn(llm, history + NEXT, "a")
    assert out.outputs[0].token_ids == t2_ref
    assert out.usage.cached_tokens == len(tokens)
    assert core.scheduler.counters.computed_prompt_tokens - computed0 == len(history) + len(NEXT) - len(tokens)
    off = core.stats.kv.offload
    assert (off.offloaded_sessions, off.restored_sessions, off.dropped_sessions) == (2, 1, 0)  # a, then b
    assert off.restored_bytes == off.restored_blocks * kv_bytes_per_block(tiny, 16) > 0
    _release_all(llm, "a", "b")


def test_without_offload_the_pin_is_dropped_and_recomputed(tiny, reference):
    _, history, t2_ref = reference
    llm = make_llm(tiny, session_offload=False, **POOL)
    turn(llm, P_A, "a")
    turn(llm, P_B, "b")
    assert "a" not in llm.core.kv.sessions and not llm.core.kv.is_offloaded("a")
    llm.core.kv.pool.evict_all_cached()
    out = turn(llm, history + NEXT, "a")
    assert out.outputs[0].token_ids == t2_ref and out.usage.cached_tokens == 0


def test_disk_round_trip_is_bitwise_and_greedy_equal(tiny, reference, tmp_path):
    _, history, t2_ref = reference
    llm = make_llm(tiny, swap_space=4 * kv_bytes_per_block(tiny, 16), kv_offload_dir=str(tmp_path), **POOL)
    core = llm.core
    turn(llm, P_A, "a")
    tokens, saved = _kv_of_pin(llm, "a")
    turn(llm, P_B, "b")  # a -> host
    turn(llm, P_C, "c")  # b -> host, which spills a to disk
    core.step()
    assert not core.kv.is_offloaded("a") and core.kv.is_offloaded("b")
    disk = core.offload.disk
    assert disk is not None
    disk.flush()
    entry = disk.entries["a"]
    header, data = read_kv_file(entry.path, disk.fingerprint)
    assert header.token_ids == tokens and header.session_id == "a"
    _assert_same_kv(data, saved)
    core.kv.pool.evict_all_cached()
    out = turn(llm, history + NEXT, "a")
    assert out.outputs[0].token_ids == t2_ref
    assert out.usage.cached_tokens == len(tokens)
    off = core.stats.kv.offload
    assert off.spilled_sessions >= 1 and off.disk_restored_sessions == 1 and off.disk_errors == 0
    disk.flush()
    assert not entry.path.exists()  # the KV lives on device again
    _release_all(llm, "a", "b", "c")
    core.close()


def _spill_a_to_disk(llm: LLM) -> list[int]:
    """Session a on disk (its file written), b and c in the host tier; returns a's KV tokens."""
    turn(llm, P_A, "a")
    tokens, _ = _kv_of_pin(llm, "a")
    turn(llm, P_B, "b")  # a -> host
    turn(llm, P_C, "c")  # b -> host, which spills a to disk
    llm.core.step()
    assert llm.core.offload.disk is not None and "a" in llm.core.offload.disk.entries
    llm.core.offload.disk.flush()  # the write is done: a's next turn reads the file
    return tokens


class _Collect:
    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.cached: int | None = None
        self.done = False

    def __call__(self, out) -> None:  # type: ignore[no-untyped-def]
        for d in out.deltas:
            self.tokens.extend(d.token_ids)
        self.cached = out.num_cached_tokens if out.num_cached_tokens is not None else self.cached
        self.done = out.finished


def test_disk_read_runs_while_the_engine_steps(tiny, reference, tmp_path, monkeypatch):
    """A turn whose KV is on disk waits for its read off the engine thread; other requests keep stepping."""
    _, history, t2_ref = reference
    llm = make_llm(tiny, swap_space=4 * kv_bytes_per_block(tiny, 16), kv_offload_dir=str(tmp_path), **POOL)
    core = llm.core
    tokens = _spill_a_to_disk(llm)
    gate = threading.Event()
    real_read = disk_tier.read_kv_file

    def slow_read(*args, **kwargs):  # type: ignore[no-untyped-def]
        assert gate.wait(10.0), "the test never opened the gate"
        return real_read(*args, **kwargs)

    monkeypatch.setattr(disk_tier, "read_kv_file", slow_read)
    core.kv.pool.evict_all_cached()
    a, other = _Collect(), _Collect()
    core.add_request("a2", history + NEXT, greedy(8), a, session_id="a")
    core.add_request("x", P_B[:20], greedy(8), other)
    for _ in range(40):  # bounded: the other request needs 9 steps or so
        core.step()
        if other.done:
            break
    assert other.done and len(other.tokens) == 8, "a disk read held up the other request"
    assert core.kv.is_loading("a") and not a.tokens  # still waiting for its KV
    gate.set()
    deadline = time.monotonic() + 20
    while not a.done and time.monotonic() < deadline:
        core.step()
    assert a.tokens == t2_ref and a.cached == len(tokens)  # restored from disk, not recomputed
    assert core.offload.times.disk_reads == 1 and not core.kv.is_loading("a")
    _release_all(llm, "a", "b", "c")
    core.close()


def test_release_during_a_disk_read_drops_what_it_brings(tiny, reference, tmp_path, monkeypatch):
    _, history, _ = reference
    llm = make_llm(tiny, swap_space=4 * kv_bytes_per_block(tiny, 16), kv_offload_dir=str(tmp_path), **POOL)
    core = llm.core
    _spill_a_to_disk(llm)
    gate = threading.Event()
    real_read = disk_tier.read_kv_file

    def slow_read(*args, **kwargs):  # type: ignore[no-untyped-def]
        assert gate.wait(10.0)
        return real_read(*args, **kwargs)

    monkeypatch.setattr(disk_tier, "read_kv_file", slow_read)
    a = _Collect()
    core.add_request("a2", history + NEXT, greedy(4), a, session_id="a")
    core.step()
    assert core.kv.is_loading("a")
    core.abort("a2")
    core.release_session("a")
    assert not core.kv.is_loading("a")
    gate.set()
    core.offload.poll(timeout_s=10.0)
    assert not core.kv.is_offloaded("a") and "a" not in core.kv.sessions  # the read landed and was dropped
    _release_all(llm, "b", "c")
    core.close()
    assert not list(tmp_path.glob("*.kv"))  # the read deleted a's file; b and c were released


def test_restart_resumes_with_cached_tokens(tiny, reference, tmp_path):
    _, history, t2_ref = reference
    first = make_llm(tiny, kv_offload_dir=str(tmp_path))
    turn(first, P_A, "a")
    tokens, _ = _kv_of_pin(first, "a")
    first.core.close()  # shutdown saves the pinned session
    second = make_llm(tiny, kv_offload_dir=str(tmp_path))
    assert second.core.saved_sessions() == [("a", history)]
    out = turn(second, history + NEXT, "a")
    assert out.outputs[0].token_ids == t2_ref
    assert out.usage.cached_tokens == len(tokens) == len(history) - 1
    second.core.close()


def test_restart_with_another_cache_layout_recomputes(tiny, reference, tmp_path, caplog):
    _, history, t2_ref = reference
    first = make_llm(tiny, kv_offload_dir=str(tmp_path))
    turn(first, P_A, "a")
    first.core.close()
    with caplog.at_level(logging.WARNING, logger="streamkv.cache.disk_tier"):
        other = make_llm(tiny, kv_offload_dir=str(tmp_path), block_size=32)
    assert other.core.saved_sessions() == []
    assert any("another model, dtype or block size" in r.getMessage() for r in caplog.records)
    out = turn(other, history + NEXT, "a")
    assert out.outputs[0].token_ids == t2_ref and out.usage.cached_tokens == 0
    other.core.close()
    assert len(list(tmp_path.glob("*.kv"))) == 2  # the other layout's file is left alone


def test_fingerprint_tells_models_and_dtypes_apart(tiny):
    m = tiny.model
    base = kv_fingerprint(m, None, torch.float32, torch.float32, 16, [2, 16, 2, 16])
    assert base == kv_fingerprint(m, None, torch.float32, torch.float32, 16, [2, 16, 2, 16])
    assert base != kv_fingerprint(m, None, torch.bfloat16, torch.bfloat16, 16, [2, 16, 2, 16])
    assert base != kv_fingerprint(m, None, torch.float32, torch.int8, 16, [2, 16, 2, 16])
    other = torch.nn.Linear(4, 4)
    assert base["weights_crc32"] != kv_fingerprint(other, None, torch.float32, torch.float32, 16, [1])["weights_crc32"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_kv_file_round_trip(tmp_path, dtype):
    data = [[torch.randn(2, 3, 16, 2, 8).to(dtype), torch.randn(2, 3, 4).to(dtype)] for _ in range(2)]
    fp = {"model": "x", "block_size": 16}
    write_kv_file(tmp_path / "s.kv", fp, "sid", [1, 2, 3], [4], data)
    header, got = read_kv_file(tmp_path / "s.kv", fp)
    assert (header.session_id, header.token_ids, header.history_tail, header.num_blocks) == ("sid", [1, 2, 3], [4], 3)
    _assert_same_kv(got, data)
    with pytest.raises(KVFileError, match="another model"):
        read_kv_file(tmp_path / "s.kv", {"model": "y", "block_size": 16})


# ------------------------------------------------------------------ faults


def _saved_then_damaged(tiny: LoadedModel, directory: Path, damage: str) -> None:
    first = make_llm(tiny, kv_offload_dir=str(directory))
    turn(first, P_A, "a")
    first.core.close()
    (path,) = directory.glob("*.kv")
    raw = bytearray(path.read_bytes())
    if damage == "flip":
        raw[-100] ^= 0x5A
    else:
        raw = raw[: len(raw) - 1000]
    path.write_bytes(bytes(raw))


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_corrupt_or_truncated_file_recomputes(tiny, reference, tmp_path, caplog, damage):
    _, history, t2_ref = reference
    _saved_then_damaged(tiny, tmp_path, damage)
    llm = make_llm(tiny, kv_offload_dir=str(tmp_path))
    assert [s for s, _ in llm.core.saved_sessions()] == ["a"]  # the header is intact
    with caplog.at_level(logging.WARNING, logger="streamkv.cache.disk_tier"):
        out = turn(llm, history + NEXT, "a")
    assert out.outputs[0].token_ids == t2_ref and out.usage.cached_tokens == 0
    msgs = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(msgs) == 1 and ("checksum" in msgs[0] or "payload of" in msgs[0]), msgs
    assert llm.core.stats.kv.offload.disk_errors == 1
    _release_all(llm, "a")
    llm.core.close()


def test_full_disk_logs_once_and_recomputes(tiny, reference, tmp_path, caplog, monkeypatch):
    _, history, t2_ref = reference

    def no_space(*args: object, **kwargs: object) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(disk_tier, "write_kv_file", no_space)
    first = make_llm(tiny, kv_offload_dir=str(tmp_path))
    turn(first, P_A, "a")
    turn(first, P_B, "b")
    with caplog.at_level(logging.WARNING, logger="streamkv.cache.disk_tier"):
        first.core.close()
    msgs = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(msgs) == 1 and "No space left on device" in msgs[0], msgs
    disk = first.core.offload.disk
    assert disk is not None and disk.stats().errors == 2 and disk.stats().sessions == 0
    monkeypatch.undo()
    second = make_llm(tiny, kv_offload_dir=str(tmp_path))
    assert second.core.saved_sessions() == []
    out = turn(second, history + NEXT, "a")
    assert out.outputs[0].token_ids == t2_ref and out.usage.cached_tokens == 0
    second.core.close()


def test_disk_cap_drops_least_recently_used(tmp_path):
    data = [[torch.zeros(2, 2, 16, 2, 16)]]  # 8 KiB of KV
    size = 8192 + 8 * 21 + 4096  # what put() counts for it: KV, token ids, header allowance
    tier = DiskTier(tmp_path, max_bytes=2 * size + 100, fingerprint={"m": 1})
    for sid in ("s1", "s2", "s3"):
        assert tier.put(sid, [1] * 20, [2], data)
    assert list(tier.entries) == ["s2", "s3"] and tier.num_bytes == 2 * size
    assert not tier.put("huge", [1], [], [[torch.zeros(2, 64, 16, 2, 16)]])
    tier.flush()
    assert len(list(tmp_path.glob("*.kv"))) == 2 and tier.stats().dropped_sessions == 2
    tier.close()


def test_read_only_dir_logs_once_and_serves(tiny, reference, tmp_path, caplog):
    _, history, t2_ref = reference
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with caplog.at_level(logging.WARNING, logger="streamkv.cache.disk_tier"):
        llm = make_llm(tiny, kv_offload_dir=str(blocker / "kv"), **POOL)
        turn(llm, P_A, "a")
        turn(llm, history + NEXT, "a")
        llm.core.close()
    msgs = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(msgs) == 1 and "cannot write" in msgs[0], msgs
    if os.geteuid() != 0:  # root ignores directory permissions
        ro = tmp_path / "ro"
        ro.mkdir()
        ro.chmod(0o500)
        tier = DiskTier(ro, 1 << 20, {"m": 1})
        assert not tier.writable and not tier.put("s", [1], [], [[torch.zeros(2, 1, 16, 2, 16)]])
        tier.close()
    fresh = make_llm(tiny)
    assert turn(fresh, history + NEXT, "a").outputs[0].token_ids == t2_ref


@pytest.mark.parametrize("host_blocks", [64, 8])  # host tier for all; for two (the rest spill to disk)
def test_interleaved_conversations_equal_a_roomy_pool(tiny, tmp_path, host_blocks):
    """Six conversations, three turns, all in flight together in a pool for about two: same greedy tokens."""
    prompts = prompts_of([30] * 6, seed=21)
    users = [prompts_of([5] * 6, seed=22 + k) for k in range(2)]

    def conversations(llm: LLM) -> list[list[int]]:
        history = [list(p) for p in prompts]
        for k in range(3):
            batch = history if k == 0 else [h + users[k - 1][i] for i, h in enumerate(history)]
            outs = llm.generate(batch, greedy(6), session_ids=[f"s{i}" for i in range(6)])
            history = [b + o.outputs[0].token_ids for b, o in zip(batch, outs, strict=True)]
            llm.core.check_invariants()
        return history

    want = conversations(make_llm(tiny, session_offload=False))
    bb = kv_bytes_per_block(tiny, 16)
    llm = make_llm(tiny, num_blocks=12, max_pinned_fraction=0.5, swap_space=host_blocks * bb,
                   kv_offload_dir=str(tmp_path))  # fmt: skip
    assert conversations(llm) == want
    off = llm.core.stats.kv.offload
    assert off.restored_sessions > 0
    if host_blocks == 8:
        assert off.spilled_sessions > 0 and off.disk_restored_sessions > 0
    _release_all(llm, *[f"s{i}" for i in range(6)])
    llm.core.close()
