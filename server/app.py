"""HTTP routes (FastAPI): parse, authenticate, hand to `Serving`, frame the reply. Nothing here touches arrays or
the engine directly.

Authentication: with an API key set, every route except `/health`, `/metrics` and `/version` needs
`Authorization: Bearer <key>` (vLLM guards the API routes and leaves probes open, which load balancers and
Prometheus scrapers rely on). Keys are compared with `hmac.compare_digest`.
"""

from __future__ import annotations

import asyncio
import functools
import hmac
import logging

import pydantic_core
from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from server import anthropic, responses
from server import protocol as P
from server.errors import APIError, error_body, from_validation_error
from server.metrics import CONTENT_TYPE
from server.serving import ClientDisconnected, EventStream, Serving

log = logging.getLogger("server")

# Image-free chat bodies are small; 32 MiB matches the seed server and leaves room for long prompts.
DEFAULT_MAX_BODY_BYTES = 32 * 1024 * 1024


class BodyTooLarge(Exception):
    pass


class BodyLimit:
    """413 before parsing: at once from Content-Length, or as soon as a chunked body passes the limit."""

    def __init__(self, app: ASGIApp, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        for name, value in scope.get("headers", ()):
            if name == b"content-length":
                if value.isdigit() and int(value) > self.max_bytes:
                    response = JSONResponse(_too_large_body(self.max_bytes), status_code=413)
                    await response(scope, receive, send)
                    return
        received = 0

        async def limited_receive():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise BodyTooLarge()
            return message

        await self.app(scope, limited_receive, send)


def _too_large_body(limit: int) -> dict:
    return error_body(f"The request body is larger than this server accepts ({limit} bytes).",
                      type="invalid_request_error", code="request_too_large")


class SSEResponse(StreamingResponse):
    """Server-sent events whose `close` runs however the response ends: finished, failed, or the client gone
    (Starlette cancels the streaming task on disconnect, possibly before the first chunk was pulled)."""

    def __init__(self, stream: EventStream):
        super().__init__(stream.chunks, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._close = stream.close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._close()


def _parse(model: type[BaseModel], body: bytes):
    try:
        return model.model_validate_json(body)
    except ValidationError as e:
        raise from_validation_error(e) from None


def _parse_tokenize(body: bytes) -> P.TokenizeCompletionRequest | P.TokenizeChatRequest:
    """vLLM's /tokenize takes either shape; `messages` decides which one (so errors name the right fields)."""
    try:
        raw = pydantic_core.from_json(body)
    except ValueError as e:
        raise APIError(400, f"The request body is not valid JSON: {e}") from None
    model = P.TokenizeChatRequest if isinstance(raw, dict) and "messages" in raw else P.TokenizeCompletionRequest
    try:
        return model.model_validate(raw)
    except ValidationError as e:
        raise from_validation_error(e) from None


def build_app(serving: Serving, *, api_key: str | None = None, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
              responses_store: int = responses.DEFAULT_STORE) -> FastAPI:
    app = FastAPI(title="qwen-jax", summary="OpenAI-compatible server for Qwen3.5 hybrid models",
                  docs_url=None, redoc_url=None, openapi_url=None)

    async def require_key(request: Request) -> None:
        if api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer":  # Anthropic's clients send the key as x-api-key
            token = request.headers.get("x-api-key", "")
        if not hmac.compare_digest(token.strip().encode(), api_key.encode()):
            raise APIError(401, "Incorrect API key provided. Send it as `Authorization: Bearer <key>`.",
                           code="invalid_api_key")

    guarded = [Depends(require_key)]

    def wait_disconnect(request: Request):
        async def wait() -> None:
            while (await request.receive())["type"] != "http.disconnect":
                pass
        return wait

    def reply(result):
        if isinstance(result, EventStream):
            return SSEResponse(result)
        return JSONResponse(result.model_dump())

    @app.post("/v1/chat/completions", dependencies=guarded)
    async def chat_completions(request: Request):
        req = _parse(P.ChatCompletionRequest, await request.body())
        return reply(await serving.chat(req, wait_disconnect(request)))

    @app.post("/v1/completions", dependencies=guarded)
    async def completions(request: Request):
        req = _parse(P.CompletionRequest, await request.body())
        return reply(await serving.completion(req, wait_disconnect(request)))

    def converted(convert, req):
        """An Anthropic or Responses API request as a chat request (a refusal of the result a 400 like any other)."""
        try:
            return convert(req)
        except ValidationError as e:
            raise from_validation_error(e) from None

    @app.post("/v1/messages", dependencies=guarded)
    async def messages(request: Request):
        req = _parse(anthropic.MessagesRequest, await request.body())
        result = await serving.chat(converted(anthropic.to_chat, req), wait_disconnect(request))
        if isinstance(result, EventStream):
            events = anthropic.MessagesStream(result.chunks, serving.model_name).events()
            return SSEResponse(EventStream(events, result.close))
        return JSONResponse(anthropic.from_chat(result))

    @app.post("/v1/messages/count_tokens", dependencies=guarded)
    async def count_tokens(request: Request):
        req = _parse(anthropic.CountTokensRequest, await request.body())
        result = await serving.tokenize(converted(anthropic.tokenize_request, req))
        return JSONResponse({"input_tokens": result.count})

    think_end = serving.think_end  # where the reasoning tokens a response counts end
    store = responses.ResponseStore(responses_store)

    @app.post("/v1/responses", dependencies=guarded)
    async def create_response(request: Request):
        req = _parse(responses.ResponsesRequest, await request.body())
        history = store.history(req)
        stored = store.stores(req)
        chat = converted(functools.partial(responses.to_chat, history=history), req)
        if req.background:
            return JSONResponse(background(req, history, chat))
        result = await serving.chat(chat, wait_disconnect(request))
        keep = functools.partial(store.keep, req, history) if stored else None
        if isinstance(result, EventStream):
            events = responses.ResponsesStream(result.chunks, req, serving.model_name, think_end, stored, keep)
            return SSEResponse(EventStream(events.events(), result.close))
        obj = responses.from_chat(req, result, think_end, stored)
        if keep is not None:
            keep(obj)
        return JSONResponse(obj)

    def background(req: responses.ResponsesRequest, history, chat: P.ChatCompletionRequest) -> dict:
        """Store the response queued, run its chat request in a task of its own and store the result: completed /
        incomplete, failed with the error (a 400 or 503 the request would have got, a server error), or cancelled
        (`POST /v1/responses/{id}/cancel` sets the event the chat call watches as it would a disconnect)."""
        serving.check_model(chat.model)  # (the chat call's other refusals come back as the response's error)
        obj, cancel = responses.queued(req, serving.model_name), asyncio.Event()
        store.keep(req, history, obj, cancel=cancel)

        async def work() -> None:
            store.finish(obj["id"], {**obj, "status": "in_progress"})
            try:
                result = await serving.chat(chat, cancel.wait)
            except ClientDisconnected:
                return  # cancelled: the store already says so
            except APIError as e:
                error = {"code": e.code or e.type, "message": e.message}
            except Exception as e:  # noqa: BLE001 - the client reads it as the response's error
                log.exception("background response %s failed", obj["id"])
                error = {"code": "server_error", "message": f"Internal server error ({type(e).__name__})."}
            else:
                store.finish(obj["id"], responses.from_chat(req, result, think_end, True, base=obj))
                return
            store.finish(obj["id"], {**obj, "status": "failed", "error": error})

        task = asyncio.ensure_future(work())
        tasks.add(task)
        task.add_done_callback(tasks.discard)
        return obj

    tasks: set[asyncio.Future] = set()  # the background responses' work, referenced until done

    @app.post("/v1/responses/{response_id}/cancel", dependencies=guarded)
    async def cancel_response(response_id: str):
        return JSONResponse(store.cancel(response_id))

    @app.get("/v1/responses/{response_id}", dependencies=guarded)
    async def get_response(response_id: str):
        return JSONResponse(store.get(response_id).response)

    @app.delete("/v1/responses/{response_id}", dependencies=guarded)
    async def delete_response(response_id: str):
        return JSONResponse(store.delete(response_id))

    @app.get("/v1/responses/{response_id}/input_items", dependencies=guarded)
    async def response_input_items(response_id: str, request: Request):
        q = request.query_params
        return JSONResponse(store.input_items(response_id, q.get("limit"), q.get("order"), q.get("after")))

    @app.get("/v1/models", dependencies=guarded)
    async def models():
        return reply(serving.models())

    @app.post("/tokenize", dependencies=guarded)
    async def tokenize(request: Request):
        return reply(await serving.tokenize(_parse_tokenize(await request.body())))

    @app.post("/detokenize", dependencies=guarded)
    async def detokenize(request: Request):
        return reply(await serving.detokenize(_parse(P.DetokenizeRequest, await request.body())))

    @app.post("/reset_prefix_cache", dependencies=guarded)
    async def reset_prefix_cache():
        return JSONResponse(serving.reset_prompt_cache())

    @app.get("/health")
    async def health():
        return JSONResponse(serving.health())

    @app.get("/metrics")
    async def metrics():
        return Response(serving.metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/version")
    async def version():
        from importlib.metadata import PackageNotFoundError, version as dist_version
        try:
            return JSONResponse({"version": dist_version("qwen-jax")})
        except PackageNotFoundError:
            return JSONResponse({"version": "unknown"})

    @app.exception_handler(APIError)
    async def api_error(request: Request, e: APIError):
        # Anthropic's routes answer in Anthropic's shape
        body = anthropic.error_body(e) if request.url.path.startswith("/v1/messages") else e.body()
        return JSONResponse(body, status_code=e.status, headers=e.headers)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException):
        if e.status_code == 404:
            message, code = f"Invalid URL ({request.method} {request.url.path})", "not_found"
        elif e.status_code == 405:
            message, code = f"Method {request.method} is not allowed on {request.url.path}", "method_not_allowed"
        else:
            message, code = str(e.detail), None
        kind = "invalid_request_error" if e.status_code < 500 else "server_error"
        return JSONResponse(error_body(message, type=kind, code=code), status_code=e.status_code,
                            headers=getattr(e, "headers", None))

    @app.exception_handler(BodyTooLarge)
    async def too_large(request: Request, e: BodyTooLarge):
        return JSONResponse(_too_large_body(max_body_bytes), status_code=413)

    @app.exception_handler(ClientDisconnected)
    async def client_gone(request: Request, e: ClientDisconnected):
        # Nobody reads this; 499 (nginx's "client closed request") keeps access logs honest.
        return Response(status_code=499)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, e: Exception):
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return JSONResponse(error_body(f"Internal server error ({type(e).__name__}).", type="server_error",
                                       code="internal_error"), status_code=500)

    app.add_middleware(BodyLimit, max_bytes=max_body_bytes)
    return app
