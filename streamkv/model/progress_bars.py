"""transformers' progress bars kept out of a log: :func:`progress_bars_on_a_terminal_only`, around a model load."""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Iterator
from typing import Any

from transformers.utils import logging as hf_logging

_bars_lock = threading.Lock()
_bars_loads = 0  # loads inside progress_bars_on_a_terminal_only now
_bars_saved: tuple[Any, Any, Any] = (None, None, None)  # (transformers' switch, gguf module, its tqdm) before


@contextlib.contextmanager
def progress_bars_on_a_terminal_only() -> Iterator[None]:
    """transformers' progress bars ("Loading weights", "Writing model shards", the GGUF parse's "Converting and
    de-quantizing GGUF tensors") off while stderr is not a terminal, as they were after.

    A server's stderr usually goes to a log or a journal, where each bar is a
    run of carriage-return updates; :func:`streamkv.model.loader.load_model` logs the load's time
    instead. transformers' bars check its module flag ``_tqdm_active``, which
    this sets alone (``disable_progress_bar``/``enable_progress_bar`` would also
    reset huggingface_hub's own switches); the GGUF parse calls tqdm itself, so
    for the load its module's ``tqdm`` is transformers' wrapper. Loads in
    several threads at once: the first in switches them off, the last out
    puts them back.
    """
    global _bars_loads, _bars_saved
    isatty = getattr(sys.stderr, "isatty", None)  # sys.stderr is None when fd 2 was closed at start
    if (isatty is not None and isatty()) or not hasattr(hf_logging, "_tqdm_active"):
        yield
        return
    with _bars_lock:
        if _bars_loads == 0:
            gguf_utils: Any = None
            with contextlib.suppress(ImportError):  # no gguf package: no GGUF parse either
                import transformers.modeling_gguf_pytorch_utils as gguf_utils
            _bars_saved = (hf_logging._tqdm_active, gguf_utils, getattr(gguf_utils, "tqdm", None))
            hf_logging._tqdm_active = False
            if _bars_saved[2] is not None:
                gguf_utils.tqdm = hf_logging.tqdm
        _bars_loads += 1
    try:
        yield
    finally:
        with _bars_lock:
            _bars_loads -= 1
            if _bars_loads == 0:
                active, gguf_utils, raw_tqdm = _bars_saved
                hf_logging._tqdm_active = active
                if raw_tqdm is not None:
                    gguf_utils.tqdm = raw_tqdm
