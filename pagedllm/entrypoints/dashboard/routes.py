"""The dashboard's HTTP surface: the page, the JSON snapshot and the SSE stream.

    GET /dashboard          the page (HTML, CSS and JS inlined: one self-contained document)
    GET /dashboard/state    one snapshot, JSON (docs/guides/dashboard.md describes it)
    GET /dashboard/events   Server-Sent Events: ``history`` once, then ``state`` a few times a second
    GET /dashboard/replicas the views and each replica's live state (data-parallel replicas; empty otherwise)

With replicas, ``?replica=all`` (the default: every live replica together) or ``?replica=N`` on
/state and /events picks the view; a name that is not a view is a 400.

With ``--api-key`` these routes need the key like every other route. A browser cannot put a
header on a page load or on an EventSource, so ``?key=KEY`` is accepted on /dashboard paths
only: DashboardKeyMiddleware turns it into the ``Authorization`` header before the server's
GuardMiddleware checks it (constant-time, as for any route). The page forwards the key it was
opened with to its own requests.
"""

from __future__ import annotations

import json
from functools import cache
from importlib import resources
from typing import Any
from urllib.parse import parse_qs

from fastapi import FastAPI
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from pagedllm.entrypoints.dashboard.hub import DashboardHub
from pagedllm.entrypoints.dashboard.views import DashboardViews, UnknownViewError
from pagedllm.entrypoints.openai.guard import route_path
from pagedllm.entrypoints.openai.serving_base import bad_request

PREFIX = "/dashboard"


class DashboardKeyMiddleware:
    """``?key=`` on a /dashboard path becomes ``Authorization: Bearer <key>`` (when none is sent).

    Add it after GuardMiddleware so that it runs before it (Starlette runs the last added first).
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and route_path(scope).startswith(PREFIX) and scope.get("query_string"):
            keys = parse_qs(scope["query_string"].decode("latin-1")).get("key")
            headers = scope.get("headers", [])
            if keys and not any(name == b"authorization" for name, _ in headers):
                # UTF-8, as the guard encodes the server's key: any key text (even one a bad %-escape made) encodes,
                # and a wrong one is then the guard's 401.
                scope = dict(scope, headers=[*headers, (b"authorization", f"Bearer {keys[0]}".encode())])
        await self.app(scope, receive, send)


@cache
def _asset(name: str) -> str:
    return resources.files("pagedllm.entrypoints.dashboard").joinpath("static", name).read_text(encoding="utf-8")


def render_page(config: dict[str, Any]) -> str:
    """The page with its stylesheet, script and settings inlined (nothing else is fetched)."""
    # "</" inside inlined text would end the <script> element early.
    config_json = json.dumps(config).replace("</", "<\\/")
    return (
        _asset("dashboard.html")
        .replace("/*__DASHBOARD_CSS__*/", _asset("dashboard.css"))
        .replace("/*__DASHBOARD_CONFIG__*/", config_json)
        .replace("/*__DASHBOARD_JS__*/", _asset("dashboard.js").replace("</", "<\\/"))
    )


def add_dashboard_routes(app: FastAPI, views: DashboardHub | DashboardViews, title: str) -> None:
    """Register the dashboard on ``app`` (call after the app's GuardMiddleware is added).

    ``views``: one hub, or the views of replicas (``?replica=all|0|1...`` picks one on /state and /events).
    """
    if isinstance(views, DashboardHub):
        views = DashboardViews.single(views)
    app.add_middleware(DashboardKeyMiddleware)
    app.state.dashboard_hub = views.default_hub
    app.state.dashboard_views = views
    page = render_page({"title": title, "interval_s": views.default_hub.interval_s,
                        "replicas": views.replica_states is not None, "default_view": views.default})

    def no_such_view(exc: UnknownViewError) -> JSONResponse:
        return bad_request(str(exc), "replica").response()

    @app.get(PREFIX, include_in_schema=False)
    async def dashboard_page() -> HTMLResponse:
        # no-store: the page carries the key in its URL; don't keep copies of it around.
        return HTMLResponse(page, headers={"Cache-Control": "no-store"})

    @app.get(PREFIX + "/state")
    async def dashboard_state(replica: str | None = None) -> JSONResponse:
        try:
            hub = views.hub(replica)
        except UnknownViewError as exc:
            return no_such_view(exc)
        return JSONResponse(await hub.state(), headers={"Cache-Control": "no-store"})

    @app.get(PREFIX + "/events")
    async def dashboard_events(replica: str | None = None) -> Response:
        try:
            hub = views.hub(replica)
        except UnknownViewError as exc:
            return no_such_view(exc)
        return StreamingResponse(
            hub.events(), media_type="text/event-stream",
            # X-Accel-Buffering: a reverse proxy (nginx) must pass each event on at once.
            headers={"Cache-Control": "no-store", "X-Accel-Buffering": "no"},
        )

    @app.get(PREFIX + "/replicas")
    async def dashboard_replicas() -> JSONResponse:
        return JSONResponse(views.describe(), headers={"Cache-Control": "no-store"})
