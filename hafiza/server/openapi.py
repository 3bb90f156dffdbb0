"""GET /openapi.json and /docs: the real request schemas of every API route (the routes read and validate raw
bodies themselves, so FastAPI alone would describe none), their success and error responses, and Swagger UI
served from the `fastapi-offline` package's files (no CDN)."""

from __future__ import annotations

from pathlib import Path

import fastapi_offline
from fastapi import FastAPI
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.openapi.utils import get_openapi
from fastapi.responses import HTMLResponse
from fastapi.staticfiles import StaticFiles
from pydantic import BaseModel

from hafiza.server.schemas.anthropic import CountTokensRequest, MessagesRequest
from hafiza.server.schemas.completions import CompletionRequest, DetokenizeRequest, TokenizeRequest
from hafiza.server.schemas.openai import ChatCompletionRequest
from hafiza.server.schemas.responses import ResponseRequest

Json = dict[str, object]
STATIC = Path(fastapi_offline.__file__).parent / "static"

REQUEST_BODIES: dict[str, type[BaseModel]] = {
    "/v1/messages": MessagesRequest,
    "/v1/messages/count_tokens": CountTokensRequest,
    "/v1/chat/completions": ChatCompletionRequest,
    "/v1/completions": CompletionRequest,
    "/v1/responses": ResponseRequest,
    "/v1/chat/completions/render": ChatCompletionRequest,
    "/v1/completions/render": CompletionRequest,
    "/v1/responses/render": ResponseRequest,
    "/tokenize": TokenizeRequest,
    "/detokenize": DetokenizeRequest,
}
STREAMING = {"/v1/messages", "/v1/chat/completions", "/v1/completions", "/v1/responses"}
API_PREFIXES = ("/v1/", "/tokenize", "/detokenize", "/tokenizer_info", "/health")

OPENAI_ERROR: Json = {"type": "object", "required": ["error"], "properties": {"error": {
    "type": "object", "required": ["message", "type"],
    "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                   "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}}}
ANTHROPIC_ERROR: Json = {"type": "object", "required": ["type", "error"], "properties": {
    "type": {"const": "error"}, "error": {"type": "object", "required": ["type", "message"],
                                          "properties": {"type": {"type": "string"}, "message": {"type": "string"}}}}}
ERROR_STATUSES = {"400": "invalid request", "401": "missing or wrong API key", "403": "forbidden",
                  "404": "not found", "405": "method not allowed", "413": "request body too large",
                  "415": "body is not JSON", "429": "too many requests", "500": "internal error",
                  "503": "engine unavailable"}


def _schemas(model: type[BaseModel], components: dict[str, Json]) -> Json:
    """The model's JSON schema with its definitions moved into components; returns a $ref to it."""
    schema = model.model_json_schema(by_alias=True, ref_template="#/components/schemas/{model}")
    for name, sub in schema.pop("$defs", {}).items():
        components[name] = sub
    components[model.__name__] = schema
    return {"$ref": f"#/components/schemas/{model.__name__}"}


def build_openapi(app: FastAPI) -> Json:
    """The document: FastAPI's paths, with request bodies, responses and error shapes filled in."""
    doc = get_openapi(title=app.title, version=app.version, summary=app.summary, routes=app.routes)
    components: dict[str, Json] = doc.setdefault("components", {}).setdefault("schemas", {})
    components.pop("HTTPValidationError", None)
    components.pop("ValidationError", None)
    components["OpenAIError"], components["AnthropicError"] = OPENAI_ERROR, ANTHROPIC_ERROR
    paths: dict[str, dict[str, Json]] = doc.get("paths", {})
    for path in list(paths):
        if not path.startswith(API_PREFIXES):
            del paths[path]
    for path, ops in paths.items():
        error = "AnthropicError" if path.startswith("/v1/messages") else "OpenAIError"
        for method, op in ops.items():
            responses: dict[str, Json] = {}
            ok = op.get("responses", {}).get("200", {"description": "OK"})
            if path in STREAMING:
                ok = {"description": "the response, or server-sent events with `stream: true`",
                      "content": {"application/json": {"schema": {"type": "object"}},
                                  "text/event-stream": {"schema": {"type": "string"}}}}
            responses["200"] = ok
            for status, why in ERROR_STATUSES.items():
                responses[status] = {"description": why, "content": {"application/json": {
                    "schema": {"$ref": f"#/components/schemas/{error}"}}}}
            op["responses"] = responses
            model = REQUEST_BODIES.get(path)
            if model is not None and method == "post":
                op["requestBody"] = {"required": True, "content": {"application/json": {
                    "schema": _schemas(model, components)}}}
    return doc


def mount_openapi(app: FastAPI) -> None:
    """/openapi.json (built once, on first request) and /docs (Swagger UI, files served locally)."""
    cache: list[Json] = []

    def openapi() -> Json:
        if not cache:
            cache.append(build_openapi(app))
        return cache[0]

    app.openapi = openapi  # type: ignore[method-assign]
    app.mount("/docs/static", StaticFiles(directory=STATIC), name="docs-static")

    @app.get("/openapi.json", include_in_schema=False)
    async def openapi_json() -> Json:
        return openapi()

    @app.get("/docs", include_in_schema=False)
    async def docs() -> HTMLResponse:
        return get_swagger_ui_html(openapi_url="/openapi.json", title=f"{app.title} API",
                                   swagger_js_url="/docs/static/swagger-ui-bundle.js",
                                   swagger_css_url="/docs/static/swagger-ui.css",
                                   swagger_favicon_url="/docs/static/favicon.png")
