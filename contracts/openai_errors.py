"""OpenAI's error body, which its clients parse into their exceptions: the gateway's `/v1` router
and every entry function answer errors in it."""
from __future__ import annotations


def error_body(message: str, status: int, param: str | None = None, code: str | None = None) -> dict:
    kind = {401: "authentication_error", 404: "not_found_error", 429: "rate_limit_error"}.get(
        status, "invalid_request_error" if status < 500 else "server_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}
