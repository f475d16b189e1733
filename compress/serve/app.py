"""The FastAPI application of ``compress serve``: routes, API key, errors.

Routes (OpenAI's and vLLM's names, so their clients work unchanged):
``GET /v1/models``, ``POST /v1/completions``, ``POST /v1/chat/completions``,
``POST /tokenize``, ``POST /detokenize``, ``GET /tokenizer_info``, ``GET /health``,
``GET /metrics``. Every route but ``/health`` needs ``Authorization: Bearer KEY`` when
the server has an API key (401 otherwise). Every error, ours or the framework's (404,
405), has OpenAI's body ``{"error": {"message", "type", "param", "code"}}``.

Bodies are read and validated by :mod:`compress.serve.protocol`, not by FastAPI's
signature-driven parsing, so malformed JSON and unknown fields give OpenAI-style 400s.
"""
from __future__ import annotations

import hmac
import logging
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from compress.serve.chat import chat_prompt_ids, create_chat_completion
from compress.serve.completions import create_completion
from compress.serve.generation import ClientGone
from compress.serve.metrics import render_metrics
from compress.serve.protocol import (APIError, ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                     TokenizeRequest, parse_json_body, validate)
from compress.serve.sse import EventStreamResponse
from compress.serve.state import ServerState

log = logging.getLogger(__name__)

OPEN_ROUTES = {"/health"}


class APIKeyAndCounters:
    """ASGI middleware: the API key check, and requests counted by route and status."""

    def __init__(self, app, state: ServerState):
        self.app, self.state = app, state

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope.get("path", "")
        status_seen = {}

        async def counting_send(message):
            if message["type"] == "http.response.start":
                status_seen["status"] = message["status"]
            await send(message)

        key = self.state.config.api_key
        try:
            if key and path not in OPEN_ROUTES and not _authorized(scope, key):
                err = APIError("missing or wrong API key: send 'Authorization: Bearer <key>'", status=401,
                               type="authentication_error", code="invalid_api_key",
                               headers={"WWW-Authenticate": "Bearer"})
                return await _error_response(err)(scope, receive, counting_send)
            return await self.app(scope, receive, counting_send)
        finally:
            route = path if path in KNOWN_ROUTES else "other"
            self.state.requests[(route, status_seen.get("status", 499))] += 1


def _authorized(scope, key: str) -> bool:
    headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
    auth = headers.get("authorization", "")
    scheme, _, token = auth.partition(" ")
    if scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), key.encode()):
        return True
    api_key = headers.get("x-api-key")
    return api_key is not None and hmac.compare_digest(api_key.encode(), key.encode())


def _error_response(err: APIError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


KNOWN_ROUTES = {"/v1/models", "/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize",
                "/tokenizer_info", "/health", "/metrics"}


def build_app(state: ServerState, on_shutdown=None) -> FastAPI:
    """The application over a started engine loop. ``on_shutdown`` runs at the end of the
    lifespan (after uvicorn's graceful drain)."""

    @asynccontextmanager
    async def lifespan(_app):
        yield
        state.draining = True
        if on_shutdown is not None:
            on_shutdown()

    app = FastAPI(title="compress serve", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)
    app.state.server = state

    @app.exception_handler(APIError)
    async def _api_error(_request, err: APIError):
        return _error_response(err)

    @app.exception_handler(ClientGone)
    async def _client_gone(_request, _exc):
        return Response(status_code=499)     # nobody reads it; the request was aborted

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_request, exc: StarletteHTTPException):
        kind = {404: "not_found_error", 405: "invalid_request_error"}.get(exc.status_code, "invalid_request_error")
        return _error_response(APIError(str(exc.detail), status=exc.status_code, type=kind))

    @app.exception_handler(Exception)
    async def _unexpected(_request, exc: Exception):
        log.exception("unhandled error")
        return _error_response(APIError(f"internal error: {type(exc).__name__}: {exc}", status=500,
                                        type="server_error"))

    async def body_of(request: Request, model_class):
        return validate(model_class, parse_json_body(await request.body()))

    @app.get("/health")
    async def health():
        if state.engine_loop.alive and not state.draining:
            return {"status": "ok"}
        return JSONResponse({"status": "unavailable"}, status_code=503)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [_model_card(state)]}

    @app.get("/v1/models/{name}")
    async def model(name: str):
        state.check_model(name)
        return _model_card(state)

    @app.post("/v1/completions")
    async def completions(request: Request):
        result = await create_completion(state, await body_of(request, CompletionRequest), request)
        return result if isinstance(result, dict) else EventStreamResponse(result)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        result = await create_chat_completion(state, await body_of(request, ChatCompletionRequest), request)
        return result if isinstance(result, dict) else EventStreamResponse(result)

    @app.post("/tokenize")
    async def tokenize(request: Request):
        body = await body_of(request, TokenizeRequest)
        state.check_model(body.model)
        if body.messages is not None:
            ids = chat_prompt_ids(state, [{"role": m.role, "content": m.text()} for m in body.messages],
                                  body.add_generation_prompt, body.chat_template_kwargs)
        else:
            ids = state.encode(body.prompt, body.add_special_tokens)
        return {"count": len(ids), "max_model_len": state.max_seq_len, "tokens": ids}

    @app.post("/detokenize")
    async def detokenize(request: Request):
        body = await body_of(request, DetokenizeRequest)
        state.check_model(body.model)
        state.check_token_ids(body.tokens, "tokens")
        return {"prompt": state.decode(body.tokens, skip_special_tokens=False)}

    @app.get("/tokenizer_info")
    async def tokenizer_info():
        return state.tokenizer_info()

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(render_metrics(state), media_type="text/plain; version=0.0.4")

    return APIKeyAndCounters(app, state)


def _model_card(state: ServerState) -> dict:
    return {"id": state.config.model_name, "object": "model", "created": int(state.started),
            "owned_by": "compress", "max_model_len": state.max_seq_len}
