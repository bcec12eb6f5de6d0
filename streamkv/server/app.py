"""The Starlette app factory: routes, and a lifespan that owns background work.

Routes::

    GET /            web/index.html (the chat + block map UI)
    GET /static/...  files under web/
    GET /healthz     {"status": "ok"|"degraded"|"error", "model": ..., "max_model_len": ...}
    GET /metrics     Prometheus text format
    GET /api/stats   engine.snapshot() as JSON (?session_id= or ?response_id=: the viewer's own blocks)
    WS  /ws/chat     chat sessions (chat_ws.py)
    WS  /ws/stats    snapshots every ServerConfig.stats_interval s (stats_ws.py)
    /v1/..., /tokenize, /detokenize   the OpenAI-compatible API (openai/)
    /v1/responses[/{id}]              the Responses API, HTTP and WebSocket mode (responses/)

With ``ServerConfig.api_key`` set, every route but /healthz, /metrics and the
page's files needs the key (auth.py).

The lifespan starts the engine, an event-loop-lag probe and the session TTL
sweeper, and stops them in reverse order.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from pathlib import Path

import orjson
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import FileResponse, PlainTextResponse, Response
from starlette.routing import Mount, Route, WebSocketRoute
from starlette.staticfiles import StaticFiles

from streamkv.config import ServerConfig
from streamkv.errors import ErrorCode
from streamkv.metrics import EngineMetrics
from streamkv.server.auth import APIKeyMiddleware
from streamkv.server.chat_ws import chat_endpoint
from streamkv.server.engine_api import ServingEngine
from streamkv.server.limits import ConnectionLimit, check_stop_strings
from streamkv.server.logs import install_log_filters
from streamkv.server.openai import OpenAIServing, openai_routes
from streamkv.server.openai.errors import error_response
from streamkv.server.origin import OriginCheck, OriginPolicy
from streamkv.server.responses import ResponseStore, responses_routes
from streamkv.server.sessions import SessionRegistry
from streamkv.server.stats_ws import Viewer, stats_endpoint, viewer_snapshot

logger = logging.getLogger(__name__)

# <repo>/web, next to the streamkv package (a source checkout or an editable install).
DEFAULT_WEB_DIR = Path(__file__).resolve().parents[2] / "web"
LOOP_LAG_INTERVAL_S = 0.1


def create_app(
    engine: ServingEngine,
    server_config: ServerConfig,
    metrics: EngineMetrics,
    *,
    web_dir: Path | None = None,
) -> Starlette:
    """Build the app around an engine that is not started yet (the lifespan starts it).

    The session registry lives in ``app.state.sessions``. Every request
    passes the connection cap first, then every WebSocket the Origin check.

    Raises:
        ValueError: ``server_config.allowed_origins`` holds something that is not an origin.
    """
    web = DEFAULT_WEB_DIR if web_dir is None else web_dir
    origins = OriginPolicy(server_config.allowed_origins)
    install_log_filters()
    sessions = SessionRegistry(
        engine.release_session,
        server_config.session_ttl,
        max_sessions=server_config.max_sessions,
        replica=server_config.replica,
    )
    metrics.attach_sessions(lambda: len(sessions) - sessions.num_detached, lambda: sessions.num_detached)
    responses = ResponseStore(sessions, server_config.session_ttl, server_config.max_stored_responses)
    metrics.attach(lambda: engine.snapshot(include_blocks=False))

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await engine.start()
        for session_id, history in engine.saved_sessions():  # --kv-offload-dir: before a restart
            sessions.restore(session_id, history)
        tasks = [
            asyncio.create_task(_probe_loop_lag(metrics, LOOP_LAG_INTERVAL_S), name="loop-lag-probe"),
            asyncio.create_task(sessions.run_sweeper(), name="session-sweeper"),
        ]
        logger.info(
            "streamkv ready: model %s on http://%s:%d", engine.model_name, server_config.host, server_config.port
        )
        try:
            yield
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            sessions.close_all(release=not engine.keeps_sessions)
            await engine.shutdown()

    async def index(request: Request) -> Response:
        page = web / "index.html"
        if not page.is_file():
            return PlainTextResponse(f"web UI not found: {page} does not exist (run from a source checkout)", 404)
        return FileResponse(page, media_type="text/html")

    async def healthz(request: Request) -> Response:
        failed = engine.error is not None  # the engine thread died: not healthy
        stalled = engine.stalled  # steps run, nothing progresses
        body = {
            "status": "error" if failed else "degraded" if stalled else "ok",
            "model": engine.model_name,
            "max_model_len": engine.max_model_len,
        }
        code = 503 if failed or stalled else 200
        return Response(orjson.dumps(body), status_code=code, media_type="application/json")

    async def metrics_route(request: Request) -> Response:
        body, content_type = await asyncio.to_thread(metrics.render)
        return Response(body, headers={"Content-Type": content_type})

    async def api_stats(request: Request) -> Response:
        try:
            viewer = Viewer.from_query(request.query_params)
        except ValueError as e:
            return error_response(400, str(e), ErrorCode.INVALID_PARAMS, "response_id")
        snap = await viewer_snapshot(engine, viewer, responses.chain_view)
        return Response(orjson.dumps(snap), media_type="application/json", headers={"Cache-Control": "no-store"})

    routes: list[Route | WebSocketRoute | Mount] = [
        Route("/", index),
        Route("/healthz", healthz),
        Route("/metrics", metrics_route),
        Route("/api/stats", api_stats),
        WebSocketRoute("/ws/chat", chat_endpoint(engine, sessions, metrics, server_config)),
        WebSocketRoute("/ws/stats", stats_endpoint(engine, server_config.stats_interval, responses.chain_view)),
        *openai_routes(
            engine,  # type: ignore[arg-type]
            server_config.served_model_name,
            server_config.max_body_bytes,
            lambda stop: check_stop_strings(stop, server_config, metrics),
            sessions,
        ),
        *responses_routes(
            OpenAIServing(
                engine,  # type: ignore[arg-type]
                server_config.served_model_name,
                server_config.max_body_bytes,
                lambda stop: check_stop_strings(stop, server_config, metrics),
            ),
            sessions,
            responses,
            metrics,
            server_config,
        ),
    ]
    if web.is_dir():
        routes.append(Mount("/static", StaticFiles(directory=web), name="static"))
    else:
        logger.warning("web UI directory %s not found; / and /static/ will answer 404", web)
    middleware = [
        Middleware(ConnectionLimit, max_connections=server_config.max_connections, metrics=metrics),
        Middleware(OriginCheck, policy=origins, metrics=metrics),
    ]
    if server_config.api_key:
        middleware.append(Middleware(APIKeyMiddleware, api_key=server_config.api_key))
    app = Starlette(routes=routes, lifespan=lifespan, middleware=middleware)
    app.state.sessions = sessions
    app.state.responses = responses
    app.state.engine = engine
    app.state.metrics = metrics
    return app


async def _probe_loop_lag(metrics: EngineMetrics, interval: float) -> None:
    """Sleep ``interval`` s repeatedly; the overshoot is how long ready callbacks waited."""
    loop = asyncio.get_running_loop()
    while True:
        started = loop.time()
        await asyncio.sleep(interval)
        metrics.observe_loop_lag(loop.time() - started - interval)
