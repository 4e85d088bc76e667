"""`keel serve`: an OpenAI-compatible HTTP server (FastAPI + uvicorn) over AsyncLLM.

Routes: GET /v1/models, POST /v1/completions, POST /v1/chat/completions (a generation model),
POST /v1/embeddings (a pooling model: --runner pooling), GET /health, GET /version, GET /metrics
(Prometheus). Errors have OpenAI's shape,
`{"error": {"message", "type", "param", "code"}}`: 400 for a bad request (the field named), 401
without the API key on /v1 routes when one is set, 404 for an unknown model or route, 413 for
a body over the limit, 503 once the engine has died.
"""

from __future__ import annotations

import hmac
import logging
from typing import Any

from fastapi import FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

import keel
from keel.engine.async_llm import AsyncLLM
from keel.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    EmbeddingRequest,
    ErrorInfo,
    ErrorResponse,
    ModelCard,
    ModelList,
)
from keel.entrypoints.openai.serving import (
    OpenAIServingChat,
    OpenAIServingCompletion,
    OpenAIServingEmbedding,
    ServingError,
)
from keel.metrics import PrometheusStatLogger

logger = logging.getLogger(__name__)

DEFAULT_MAX_BODY_BYTES = 10 << 20  # 10 MiB

_ERROR_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError",
                405: "MethodNotAllowedError", 413: "RequestTooLargeError",
                422: "BadRequestError", 500: "InternalServerError",
                503: "ServiceUnavailableError"}


# What the generation and embedding routes may answer besides 200 (in the OpenAPI document).
_ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorResponse, "description": _ERROR_TYPES[status]}
    for status in (400, 401, 404, 413, 503)
}


def error_response(message: str, status: int, param: str | None = None,
                   err_type: str | None = None) -> JSONResponse:
    body = ErrorResponse(error=ErrorInfo(message=message, type=err_type or _ERROR_TYPES.get(
        status, "Error"), param=param, code=status))
    return JSONResponse(body.model_dump(), status_code=status)


class RequestGate:
    """ASGI middleware in front of the app: the API key on /v1 routes (401 without it), then
    the body size (413 over `max_bytes`, whether the body declares its length or streams in
    chunks). Plain ASGI rather than @app.middleware, so that an error raised while the body is
    read reaches FastAPI as it is."""

    def __init__(self, app: Any, api_key: str | None, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes
        self.expected = f"Bearer {api_key}".encode() if api_key is not None else None

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers", ()))
        if self.expected is not None and scope["path"].startswith("/v1") and \
                not hmac.compare_digest(headers.get(b"authorization", b""), self.expected):
            await error_response("Invalid or missing API key: send 'Authorization: Bearer "
                                 "<key>'.", 401)(scope, receive, send)
            return
        too_large = f"The request body is larger than {self.max_bytes} bytes."
        length = headers.get(b"content-length", b"")
        if length.isdigit() and int(length) > self.max_bytes:
            await error_response(too_large, 413)(scope, receive, send)
            return
        received = 0

        async def limited_receive():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    # FastAPI passes an HTTPException from reading the body through as is.
                    raise HTTPException(413, too_large)
            return message

        await self.app(scope, limited_receive, send)


def _first_error(exc: RequestValidationError) -> tuple[str, str | None]:
    """A readable message naming the field, from pydantic's first error."""
    errors = exc.errors()
    if not errors:
        return "Invalid request.", None
    err = errors[0]
    loc = [str(part) for part in err.get("loc", ()) if part != "body"]
    field = ".".join(loc) if loc else None
    msg = err.get("msg", "invalid value")
    if err.get("type") == "json_invalid":
        return f"The body is not valid JSON: {msg}", None
    if err.get("type") == "missing":
        return f"Missing required field '{field}'.", field
    more = f" (and {len(errors) - 1} more error(s))" if len(errors) > 1 else ""
    return (f"Invalid value for '{field}': {msg}{more}" if field else f"{msg}{more}"), field


def build_app(engine: AsyncLLM, served_model_names: list[str], api_key: str | None = None,
              max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
              stat_logger: PrometheusStatLogger | None = None) -> FastAPI:
    app = FastAPI(title="keel", version=keel.__version__,
                  description="keel's OpenAI-compatible API")
    completion = OpenAIServingCompletion(engine, served_model_names)
    chat = OpenAIServingChat(engine, served_model_names)
    embedding = OpenAIServingEmbedding(engine, served_model_names)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError):
        message, param = _first_error(exc)
        return error_response(message, 400, param)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException):
        return error_response(str(exc.detail), exc.status_code)

    @app.exception_handler(ServingError)
    async def _serving_error(_: Request, exc: ServingError):
        return error_response(exc.message, exc.status, exc.param, exc.err_type)

    @app.get("/health", responses={503: {"model": ErrorResponse}})
    async def health() -> Response:
        if engine.errored:
            return error_response(f"The engine failed: {engine.engine_core.dead_reason}", 503)
        return Response(status_code=200)

    @app.get("/version")
    async def version() -> dict:
        return {"version": keel.__version__}

    @app.get("/metrics")
    async def metrics() -> Response:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        if stat_logger is None:
            return Response("", media_type=CONTENT_TYPE_LATEST)
        return Response(generate_latest(stat_logger.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models", response_model=ModelList,
             responses={401: {"model": ErrorResponse}})
    async def models() -> ModelList:
        root = str(engine.model_config.model_path)
        return ModelList(data=[ModelCard(id=name, root=root,
                                         max_model_len=engine.model_config.max_model_len)
                               for name in served_model_names])

    def _respond(result):
        if hasattr(result, "__aiter__"):
            return StreamingResponse(result, media_type="text/event-stream")
        return JSONResponse(result.model_dump())

    @app.post("/v1/completions", responses=_ERROR_RESPONSES)
    async def create_completion(request: CompletionRequest):
        return _respond(await completion.create_completion(request))

    @app.post("/v1/chat/completions", responses=_ERROR_RESPONSES)
    async def create_chat_completion(request: ChatCompletionRequest):
        return _respond(await chat.create_chat_completion(request))

    @app.post("/v1/embeddings", responses=_ERROR_RESPONSES)
    async def create_embedding(request: EmbeddingRequest):
        return _respond(await embedding.create_embedding(request))

    return RequestGate(app, api_key, max_body_bytes)


def run_server(engine_args, host: str = "127.0.0.1", port: int = 8000,
               api_key: str | None = None, served_model_name: list[str] | None = None,
               max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, log_level: str = "info") -> None:
    """Start the engine process, then serve until interrupted; always stop the engine."""
    import uvicorn

    default_name = "all-MiniLM-L6-v2" if engine_args.runner == "pooling" \
        else "SmolLM2-135M-Instruct"
    names = served_model_name or [engine_args.model or default_name]
    stat_logger = PrometheusStatLogger(names[0])
    engine = AsyncLLM.from_engine_args(engine_args, "openai_api_server",
                                       stat_loggers=[stat_logger])
    try:
        app = build_app(engine, names, api_key, max_body_bytes, stat_logger)
        logger.info("Serving %s on http://%s:%d", names, host, port)
        uvicorn.run(app, host=host, port=port, log_level=log_level,
                    timeout_graceful_shutdown=5)
    finally:
        engine.shutdown()
