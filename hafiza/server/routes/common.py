"""GET /health, /v1/models and /metrics: shared by both APIs."""

from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter, Depends
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from hafiza.server.auth import require_access, require_any_key
from hafiza.server.errors import ApiError
from hafiza.server.state import ServerState, server_state

router = APIRouter()
STARTED = int(time.time())


@router.get("/health")
async def health(state: ServerState = Depends(server_state)) -> JSONResponse:
    """200 while the engine thread is alive (503 otherwise), with the queue sizes."""
    alive = state.aengine.is_alive
    s = state.aengine.stats()
    body = {"status": "ok" if alive else "engine_dead", "model": state.settings.model_name,
            "running": s.num_running, "waiting": s.num_waiting, "kv_cache_usage_perc": s.kv_cache_usage_perc}
    return JSONResponse(body, status_code=200 if alive else 503)


def _model_entry(state: ServerState, name: str) -> dict[str, Any]:
    """One model in both APIs' shapes (OpenAI: id/object/created/owned_by; Anthropic: type/display_name)."""
    created_at = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(STARTED))
    return {"id": name, "object": "model", "created": STARTED, "owned_by": "hafiza", "type": "model",
            "display_name": state.aengine.engine.loaded.name, "created_at": created_at,
            "max_model_len": state.max_model_len}


@router.get("/v1/models", dependencies=[Depends(require_any_key)])
async def list_models(state: ServerState = Depends(server_state)) -> dict[str, Any]:
    names = [state.settings.model_name, *state.settings.aliases]
    return {"object": "list", "data": [_model_entry(state, n) for n in names], "has_more": False,
            "first_id": names[0], "last_id": names[-1]}


@router.get("/v1/models/{model_id:path}", dependencies=[Depends(require_any_key)])
async def get_model(model_id: str, state: ServerState = Depends(server_state)) -> dict[str, Any]:
    if not state.settings.accepts_model(model_id):
        raise ApiError(404, f"model {model_id!r} is not served here", param="model", code="model_not_found")
    return _model_entry(state, model_id)


@router.get("/metrics", dependencies=[Depends(require_access(lambda s: s.metrics_auth))])
async def metrics(state: ServerState = Depends(server_state)) -> Response:
    """Prometheus exposition of every collector on the app's registry (protected as `metrics_auth` says)."""
    return Response(state.metrics.exposition(), media_type=CONTENT_TYPE_LATEST)
