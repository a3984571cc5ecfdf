"""Connection limits uvicorn lacks, and binding the port before the model loads.

uvicorn closes idle keep-alive connections (``timeout_keep_alive``) and caps header size (h11's
``max_incomplete_event_size``, 16 KiB: a 400 beyond), but it waits forever for the headers of a
request: a connection that never sends any, or trickles them a byte at a time (slow loris), holds
its slot for good. GuardedH11Protocol arms a timer whenever a connection waits for a request's
headers (from the moment it opens, and again after each response) and closes it when the timer
fires, with a 408 if part of a request had arrived. The body has its own deadline in
GuardMiddleware, which can answer it properly.

It also replaces uvicorn's ``limit_concurrency`` check (a plain-text 503) with the same rule
answered as OpenAI-shaped JSON: beyond ``limit_concurrency`` open connections or requests in
flight, a request gets a 503 with ``Connection: close`` and ``Retry-After``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
from typing import Any

import h11
import uvicorn
from starlette.types import ASGIApp, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

from pagedllm.entrypoints.openai.defaults import (
    DEFAULT_LIMIT_CONCURRENCY,
    DEFAULT_TIMEOUT_HEADERS,
    DEFAULT_TIMEOUT_KEEP_ALIVE,
)

logger = logging.getLogger("pagedllm.api")

# h11 cannot send a response before it has parsed a request: the 408 goes out as raw bytes.
_REQUEST_TIMEOUT = (
    b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\nconnection: close\r\ncontent-length: %d\r\n"
    b"\r\n%s"
)


class PortInUseError(OSError):
    """The address cannot be bound (another server on the port, or no permission)."""


def bind_socket(host: str, port: int, backlog: int = 2048) -> socket.socket:
    """A listening socket on host:port, made before the model loads so a busy port fails at once.

    It listens right away: on Linux SO_REUSEADDR lets two sockets bind one port until one of them
    listens, so only a listening socket really holds the port while the model loads.
    """
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as exc:
        raise PortInUseError(f"Cannot resolve --host {host!r}: {exc.strerror}.") from None
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
        sock.listen(backlog)
    except OSError as exc:
        sock.close()
        raise PortInUseError(
            f"Cannot listen on {host}:{port}: {exc.strerror}. Is another server using this port? "
            "Stop it or choose another --port."
        ) from None
    sock.set_inheritable(True)
    return sock


def is_serving_rank() -> bool:
    """False in torchrun's ranks 1..N-1, which only compute: they must not take the port."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ:
        return int(os.environ["RANK"]) == 0
    return True


def _error_body(message: str, err_type: str, code: str) -> bytes:
    return json.dumps({"error": {"message": message, "type": err_type, "param": None, "code": code}}).encode()


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol plus a deadline on each request's headers and a JSON 503 cap.

    ``server_config`` makes a subclass with the limits as class attributes (uvicorn builds the
    protocol from a class).
    """

    timeout_headers: float = DEFAULT_TIMEOUT_HEADERS
    max_concurrency: int | None = DEFAULT_LIMIT_CONCURRENCY

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.limit_concurrency = None  # uvicorn's own check answers plain text; _capped answers JSON
        self.app = self._capped(self.app)
        self._headers_timer: asyncio.TimerHandle | None = None
        self._request_bytes = False  # has part of the next request arrived?

    # ------------------------------------------------------------------ the headers deadline

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_headers_timer()

    def data_received(self, data: bytes) -> None:
        cycle = self.cycle
        self._request_bytes = True
        super().data_received(data)
        if self.cycle is not cycle:  # a request's headers are complete: its body has GuardMiddleware's deadline
            self._cancel_headers_timer()

    def on_response_complete(self) -> None:
        cycle = self.cycle
        self._request_bytes = False
        super().on_response_complete()
        if self.cycle is cycle and not self.transport.is_closing():  # not already on a pipelined request
            self._arm_headers_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_headers_timer()
        super().connection_lost(exc)

    def _arm_headers_timer(self) -> None:
        self._cancel_headers_timer()
        self._headers_timer = self.loop.call_later(self.timeout_headers, self._headers_timed_out)

    def _cancel_headers_timer(self) -> None:
        if self._headers_timer is not None:
            self._headers_timer.cancel()
            self._headers_timer = None

    def _headers_timed_out(self) -> None:
        self._headers_timer = None
        if self.transport.is_closing():
            return
        if self._request_bytes and self.conn.their_state is h11.IDLE:
            body = _error_body(
                f"The request headers did not arrive within {self.timeout_headers:g} s.", "invalid_request_error",
                "request_timeout",
            )
            self.transport.write(_REQUEST_TIMEOUT % (len(body), body))
            logger.info("%s: closed, request headers not complete within %gs", _peer(self.client),
                        self.timeout_headers)
        self.transport.close()

    # ------------------------------------------------------------------ the concurrency cap

    def _capped(self, app: ASGIApp) -> ASGIApp:
        async def capped(scope: Scope, receive: Receive, send: Send) -> None:
            limit = self.max_concurrency
            # This request's task and connection are already counted.
            if scope["type"] == "http" and limit is not None and (
                len(self.connections) > limit or len(self.tasks) > limit
            ):
                logger.warning("%s: 503, over the limit of %d connections / requests in flight",
                               _peer(self.client), limit)
                body = _error_body(
                    f"The server is at its limit of {limit} open connections or requests in flight; retry shortly.",
                    "service_unavailable", "too_many_connections",
                )
                headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                           (b"connection", b"close"), (b"retry-after", b"1")]
                await send({"type": "http.response.start", "status": 503, "headers": headers})
                await send({"type": "http.response.body", "body": body, "more_body": False})
                return
            await app(scope, receive, send)

        return capped


def _peer(client: tuple[str, int] | None) -> str:
    return f"{client[0]}:{client[1]}" if client else "-"


def server_config(
    app: ASGIApp,
    *,
    timeout_keep_alive: float = DEFAULT_TIMEOUT_KEEP_ALIVE,
    timeout_headers: float = DEFAULT_TIMEOUT_HEADERS,
    limit_concurrency: int | None = DEFAULT_LIMIT_CONCURRENCY,
    **uvicorn_kwargs: Any,
) -> uvicorn.Config:
    """uvicorn.Config serving ``app`` over GuardedH11Protocol with these limits (and uvicorn's own kwargs)."""
    protocol = type(
        "GuardedH11Protocol",
        (GuardedH11Protocol,),
        {"timeout_headers": timeout_headers, "max_concurrency": limit_concurrency},
    )
    return uvicorn.Config(app, http=protocol, timeout_keep_alive=timeout_keep_alive, **uvicorn_kwargs)  # type: ignore[arg-type]
