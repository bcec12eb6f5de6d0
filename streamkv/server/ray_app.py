"""N streamkv replicas on Ray Serve, routed by session (``pip install 'streamkv[ray]'``).

Each replica is one Ray actor that runs the whole single-process server:
:func:`streamkv.server.app.create_app` around its own engine (pool, sessions,
engine thread), as the ingress deployment behind Ray Serve's HTTP proxy.
Nothing is shared between replicas; nothing here routes or forwards a
request. Ray Serve does, with its consistent-hash request router
(``ray.serve.experimental.consistent_hash_router.ConsistentHashRouter`` in
ray 2.60) on the ``x-session-id`` header: every request and WebSocket of one
session id reaches one replica while the set of replicas is unchanged.

Two ways to start it::

    streamkv serve --ray --replicas 2 [any serve flag]
    serve run streamkv.server.ray_entry:app_builder replicas=2 num_blocks=512   # flags as key=value

A replica names itself after Ray's replica id: ``/metrics`` carries it as a
``replica`` label on every series, each HTTP response and WebSocket accept
as the ``x-streamkv-replica`` header, and a resume of a session that the
replica does not hold is ``session_lost`` (its replica died). Ray's health
check (``check_health``) calls the replica's own ``/healthz``.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import logging
from dataclasses import dataclass
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from streamkv.config import EngineConfig, ServerConfig

logger = logging.getLogger(__name__)

APP_NAME = "streamkv"
DEPLOYMENT_NAME = "streamkv"
CONSISTENT_HASH_ROUTER = "ray.serve.experimental.consistent_hash_router.ConsistentHashRouter"
ROUTERS = ("session", "default")
REPLICA_HEADER = "x-streamkv-replica"
INSTALL_HINT = "Ray Serve is not installed: pip install 'streamkv[ray]' (ray[serve]==2.60.0)"
DEFAULT_REPLICAS = 2
DEFAULT_MAX_ONGOING_REQUESTS = 1024


@dataclass(frozen=True, slots=True)
class RayServeConfig:
    """How the deployment is laid out on the Ray cluster.

    Attributes:
        replicas: engines, one Ray actor each.
        num_cpus: Ray CPUs reserved per replica (its torch threads, ``--threads``).
        num_gpus: Ray GPUs reserved per replica (1 with ``--device cuda``, else 0).
        router: ``session`` (consistent hash on ``x-session-id``, strict: no
            fallback to another replica) or ``default`` (Ray's power of two choices).
        address: the Ray cluster (``auto``: the one ``ray start`` runs here);
            ``None`` starts a local one.
        max_ongoing_requests: requests and WebSockets one replica takes at once
            (Ray's default of 5 would queue the sixth chat socket).
        health_check_period_s: seconds between two ``/healthz`` calls per replica.
    """

    replicas: int = DEFAULT_REPLICAS
    num_cpus: float = 1.0
    num_gpus: float = 0.0
    router: str = "session"
    address: str | None = None
    max_ongoing_requests: int = DEFAULT_MAX_ONGOING_REQUESTS
    health_check_period_s: float = 5.0

    def __post_init__(self) -> None:
        if self.replicas < 1:
            raise ValueError("replicas must be at least 1")
        if self.num_cpus <= 0:
            raise ValueError("num_cpus must be positive")
        if self.num_gpus < 0:
            raise ValueError("num_gpus must be >= 0")
        if self.router not in ROUTERS:
            raise ValueError(f"router must be one of {', '.join(ROUTERS)}, not {self.router!r}")
        if self.max_ongoing_requests < 1:
            raise ValueError("max_ongoing_requests must be at least 1")


def add_ray_args(parser: argparse.ArgumentParser) -> None:
    """The ``serve`` flags of this module (``--ray`` and friends), in one group."""
    group = parser.add_argument_group("Ray Serve", "N replicas routed by session; needs pip install 'streamkv[ray]'")
    group.add_argument("--ray", action="store_true", help="serve N replicas on Ray Serve (docs/scaling.md)")
    group.add_argument("--replicas", type=int, default=DEFAULT_REPLICAS, help="engines (with --ray)")
    group.add_argument(
        "--ray-address", default=None, help="Ray cluster to join, e.g. auto (default: start a local one)"
    )
    group.add_argument(
        "--ray-router",
        choices=ROUTERS,
        default=ROUTERS[0],
        help="session: consistent hash on x-session-id; default: Ray's power of two choices",
    )


def ray_config(args: argparse.Namespace) -> RayServeConfig:
    """The layout from parsed ``serve`` flags; raises ValueError naming the field."""
    return RayServeConfig(
        replicas=args.replicas,
        num_cpus=float(args.threads or 1),
        num_gpus=1.0 if str(args.device).startswith("cuda") else 0.0,
        router=args.ray_router,
        address=args.ray_address,
        max_ongoing_requests=args.max_connections or DEFAULT_MAX_ONGOING_REQUESTS,
    )


class StreamkvReplica:
    """One replica: a whole streamkv server (engine + Starlette app) inside a Ray actor.

    Wrapped by ``serve.ingress()`` in :func:`build_application`; Ray calls
    ``__serve_build_asgi_app__`` once after ``__init__`` and runs the app's
    lifespan (which starts the engine thread).
    """

    def __init__(self, engine_config: EngineConfig, server_config: ServerConfig, threads: int | None) -> None:
        import torch

        from streamkv.engine import AsyncEngine
        from streamkv.gc_control import CollectionTimer, freeze_startup_heap
        from streamkv.metrics import EngineMetrics
        from streamkv.server.app import create_app

        name = str(_ray("ray.serve").get_replica_context().replica_id.unique_id)
        if threads is not None:
            torch.set_num_threads(threads)
        metrics = EngineMetrics(const_labels={"replica": name})
        engine = AsyncEngine(engine_config, metrics=metrics)
        self.name = name
        self._app = create_app(engine, dataclasses.replace(server_config, replica=name), metrics)
        freeze_startup_heap()  # a replica serves this one engine for its life (gc_control.py)
        metrics.attach_gc_timer(CollectionTimer())
        logger.info("replica %s: engine loaded", name)

    def __serve_build_asgi_app__(self) -> ASGIApp:
        return ReplicaHeader(self._app, self.name)

    async def check_health(self) -> None:
        """Ray's health check: this replica's own ``GET /healthz``; raises unless it answers 200."""
        status = await asgi_get_status(self._app, "/healthz")
        if status != 200:
            raise RuntimeError(f"replica {self.name}: /healthz answered {status}")


class ReplicaHeader:
    """ASGI middleware: names the replica in every HTTP response and WebSocket accept (``x-streamkv-replica``)."""

    def __init__(self, app: ASGIApp, name: str) -> None:
        self.app = app
        self._header = (REPLICA_HEADER.encode(), name.encode())

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return

        async def send_named(message: Message) -> None:
            if message["type"] in ("http.response.start", "websocket.accept"):
                message = {**message, "headers": [*message.get("headers", ()), self._header]}
            await send(message)

        await self.app(scope, receive, send_named)


async def asgi_get_status(app: ASGIApp, path: str) -> int | None:
    """Call ``GET path`` on ``app`` in process (no socket); the response status, ``None`` if none was sent."""
    status: int | None = None

    async def receive() -> Message:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: Message) -> None:
        nonlocal status
        if message["type"] == "http.response.start":
            status = int(message["status"])

    scope: Scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "GET",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "root_path": "",
        "query_string": b"",
        "headers": [],
        "client": ("127.0.0.1", 0),
        "server": ("127.0.0.1", 0),
    }
    await app(scope, receive, send)
    return status


def build_application(
    engine_config: EngineConfig, server_config: ServerConfig, layout: RayServeConfig, threads: int | None = None
) -> Any:
    """The Ray Serve application (``ray.serve.Application``) of ``layout.replicas`` streamkv replicas.

    Raises:
        RuntimeError: ray[serve] is not installed (the message says how to install it).
    """
    serve = _ray("ray.serve")
    options: dict[str, Any] = {
        "name": DEPLOYMENT_NAME,
        "num_replicas": layout.replicas,
        "ray_actor_options": {"num_cpus": layout.num_cpus, "num_gpus": layout.num_gpus},
        "max_ongoing_requests": layout.max_ongoing_requests,
        "health_check_period_s": layout.health_check_period_s,
    }
    if layout.router == "session":
        # num_fallback_replicas=0: a busy replica queues the request rather than sending
        # it to a replica that does not hold the session.
        options["request_router_config"] = _ray("ray.serve.config").RequestRouterConfig(
            request_router_class=CONSISTENT_HASH_ROUTER,
            request_router_kwargs={"num_virtual_nodes": 100, "num_fallback_replicas": 0},
        )
    deployment = serve.deployment(serve.ingress()(StreamkvReplica), **options)
    return deployment.bind(engine_config, server_config, threads)


def serve_with_ray(
    engine_config: EngineConfig, server_config: ServerConfig, layout: RayServeConfig, threads: int | None
) -> None:
    """``streamkv serve --ray``: deploy on the Ray cluster and block until Ctrl-C.

    Ray Serve's proxy listens on ``server_config.host:port``.

    Raises:
        StartupError: ray[serve] is missing, or the model cannot be found.
    """
    from streamkv.server.preflight import StartupError

    try:
        ray, serve = _ray("ray"), _ray("ray.serve")
    except RuntimeError as e:
        raise StartupError(str(e)) from None
    engine_config = resolved(engine_config)
    ray.init(address=layout.address)
    serve.start(http_options={"host": server_config.host, "port": server_config.port})
    logger.info(
        "streamkv on Ray Serve: %d replicas, router %s, on http://%s:%d",
        layout.replicas,
        layout.router,
        server_config.host,
        server_config.port,
    )
    try:
        serve.run(
            build_application(engine_config, server_config, layout, threads),
            name=APP_NAME,
            route_prefix="/",
            blocking=True,
        )
    except KeyboardInterrupt:
        logger.info("Ctrl-C: shutting down Ray Serve")
    finally:
        serve.shutdown()


def _ray(module: str) -> Any:
    """A module of ray, untyped (so the code reads the same with or without the extra installed).

    Raises:
        RuntimeError: ray[serve] is not installed (the message says how to install it).
    """
    try:
        return importlib.import_module(module)
    except ImportError:
        raise RuntimeError(INSTALL_HINT) from None


def resolved(engine_config: EngineConfig) -> EngineConfig:
    """The model path found once, here, so every replica loads the same files."""
    from streamkv.server.preflight import resolve_model

    model = resolve_model(engine_config.model.model)
    return dataclasses.replace(engine_config, model=dataclasses.replace(engine_config.model, model=model))
