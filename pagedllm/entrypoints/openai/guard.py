"""GuardMiddleware: what every request passes before the app, and the one log line after it.

Before: the API key (constant-time compare), the body read in full under a size limit (413) and a
deadline (408: a client trickling its body, or sending less than its Content-Length, must not hold
a connection and a task forever; uvicorn has no body timeout). After: one log line per request,
saying so when the client went away before the response was complete. Around: an exception out of
the app answers a clean 500 and keeps the connection usable (uvicorn would drop it).
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pagedllm.entrypoints.openai.defaults import DEFAULT_MAX_REQUEST_BYTES, DEFAULT_TIMEOUT_BODY
from pagedllm.entrypoints.openai.serving_base import APIError, bad_request

logger = logging.getLogger("pagedllm.api")

# Paths anyone may call even when an API key is set (probes and scrapers).
OPEN_PATHS = {"/health", "/metrics", "/version", "/ping"}
_CLOSE = [(b"connection", b"close")]
# A refused body is read to its end (and dropped) before the 413, up to this much: a client that
# writes its whole body before reading would otherwise meet a reset connection, not the answer
# (closing a socket with unread input resets it). Beyond this, or past the body's deadline, the
# 413 goes out at once and the connection closes.
MAX_DRAIN_BYTES = 64 << 20


def route_path(scope: Scope) -> str:
    """The request's path as the routes see it: without the ASGI root_path (``--root-path``) in front."""
    path, root = scope["path"], scope.get("root_path", "")
    return path[len(root) :] if root and path.startswith(root) else path


class GuardMiddleware:
    def __init__(
        self,
        app: ASGIApp,
        api_key: str | None,
        max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
        log_requests: bool = True,
        timeout_body: float = DEFAULT_TIMEOUT_BODY,
    ) -> None:
        self.app = app
        self.expected_key = api_key.encode() if api_key else None
        self.max_request_bytes = max_request_bytes
        self.log_requests = log_requests
        self.timeout_body = timeout_body

    def _authorized(self, scope: Scope) -> bool:
        if self.expected_key is None or route_path(scope) in OPEN_PATHS or scope["method"] == "OPTIONS":
            return True
        provided = b""
        for name, value in scope.get("headers", []):
            if name == b"authorization":
                provided = value
                break
        # RFC 7235: the scheme is case-insensitive ("bearer KEY" is "Bearer KEY"), then one or more spaces.
        parts = provided.split(maxsplit=1)
        if len(parts) != 2 or parts[0].lower() != b"bearer":
            return False
        return hmac.compare_digest(parts[1].strip(), self.expected_key)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        state: dict[str, Any] = {"status": None, "complete": False, "logged": False}
        log_info = scope.setdefault("pagedllm.log", {})

        def write_log() -> None:
            if state["logged"] or not self.log_requests:
                return
            state["logged"] = True
            client = scope.get("client")
            where = f"{client[0]}:{client[1]}" if client else "-"
            extras = " ".join(f"{k}={v}" for k, v in log_info.items() if k != "disconnected")
            status = state["status"] or "-"
            if log_info.get("disconnected") or (state["status"] is not None and not state["complete"]):
                # A stream the client cancelled is not a 200 that was delivered.
                status = f"{status} (client disconnected)"
            logger.info('%s "%s %s" %s %.3fs %s', where, scope["method"], scope["path"], status,
                        time.perf_counter() - start, extras)

        async def send_and_log(message: Message) -> None:
            if message["type"] == "http.response.start":
                state["status"] = message["status"]
            await send(message)
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                state["complete"] = True
                write_log()

        try:
            if not self._authorized(scope):
                error = APIError(401, "Invalid or missing API key: send 'Authorization: Bearer <key>'.",
                                 code="invalid_api_key")
                await error.response()(scope, receive, send_and_log)
                return
            body_receive = await self._read_body(scope, receive, send_and_log)
            if body_receive is None:
                return
            await self.app(scope, body_receive, send_and_log)
        except Exception as exc:  # noqa: BLE001 - answer it here, so the connection stays usable
            logger.error("unhandled error on %s %s", scope["method"], scope["path"], exc_info=exc)
            if state["status"] is None:
                error = APIError(500, "Internal server error; the server log has the details.",
                                 err_type="server_error")
                await error.response()(scope, receive, send_and_log)
            # A response already under way cannot be repaired; uvicorn closes the connection.
        finally:
            if state["status"] is None:
                log_info.setdefault("disconnected", True)
            write_log()

    async def _read_body(self, scope: Scope, receive: Receive, send: Send) -> Receive | None:
        """Buffer the body (at most max_request_bytes, within timeout_body); None if answered already."""
        too_large = APIError(
            413, f"The request body is larger than the server's limit of {self.max_request_bytes} bytes.",
            code="request_too_large", headers=_CLOSE,
        )
        for name, value in scope.get("headers", []):
            if name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    error = bad_request("Invalid Content-Length header.")
                    error.headers = _CLOSE
                    await error.response()(scope, receive, send)
                    return None
                if declared > self.max_request_bytes:
                    # With Expect: 100-continue the body has not been sent: answer at once, it never will be.
                    if declared - self.max_request_bytes <= MAX_DRAIN_BYTES and not _expects_continue(scope):
                        await self._drain(receive, time.monotonic() + self.timeout_body)
                    await too_large.response()(scope, receive, send)
                    return None
        chunks: list[bytes] = []
        total = 0
        deadline = time.monotonic() + self.timeout_body
        while True:
            try:
                message = await asyncio.wait_for(receive(), timeout=max(deadline - time.monotonic(), 0.0))
            except TimeoutError:
                timed_out = APIError(
                    408, f"The request body did not arrive within {self.timeout_body:g} s (or was shorter than "
                    "its Content-Length); send the whole body promptly.", code="request_timeout", headers=_CLOSE,
                )
                scope.setdefault("pagedllm.log", {})["error"] = "body timeout"
                await timed_out.response()(scope, receive, send)
                return None
            if message["type"] == "http.disconnect":
                return None
            body = message.get("body", b"")
            total += len(body)
            if total > self.max_request_bytes:
                if message.get("more_body", False):
                    await self._drain(receive, deadline)
                await too_large.response()(scope, receive, send)
                return None
            chunks.append(body)
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()

        return replay

    @staticmethod
    async def _drain(receive: Receive, deadline: float) -> None:
        """Read and drop the rest of a refused body: up to MAX_DRAIN_BYTES, until ``deadline``."""
        drained = 0
        while drained <= MAX_DRAIN_BYTES:
            try:
                message = await asyncio.wait_for(receive(), timeout=max(deadline - time.monotonic(), 0.0))
            except TimeoutError:
                return
            if message["type"] != "http.request":
                return
            drained += len(message.get("body", b""))
            if not message.get("more_body", False):
                return


def _expects_continue(scope: Scope) -> bool:
    return any(name == b"expect" and value.lower() == b"100-continue" for name, value in scope.get("headers", []))
