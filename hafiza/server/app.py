"""create_app: the FastAPI application around a running AsyncEngine."""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware
from prometheus_client import CollectorRegistry

from hafiza.engine.async_engine import AsyncEngine
from hafiza.server.dashboard import mount_dashboard
from hafiza.server.determinism import HEADER as DETERMINISM_HEADER
from hafiza.server.determinism import DeterminismHeader
from hafiza.server.errors import CatchAllMiddleware, install_error_handlers
from hafiza.server.guard import BrowserGuard
from hafiza.server.openapi import mount_openapi
from hafiza.server.routes import anthropic, common, completions, openai, render, responses, tokenize
from hafiza.server.settings import ServerSettings
from hafiza.server.state import ServerState

EXPOSED_HEADERS = ("x-hafiza-cache", "x-hafiza-tiers", DETERMINISM_HEADER, "request-id", "x-request-id")


def create_app(aengine: AsyncEngine, settings: ServerSettings | None = None,
               registry: CollectorRegistry | None = None) -> FastAPI:
    """The HTTP app. The engine is started and stopped by the caller; `app.state.hafiza` (a ServerState) holds
    the engine, settings and metrics registry for routes and collectors added later, `app.state.hafiza_responses`
    the Responses API's stored responses. Every request passes the BrowserGuard (Host allow-list, same-origin JSON
    for state changes); CORS answers only `cors_origins`."""
    settings = settings or ServerSettings()
    app = FastAPI(title="hafiza", summary="Anthropic Messages, OpenAI Chat Completions, Completions and Responses "
                                          "with prompt caching",
                  docs_url=None, redoc_url=None, openapi_url=None)
    app.state.hafiza = ServerState.create(aengine, settings, registry)
    app.state.hafiza_responses = responses.ResponseStore()  # stored Responses API results, per app
    install_error_handlers(app)
    app.include_router(common.router)
    app.include_router(anthropic.router)
    app.include_router(openai.router)
    app.include_router(completions.router)
    app.include_router(responses.router)
    app.include_router(render.router)
    app.include_router(tokenize.router)
    mount_openapi(app)
    mount_dashboard(app)
    if settings.cors_origins:
        app.add_middleware(CORSMiddleware, allow_origins=list(settings.cors_origins), allow_methods=["*"],
                           allow_headers=["*"], expose_headers=list(EXPOSED_HEADERS))
    app.add_middleware(BrowserGuard, settings=settings)
    app.add_middleware(DeterminismHeader, value=aengine.engine.determinism)
    app.add_middleware(CatchAllMiddleware)  # added last, so outermost: no middleware's exception reaches uvicorn
    return app
