"""The dashboard's FastAPI app: read-only JSON endpoints over a :class:`RunSource`,
``/metrics`` for Prometheus, and the single page that draws them.

Requests never fail with a 500 because of what a client sent: parameters are validated
(422 with a one-line ``detail`` naming the parameter and the fix), unknown ids are 404s,
and an unexpected error inside a handler becomes a 500 JSON answer while the server goes
on. The only endpoint that changes anything (``POST /api/actions/{action}``, e.g.
pausing a simulation) needs the token the app was created with; without one it is off.

The OpenAPI pages ``/docs`` (Swagger UI) and ``/redoc`` load their JavaScript, CSS and
icon from the ``fastapi-offline`` package (served under ``/static-offline-docs/``), not
from a CDN, and ReDoc's Google fonts are off: they work without internet access. Their
Content-Security-Policy keeps the browser on this server: ReDoc's bundle would otherwise
fetch its "API docs by Redocly" logo from Redocly's CDN.
"""

from __future__ import annotations

import hmac
import logging
from importlib import resources
from typing import Annotated

from fastapi import FastAPI, Header, HTTPException, Path, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse, Response
from fastapi_offline import FastAPIOffline
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from staleflow.dashboard import prometheus, schemas
from staleflow.dashboard.interface import ActionNotSupported, RunSource
from staleflow.runfolder.step_record import StepRecord

logger = logging.getLogger(__name__)

MAX_LIMIT = 10_000
_STATIC = {
    "app.js": "text/javascript; charset=utf-8",
    "style.css": "text/css; charset=utf-8",
}
_ERRORS = {
    400: {"model": schemas.ErrorOut},
    401: {"model": schemas.ErrorOut},
    403: {"model": schemas.ErrorOut},
    404: {"model": schemas.ErrorOut},
    422: {"model": schemas.ErrorOut},
}

DOCS_PATHS = ("/docs", "/redoc")
# Scripts, styles, images, fonts and requests of the docs pages come from this server
# only; inline code and eval stay allowed (Swagger UI's inline start-up script, ReDoc's
# styled-components and schema compiler), blob: for ReDoc's search worker.
DOCS_CSP = (
    "default-src 'self'; script-src 'self' 'unsafe-inline' 'unsafe-eval' blob:; "
    "style-src 'self' 'unsafe-inline'; img-src 'self' data:; font-src 'self' data:; "
    "worker-src 'self' blob:; connect-src 'self'; object-src 'none'; base-uri 'self'"
)

Since = Annotated[int, Query(ge=0, description="first item to return (a previous `next`)")]
Limit = Annotated[int, Query(ge=1, le=MAX_LIMIT, description=f"at most this many (1..{MAX_LIMIT})")]


def create_app(source: RunSource, *, token: str | None = None) -> FastAPI:
    """The dashboard over ``source``. ``token``: enables the actions of
    ``source.info().actions``, each request carrying ``Authorization: Bearer <token>``."""
    app = FastAPIOffline(
        title="StaleFlow dashboard",
        description="Live view of a StaleFlow run: staleness buffers, rollout instances, "
        "trajectory server, parameter server and per-step metrics.",
        version="1",
        responses=_ERRORS,
    )
    _install_error_handlers(app)
    app.add_middleware(_SameOriginDocs)

    # -- the page ----------------------------------------------------------------------

    @app.get("/", response_class=HTMLResponse, include_in_schema=False)
    def index() -> HTMLResponse:
        return HTMLResponse(_static_text("index.html"))

    @app.get("/static/{name}", include_in_schema=False)
    def static(name: str) -> Response:
        if name not in _STATIC:
            raise HTTPException(404, f"no static file {name!r}: the page uses {sorted(_STATIC)}")
        return Response(_static_text(name), media_type=_STATIC[name])

    @app.get("/healthz", include_in_schema=False)
    def healthz() -> dict[str, bool]:
        return {"ok": True}

    # -- JSON --------------------------------------------------------------------------

    @app.get("/api/run", response_model=schemas.RunOut, summary="The run and its progress")
    def run() -> schemas.RunOut:
        return schemas.run_out(source.info(), source.live())

    @app.get(
        "/api/overview",
        response_model=schemas.OverviewOut,
        summary="Run, buffers, instances, TS and PS in one read (what the page polls)",
    )
    def overview() -> schemas.OverviewOut:
        info, live = source.info(), source.live()
        return schemas.OverviewOut(
            run=schemas.run_out(info, live),
            buffers=schemas.buffers_out(live),
            instances=schemas.instances_out(info, live),
            ts=schemas.ts_out(live.ts),
            ps=schemas.ps_out(source.ps()),
        )

    @app.get(
        "/api/buffers",
        response_model=schemas.BuffersOut,
        summary="Staleness buffers V_buf = version .. version + eta with their entries (§4.2)",
    )
    def buffers() -> schemas.BuffersOut:
        return schemas.buffers_out(source.live())

    @app.get(
        "/api/instances",
        response_model=schemas.InstancesOut,
        summary="Rollout instances: snapshot fields, version, estimated and measured throughput",
    )
    def instances(
        trajectories: Annotated[
            bool, Query(description="include the trajectory lists of each snapshot")
        ] = False,
    ) -> schemas.InstancesOut:
        return schemas.instances_out(source.info(), source.live(), trajectories)

    @app.get(
        "/api/instances/{inst}",
        response_model=schemas.InstanceOut,
        summary="One rollout instance, with its trajectories",
    )
    def instance(
        inst: Annotated[int, Path(ge=0, description="instance id")],
    ) -> schemas.InstanceOut:
        info, live = source.info(), source.live()
        for d in live.instances:
            if d.inst == inst:
                return schemas.instance_out(d, info.cost_model, trajectories=True)
        known = ", ".join(str(d.inst) for d in live.instances) or "none yet"
        raise HTTPException(404, f"no instance {inst}: instances are {known}")

    @app.get(
        "/api/ts",
        response_model=schemas.TSOut,
        summary="Trajectory server: trajectories by state and by V_traj",
    )
    def ts() -> schemas.TSOut:
        return schemas.ts_out(source.live().ts)

    @app.get("/api/ps", response_model=schemas.PSOut, summary="Parameter server versions")
    def ps() -> schemas.PSOut:
        return schemas.ps_out(source.ps())

    @app.get(
        "/api/metrics",
        response_model=schemas.RecordsOut,
        summary="Per-step metric records (throughput, reward, staleness, idle ratios)",
    )
    def metrics(
        since: Since = 0,
        limit: Limit = 1000,
        prefix: Annotated[
            str, Query(max_length=200, description="only keys starting with this, e.g. throughput/")
        ] = "",
    ) -> schemas.RecordsOut:
        return schemas.records_out(source.records(since, limit), prefix)

    @app.get(
        "/api/staleness",
        response_model=schemas.StalenessOut,
        summary="Staleness distribution of each consumed buffer (Figure 18)",
    )
    def staleness(since: Since = 0, limit: Limit = 1000) -> schemas.StalenessOut:
        return schemas.staleness_out(source.records(since, limit))

    @app.get(
        "/api/load",
        response_model=schemas.LoadOut,
        summary="Per-instance load over time (Figure 17)",
    )
    def load(since: Since = 0, limit: Limit = 5000) -> schemas.LoadOut:
        return schemas.load_out(source.load(since, limit))

    @app.get(
        "/api/events",
        response_model=schemas.EventsOut,
        summary="Pull, Push and training-step markers, and recoveries",
    )
    def events(
        since: Since = 0,
        limit: Limit = 5000,
        kind: Annotated[
            list[str] | None,
            Query(description="pull, push, step or recovery; repeat for several"),
        ] = None,
    ) -> schemas.EventsOut:
        kinds = kind or []
        bad = [k for k in kinds if k not in ("pull", "push", "step", "recovery")]
        if bad:
            raise HTTPException(
                422, f"kind={bad[0]!r} is unknown: use pull, push, step or recovery"
            )
        return schemas.events_out(source.events(since, limit), kinds)

    @app.get(
        "/metrics",
        response_class=PlainTextResponse,
        summary="Prometheus text exposition of the current state and the last step",
    )
    def metrics_text() -> Response:
        text = prometheus.render(source.info(), source.live(), source.ps(), _last_record(source))
        return Response(text, media_type=prometheus.CONTENT_TYPE)

    # -- the one kind of write ----------------------------------------------------------

    @app.post(
        "/api/actions/{action}",
        response_model=schemas.ActionOut,
        summary="Act on the run (e.g. pause / resume a simulation); needs the token",
    )
    def act(
        action: Annotated[str, Path(max_length=64)],
        authorization: Annotated[str | None, Header()] = None,
    ) -> schemas.ActionOut:
        if token is None:
            raise HTTPException(
                403, "actions are off: start the dashboard with --token to enable them"
            )
        _check_token(authorization, token)
        actions = source.info().actions
        if action not in actions:
            raise HTTPException(
                400, f"unknown action {action!r}: this run accepts {list(actions) or 'none'}"
            )
        try:
            result = source.act(action)
        except ActionNotSupported as exc:
            raise HTTPException(400, str(exc)) from exc
        logger.info("dashboard action %s: %s", action, result)
        return schemas.ActionOut(action=action, result=result)

    return app


class _SameOriginDocs:
    """Adds :data:`DOCS_CSP` to the responses of :data:`DOCS_PATHS` (plain ASGI, so the
    other endpoints pay one comparison)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "") if scope["type"] == "http" else ""
        root = scope.get("root_path", "")
        if path not in DOCS_PATHS and path.removeprefix(root) not in DOCS_PATHS:
            await self.app(scope, receive, send)
            return

        async def send_with_csp(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = [
                    *message.get("headers", []),
                    (b"content-security-policy", DOCS_CSP.encode()),
                ]
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, send_with_csp)


def _check_token(authorization: str | None, token: str) -> None:
    """401 unless ``authorization`` is ``Bearer <token>`` (the scheme's case aside, RFC
    7235): a bare token or another scheme is refused. Compared as bytes in constant time;
    a header value arrives decoded as latin-1, so encoding it back gives the bytes the
    client sent, which for a non-ASCII token are its UTF-8."""
    challenge = {"WWW-Authenticate": "Bearer"}
    if not authorization:
        raise HTTPException(
            401, "missing token: send 'Authorization: Bearer <token>'", headers=challenge
        )
    scheme, _, given = authorization.partition(" ")
    if scheme.lower() != "bearer" or not given:
        raise HTTPException(
            401,
            "malformed Authorization header: send 'Authorization: Bearer <token>'",
            headers=challenge,
        )
    try:
        sent = given.encode("latin-1")
    except UnicodeEncodeError:  # not from the wire (headers are latin-1): take it as text
        sent = given.encode("utf-8")
    if not hmac.compare_digest(sent, token.encode("utf-8")):
        raise HTTPException(
            401, "wrong token: send 'Authorization: Bearer <token>'", headers=challenge
        )


def _last_record(source: RunSource) -> StepRecord | None:
    total = source.records(0, 1).total  # a one-item page tells how many there are
    items = source.records(max(total - 1, 0), 1).items
    return items[0] if items else None


def _static_text(name: str) -> str:
    return resources.files("staleflow.dashboard").joinpath("static", name).read_text("utf-8")


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def bad_request(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        first = errors[0] if errors else {}
        where = ".".join(str(p) for p in first.get("loc", ()) if p not in ("query", "path"))
        got = first.get("input")
        message = f"{where or 'request'}: {first.get('msg', 'invalid value')}"
        if got is not None and not isinstance(got, dict):
            message += f" (got {got!r})"
        return JSONResponse(status_code=422, content={"detail": message})

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return JSONResponse(
            status_code=exc.status_code,
            content={"detail": str(exc.detail)},
            headers=getattr(exc, "headers", None),
        )

    @app.exception_handler(Exception)
    async def internal(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("dashboard: %s %s failed", request.method, request.url.path)
        return JSONResponse(
            status_code=500,
            content={"detail": f"internal error ({type(exc).__name__}): see the server log"},
        )
