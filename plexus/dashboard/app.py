"""The dashboard's web app: static pages, a JSON API over one AdminClient, and a live event stream per job.

The dashboard acts with its admin kit's role for whoever reaches it, so every request needs this
process's random token (given once in the printed URL, then an HttpOnly SameSite=Strict cookie), the
Host header must name this machine (against DNS rebinding), and a POST must also carry the CSRF token
the page reads from /api/me and the dashboard's own Origin. Nothing the coordinator relays is ever
rendered as HTML (see views.py), and the Content-Security-Policy allows scripts from this origin only.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import threading
from dataclasses import dataclass, field
from pathlib import Path
from string import Template

import anyio
import grpc
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.middleware import Middleware
from starlette.middleware.trustedhost import TrustedHostMiddleware
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, RedirectResponse, Response, StreamingResponse
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from plexus.dashboard import views

STATIC = Path(__file__).parent / "static"
CSRF_HEADER = "X-Plexus-CSRF"
SECURITY_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
                               "connect-src 'self'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
}
# gRPC status -> HTTP status of the JSON error; any other code is 502 (the coordinator failed the call).
HTTP_STATUS = {grpc.StatusCode.NOT_FOUND: 404, grpc.StatusCode.PERMISSION_DENIED: 403,
               grpc.StatusCode.UNAUTHENTICATED: 403, grpc.StatusCode.UNAVAILABLE: 503,
               grpc.StatusCode.INVALID_ARGUMENT: 400, grpc.StatusCode.FAILED_PRECONDITION: 409,
               grpc.StatusCode.DEADLINE_EXCEEDED: 504}
# path -> (page, title, what its <head> loads beyond dashboard.css and dashboard.js): each page is layout.html
# around static/PAGE.main.html, with the script static/PAGE.js.
PAGES = {"/": ("jobs", "Jobs", ()), "/jobs/{job_id}": ("job", "Job", ("vendor/uplot/uPlot.min.css",
                                                                        "vendor/uplot/uPlot.iife.min.js")),
         "/sites": ("sites", "Sites", ()), "/audit": ("audit", "Audit log", ())}
COALESCE_S = 0.2       # events this close together reach the page as one update (a round's close is several)
HEARTBEAT_S = 15.0     # an SSE comment this often keeps proxies from timing an idle stream out


@dataclass(frozen=True)
class Session:
    """Who the dashboard acts as (its kit's certificate) and this process's secrets."""

    name: str
    role: str
    coordinator: str
    cookie: str = "plexus_dashboard"   # the CLI adds the port: cookies are per host, not per port
    token: str = field(default_factory=lambda: secrets.token_urlsafe(32), repr=False)
    csrf: str = field(default_factory=lambda: secrets.token_urlsafe(32), repr=False)


def create_app(client, session: Session, *, hosts: tuple[str, ...] = ("127.0.0.1", "localhost"),
               coalesce_s: float = COALESCE_S) -> Starlette:
    """The dashboard over `client` (an AdminClient: jobs, job, watch, abort, sites, audit), answering only
    requests whose Host is one of `hosts`."""
    api = _Api(client, session, coalesce_s)
    routes = [Route(path, _page(*page)) for path, page in PAGES.items()] + [
        Route("/api/me", api.me),
        Route("/api/jobs", api.jobs),
        Route("/api/jobs/{job_id}", api.job),
        Route("/api/jobs/{job_id}/events", api.events),
        Route("/api/jobs/{job_id}/abort", api.abort, methods=["POST"]),
        Route("/api/sites", api.sites),
        Route("/api/audit", api.audit),
        Mount("/static", StaticFiles(directory=STATIC)),
    ]
    app = Starlette(routes=routes, exception_handlers={grpc.RpcError: _rpc_error},
                    middleware=[Middleware(_SecurityHeaders), Middleware(TrustedHostMiddleware, allowed_hosts=hosts),
                                Middleware(_Guard, session=session)])
    app.state.followers = api.followers
    return app


def _page(name: str, title: str, loads: tuple[str, ...]):
    """The page `name`, composed once: the layout (head, nav bar) around its main part."""
    head = [f'<link rel="stylesheet" href="/static/{f}">' for f in (*loads, "dashboard.css") if f.endswith(".css")]
    head += [f'<script src="/static/{f}" defer></script>' for f in (*loads, "dashboard.js", f"{name}.js")
             if f.endswith(".js")]
    html = Template((STATIC / "layout.html").read_text(encoding="utf-8")).substitute(
        title=title, page=name, head="\n".join(head), main=(STATIC / f"{name}.main.html").read_text(encoding="utf-8"))

    async def page(request: Request) -> Response:
        return HTMLResponse(html)
    return page


class _Api:
    def __init__(self, client, session: Session, coalesce_s: float):
        self.client, self.session, self.coalesce_s = client, session, coalesce_s
        self.followers: set[_Follower] = set()   # the live WatchJob calls, one per open event stream

    def me(self, request: Request) -> Response:
        s = self.session
        return _json(views.me(s.name, s.role, s.coordinator, s.csrf))

    def jobs(self, request: Request) -> Response:
        jobs = [views.job_summary(self.client.job(s.job_id)) for s in self.client.jobs()]
        return _json(sorted(jobs, key=lambda j: j["created"] or 0, reverse=True))

    def job(self, request: Request) -> Response:
        return _json(views.job_detail(self.client.job(request.path_params["job_id"])))

    def abort(self, request: Request) -> Response:
        if self.session.role not in views.CAN_ABORT:
            return _json({"error": f"this dashboard runs with {self.session.name!r}'s {self.session.role} kit, which "
                                   "may not abort jobs; run it with an operator's kit"}, 403)
        s = self.client.abort(request.path_params["job_id"])
        return _json({"summary": {"job_id": s.job_id, "status": s.status, "round": s.current_round,
                                  "rounds": s.rounds, "message": s.message}})

    def sites(self, request: Request) -> Response:
        return _json([views.site(info) for info in self.client.sites()])

    def audit(self, request: Request) -> Response:
        return _json(views.audit(self.client.audit(verify=True, limit=views.AUDIT_ENTRIES)))

    async def events(self, request: Request) -> Response:
        job_id = request.path_params["job_id"]
        await run_in_threadpool(self.client.job, job_id)   # an unknown job is a 404, not an empty stream
        return _EventStream(self._stream(job_id), media_type="text/event-stream",
                            headers={"Cache-Control": "no-store", "X-Accel-Buffering": "no"})

    async def _stream(self, job_id: str):
        """`job` with the job's whole view after each burst of events, `end` once the job is over; `problem`
        when the watch fails (the page's EventSource then connects again)."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        follower = _Follower(self.client, job_id, lambda item: loop.call_soon_threadsafe(queue.put_nowait, item))
        self.followers.add(follower)
        follower.start()
        try:
            yield "retry: 5000\n\n"
            while True:
                burst = await self._burst(queue)
                if burst is None:
                    yield ": keep-alive\n\n"
                    continue
                end = burst.pop() if isinstance(burst[-1], _End) else None
                if end is not None and end.error:
                    yield _sse("problem", {"error": end.error})
                    return
                try:
                    detail = views.job_detail(await run_in_threadpool(self.client.job, job_id))
                except grpc.RpcError as exc:
                    yield _sse("problem", {"error": f"{exc.code().name}: {exc.details()}"})
                    return
                yield _sse("job", {**detail, "event": views.event(burst[-1]) if burst else None})
                if end is not None:
                    yield _sse("end", {"status": detail["status"]})
                    return
        finally:
            follower.cancel()
            self.followers.discard(follower)

    async def _burst(self, queue: asyncio.Queue) -> list | None:
        """The next event and those that follow it within coalesce_s (ending early at an _End); None when
        nothing came for HEARTBEAT_S."""
        try:
            burst = [await asyncio.wait_for(queue.get(), HEARTBEAT_S)]
        except asyncio.TimeoutError:
            return None
        deadline = asyncio.get_running_loop().time() + self.coalesce_s
        while not isinstance(burst[-1], _End) and (left := deadline - asyncio.get_running_loop().time()) > 0:
            try:
                burst.append(await asyncio.wait_for(queue.get(), left))
            except asyncio.TimeoutError:
                break
        return burst


@dataclass(frozen=True)
class _End:
    error: str = ""   # empty: the watch ended because the job did


class _Follower:
    """A job's WatchJob call, followed in a thread of its own; `cancel` ends the call and so the thread."""

    def __init__(self, client, job_id: str, put):
        self.client, self.job_id, self.put = client, job_id, put
        self.call = None
        self.cancelled = False
        self.lock = threading.Lock()
        self.thread = threading.Thread(target=self._run, name=f"dashboard-watch-{job_id}", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def cancel(self) -> None:
        with self.lock:
            self.cancelled = True
            if self.call is not None:
                self.call.cancel()

    def _run(self) -> None:
        try:
            with self.lock:
                if self.cancelled:
                    return
                self.call = self.client.watch(self.job_id)
            for event in self.call:
                self._put(event)
            self._put(_End())
        except grpc.RpcError as exc:
            self._put(_End(f"{exc.code().name}: {exc.details()}"))

    def _put(self, item) -> None:
        if self.cancelled:
            return
        try:
            self.put(item)
        except RuntimeError:   # the stream's event loop has closed: nobody is reading any more
            pass


class _EventStream(StreamingResponse):
    """A stream that ends (and so cancels its WatchJob) as soon as the browser goes away. Starlette only
    listens for the disconnect under ASGI < 2.4, else notices when a write fails, which for a quiet job
    would be the next heartbeat."""

    async def __call__(self, scope, receive, send) -> None:
        async with anyio.create_task_group() as group:
            async def stream() -> None:
                try:
                    await self.stream_response(send)
                except OSError:   # the client went away mid-write
                    pass
                group.cancel_scope.cancel()

            group.start_soon(stream)
            await self.listen_for_disconnect(receive)
            group.cancel_scope.cancel()


class _Guard:
    """Token, then (for anything but GET and HEAD) CSRF token and Origin; answers 401 or 403 itself."""

    def __init__(self, app, session: Session):
        self.app, self.session = app, session

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        refusal = self._check(Request(scope))
        await (refusal or self.app)(scope, receive, send)

    def _check(self, request: Request) -> Response | None:
        s = self.session
        token = request.query_params.get("token")
        if request.url.path == "/" and token is not None:
            if not _same(token, s.token):
                return _unauthorized(request, "The token in this URL is not this dashboard's (it changes each time "
                                              "the dashboard starts).")
            response = RedirectResponse("/", status_code=303)   # the token leaves the address bar and history
            response.set_cookie(s.cookie, s.token, httponly=True, samesite="strict", path="/")
            return response
        if not _same(request.cookies.get(s.cookie, ""), s.token):
            return _unauthorized(request, "This browser has not opened the dashboard's URL yet.")
        if request.method in ("GET", "HEAD"):
            return None
        if not _same(request.headers.get(CSRF_HEADER, ""), s.csrf):
            return _json({"error": f"refused: the {CSRF_HEADER} header is missing or wrong; only the dashboard's own "
                                   "pages may change anything"}, 403)
        own = f"{request.url.scheme}://{request.headers.get('host', '')}"
        origin = request.headers.get("origin")
        if origin != own:
            return _json({"error": f"refused: the request's Origin {origin!r} is not the dashboard's own {own!r}"}, 403)
        return None


class _SecurityHeaders:
    """The CSP and its companions on every response, the refusals and static files included."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def with_headers(message) -> None:
            if message["type"] == "http.response.start":
                headers = [(k, v) for k, v in message.get("headers", [])
                           if k.decode("latin-1").lower() not in _LOWER_SECURITY]
                headers += [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in SECURITY_HEADERS.items()]
                if scope["path"].startswith("/api/"):
                    headers.append((b"cache-control", b"no-store"))
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, with_headers)


_LOWER_SECURITY = {k.lower() for k in SECURITY_HEADERS}

_UNAUTHORIZED_PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>Plexus dashboard: open the printed URL</title></head>
<body><h1>Plexus dashboard</h1><p>{why}</p>
<p>Open the URL that <code>plexus dashboard</code> printed when it started (the line
<code>dashboard: http://…/?token=…</code>) in this browser. Anyone with that URL acts with the dashboard's admin
kit, so keep it to yourself.</p></body></html>
"""


def _unauthorized(request: Request, why: str) -> Response:
    if request.url.path.startswith("/api/"):
        return _json({"error": f"{why} Open the URL `plexus dashboard` printed."}, 401)
    return HTMLResponse(_UNAUTHORIZED_PAGE.format(why=why), status_code=401)


def _rpc_error(request: Request, exc: grpc.RpcError) -> Response:
    return _json({"error": f"{exc.code().name}: {exc.details()}"}, HTTP_STATUS.get(exc.code(), 502))


def _json(content, status: int = 200) -> Response:
    return JSONResponse(content, status_code=status)


def _sse(kind: str, data: dict) -> str:
    return f"event: {kind}\ndata: {json.dumps(data, allow_nan=False, separators=(',', ':'))}\n\n"


def _same(given: str, expected: str) -> bool:
    return secrets.compare_digest(given.encode("utf-8", "surrogatepass"), expected.encode("utf-8"))
