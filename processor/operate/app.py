"""The operator view's ASGI app: pages at ``/``, JSON at ``/api/v1/``, assets at ``/static/``.

Read-only. The pages are one HTML shell and one script (package data, nothing from the
network) that render what the API answers; the API reads the read model
(processor.state.views) and the process's own metrics. Every answer carries a
Content-Security-Policy that allows only this origin's script and style and forbids
framing. With ``ui.auth.bearer_token`` set, every route (pages, assets and API)
needs ``authorization: Bearer <token>``, compared as the receivers compare it.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from importlib import resources
from typing import Any, Final

import orjson
from fastapi import FastAPI, Request, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from processor.config import UiConfig
from processor.evaluate.model import RuleSet
from processor.operate.pipeline_status import pipeline_status
from processor.receive.otlp_common import bearer_token_ok
from processor.state.views import MAX_OFFSET, MAX_PAGE, ViewStore, ViolationFilter
from processor.telemetry import Telemetry
from processor.violations import SEVERITIES

JSON: Final = "application/json"
CSP: Final = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; connect-src 'self';"
              " base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
SECURITY_HEADERS: Final = {
    "Content-Security-Policy": CSP,
    "X-Frame-Options": "DENY",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}
_ASSETS: Final = {"view.js": "text/javascript; charset=utf-8", "view.css": "text/css; charset=utf-8",
                  "favicon.svg": "image/svg+xml"}
_PAGE_SIZE: Final = 50
# Violations listed on a session page (its counts come from the session row).
_SESSION_VIOLATIONS: Final = 500


@dataclass(slots=True)
class ViewContext:
    """What the app reads: the read model, rules, metrics, and how the process is set up."""

    views: ViewStore
    rules: RuleSet
    telemetry: Telemetry
    setup: dict[str, Any] = field(default_factory=dict)
    ready: Callable[[], tuple[bool, str]] = lambda: (True, "")


def asset(name: str) -> str:
    return resources.files("processor.operate").joinpath("static", name).read_text(encoding="utf-8")


class _BadQuery(ValueError):
    pass


def _int_arg(request: Request, name: str, default: int, low: int, high: int) -> int:
    raw = request.query_params.get(name)
    if raw is None or raw == "":
        return default
    if not raw.isdigit() or not low <= int(raw) <= high:
        raise _BadQuery(f"query parameter {name} must be a whole number from {low} to {high}")
    return int(raw)


def _text_arg(request: Request, name: str) -> str:
    value = request.query_params.get(name, "")
    if len(value) > 512:
        raise _BadQuery(f"query parameter {name} is longer than 512 characters")
    return value


_PROBE_PATHS: Final = frozenset({"/healthz", "/readyz"})


def rules_json(rules: RuleSet) -> dict[str, dict[str, str]]:
    """Per rule: its name, severity and what to do about a finding, for span input and for action logs."""
    return {r.id: {"name": r.name, "severity": r.severity, "fix_spans": r.fix_for(True), "fix_logs": r.fix_for(False)}
            for r in rules.rules}


def build_app(cfg: UiConfig, ctx: ViewContext) -> FastAPI:
    app = FastAPI(docs_url=None, redoc_url=None, openapi_url=None)
    token = cfg.auth.bearer_token
    shell = asset("page.html").encode("utf-8")
    assets = {name: (asset(name).encode("utf-8"), media) for name, media in _ASSETS.items()}
    rules = rules_json(ctx.rules)

    @app.middleware("http")
    async def guard(request: Request, call_next: Callable[[Request], Awaitable[Response]]) -> Response:
        # The probes carry no token (a kubelet cannot read one from a Secret); they tell only
        # whether the process is alive and ready.
        probe = request.url.path in _PROBE_PATHS and request.method in ("GET", "HEAD")
        if token and not probe and not bearer_token_ok(token, request.headers.get("authorization")):
            response = Response(orjson.dumps({"error": "missing or wrong bearer token"}), 401, media_type=JSON,
                                headers={"WWW-Authenticate": "Bearer"})
        elif request.method not in ("GET", "HEAD"):
            response = Response(orjson.dumps({"error": "the view is read-only"}), 405, media_type=JSON,
                                headers={"Allow": "GET, HEAD"})
        else:
            try:
                response = await call_next(request)
            except _BadQuery as exc:
                response = Response(orjson.dumps({"error": str(exc)}), 400, media_type=JSON)
        response.headers.update(SECURITY_HEADERS)
        return response

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        return Response(orjson.dumps({"error": str(exc.detail)}), exc.status_code, media_type=JSON)

    @app.exception_handler(_BadQuery)
    async def bad_query(request: Request, exc: _BadQuery) -> Response:
        return Response(orjson.dumps({"error": str(exc)}), 400, media_type=JSON)

    def page() -> Response:
        return Response(shell, 200, media_type="text/html; charset=utf-8")

    @app.get("/")
    def waiting_page() -> Response:
        return page()

    @app.get("/violations")
    def violations_page() -> Response:
        return page()

    @app.get("/pipeline")
    def pipeline_page() -> Response:
        return page()

    @app.get("/sessions/{session_id:path}")
    def session_page(session_id: str) -> Response:
        return page()

    @app.get("/static/{name}")
    def static(name: str) -> Response:
        found = assets.get(name)
        if found is None:
            return Response(orjson.dumps({"error": "not found"}), 404, media_type=JSON)
        return Response(found[0], 200, media_type=found[1])

    @app.get("/favicon.ico")
    def favicon() -> Response:
        # Browsers ask for it whatever the page links: the view's icon, not a 404 in every console.
        body, media = assets["favicon.svg"]
        return Response(body, 200, media_type=media)

    @app.get("/healthz")
    def healthz() -> Response:
        return Response(orjson.dumps({"status": "alive"}), 200, media_type=JSON)

    @app.get("/readyz")
    def readyz() -> Response:
        # The process's readiness, on the view's port: a probe or a load balancer checking the
        # port it routes to gets the receivers' answer.
        ready, why = ctx.ready()
        body = {"status": "ready"} if ready else {"status": "not ready", "reason": why}
        return Response(orjson.dumps(body), 200 if ready else 503, media_type=JSON)

    @app.get("/api/v1/waiting")
    def api_waiting(request: Request) -> Response:
        limit = _int_arg(request, "limit", _PAGE_SIZE, 1, MAX_PAGE)
        offset = _int_arg(request, "offset", 0, 0, MAX_OFFSET)
        now_ns = time.time_ns()
        items, total = ctx.views.waiting(now_ns, limit, offset)
        # What an operator can do about a wait is what the wait rules' fixes say.
        return _json({"now_ns": now_ns, "total": total, "limit": limit, "offset": offset, "items": items,
                      "setup": ctx.setup, "rules": {k: v for k, v in rules.items() if k in ("DS106", "DS107")}})

    @app.get("/api/v1/violations")
    def api_violations(request: Request) -> Response:
        limit = _int_arg(request, "limit", _PAGE_SIZE, 1, MAX_PAGE)
        offset = _int_arg(request, "offset", 0, 0, MAX_OFFSET)
        severity = _text_arg(request, "severity")
        if severity and severity not in SEVERITIES:
            raise _BadQuery(f"query parameter severity must be one of {', '.join(SEVERITIES)}")
        where = ViolationFilter(rule=_text_arg(request, "rule"), severity=severity,
                                session_id=_text_arg(request, "session"))
        items = ctx.views.violations(where, limit, offset)
        # The counts answer the same filter as the list (by rule and severity: counts are not kept per session).
        counts = [c for c in ctx.views.rule_counts()
                  if (not where.rule or c["rule"] == where.rule) and (not severity or c["severity"] == severity)]
        return _json({"limit": limit, "offset": offset, "items": items, "counts": counts,
                      "rules": rules, "setup": ctx.setup})

    @app.get("/api/v1/sessions/{session_id:path}")
    def api_session(session_id: str) -> Response:
        if len(session_id) > 512:
            raise _BadQuery("a session id is at most 512 characters")
        summary = ctx.views.session(session_id)
        if summary is None:
            return Response(orjson.dumps({"error": "no such session in the view"}), 404, media_type=JSON)
        violations = ctx.views.violations(ViolationFilter(session_id=session_id), _SESSION_VIOLATIONS, 0)
        return _json({"now_ns": time.time_ns(), "session": summary, "actions": ctx.views.session_actions(session_id),
                      "violations": violations, "rules": rules, "setup": ctx.setup})

    @app.get("/api/v1/pipeline")
    def api_pipeline() -> Response:
        ready, why = ctx.ready()
        status = pipeline_status(ctx.telemetry)
        status.update(ready=ready, not_ready_reason=why, sessions_in_view=ctx.views.session_count(),
                      setup=ctx.setup)
        return _json(status)

    return app


def _json(body: dict[str, Any]) -> Response:
    return Response(orjson.dumps(body, default=str), 200, media_type=JSON)
