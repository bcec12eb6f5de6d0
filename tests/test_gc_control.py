"""The collector switch around model loading, and the start-up heap freeze of a serving process."""

from __future__ import annotations

import gc
import subprocess
import sys
import textwrap

import pytest

from streamkv.gc_control import gc_paused


def test_gc_paused_turns_collection_off_and_restores_the_state_it_found() -> None:
    assert gc.isenabled()
    with gc_paused():
        assert not gc.isenabled()
        with gc_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()  # the inner block found it off, so it leaves it off
    assert gc.isenabled()

    with pytest.raises(RuntimeError), gc_paused():
        raise RuntimeError("a failed load")
    assert gc.isenabled()

    gc.disable()
    try:
        with gc_paused():
            pass
        assert not gc.isenabled()  # a caller that had it off keeps it off
    finally:
        gc.enable()


def test_freeze_startup_heap_leaves_later_collections_only_new_objects() -> None:
    # In a child process: a freeze is for the life of the process, and this one runs the rest of the suite.
    code = textwrap.dedent(
        """
        import gc
        from streamkv.gc_control import freeze_startup_heap

        heap = [[i] for i in range(50_000)]  # long-lived container objects, as a loaded model's are
        seconds = freeze_startup_heap()
        assert seconds > 0 and gc.get_freeze_count() >= 50_000, gc.get_freeze_count()
        assert len(gc.get_objects()) < 1_000, len(gc.get_objects())  # what a full collection now walks
        cycle = []
        cycle.append(cycle)
        del cycle
        assert gc.collect() >= 1  # garbage made after the freeze is still collected
        print("ok")
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"
