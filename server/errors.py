"""Errors in the OpenAI shape, `{"error": {"message", "type", "param", "code"}}`, raised anywhere in the server
and turned into a response by the handlers in app.py.

The `type` values follow OpenAI's own API (`invalid_request_error` for every 4xx a client caused, `server_error`
otherwise) rather than vLLM's exception class names, because the official SDKs map on the HTTP status and show
`type`/`code` to users; `code` carries the machine-readable reason (`context_length_exceeded`, `invalid_api_key`,
`model_not_found`, ...).
"""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError


class APIError(Exception):
    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return error_body(self.message, type=self.type, param=self.param, code=self.code)


def error_body(message: str, *, type: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def bad_request(message: str, *, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def _loc(loc: tuple[Any, ...]) -> str:
    """('messages', 0, 'content') -> 'messages[0].content', the way OpenAI names nested params."""
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else ("." if out else "") + str(part)
    return out


def from_validation_error(e: ValidationError) -> APIError:
    """One 400 for a request body pydantic refused: the first problem, named by its field, plus a count of the
    other fields that are wrong."""
    errors = e.errors(include_url=False)
    first = errors[0]
    kind = first.get("type", "")
    cause = first.get("ctx", {}).get("error")
    if kind == "json_invalid":
        return bad_request(f"The request body is not valid JSON: {cause or first['msg']}")
    if kind == "model_type" and not first.get("loc"):
        return bad_request("The request body must be a JSON object.")
    param = _loc(tuple(first.get("loc", ()))) or None
    if kind == "value_error" and isinstance(cause, ValueError):
        # Our own validators' messages are written for users; pydantic's "Value error, " prefix is noise.
        param = getattr(cause, "param", None) or param
        message = str(cause)
        if param and not message.startswith(param):
            message = f"{param}: {message}"
    elif kind == "extra_forbidden":
        message = f"Unrecognized request argument supplied: {param}"
    else:
        message = f"{param}: {first['msg']}" if param else first["msg"]
        if kind.endswith("_type") and "input" in first:
            message += f" (got {_short(first['input'])})"
    others = {_loc(tuple(err.get("loc", ()))) for err in errors[1:]} - {param}
    if others:
        message += f" (and {len(others)} more invalid field{'s' if len(others) > 1 else ''})"
    return bad_request(message, param=param)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
