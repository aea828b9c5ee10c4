"""The dashboard's web app against a fake Admin client (its one fake: everything over gRPC is tested with a real
federation in tests/integration/test_dashboard_browser.py): the token, the Host allow-list, CSRF and Origin,
roles, the security headers, gRPC errors as JSON, and the live stream, which ends its WatchJob call when the
browser goes away."""

from __future__ import annotations

import asyncio
import json
import queue
import threading

import grpc
from starlette.testclient import TestClient

from plexus.dashboard.app import CSRF_HEADER, SECURITY_HEADERS, Session, create_app
from plexus.proto.plexus.v1 import admin_pb2 as apb

from timing import scaled, wait_until

ORIGIN = "http://127.0.0.1:8765"
JOB = "name: heart\nmodel: {name: logistic}\ndata: {dataset: heart-disease}\nrounds: 3\n"


class FakeRpcError(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode, details: str):
        self._code, self._details = code, details

    def code(self):
        return self._code

    def details(self):
        return self._details


class FakeWatch:
    """A WatchJob call: yields the events the test puts, blocks between them, ends on None; cancel() ends it as
    gRPC does, with CANCELLED."""

    def __init__(self):
        self.events: queue.Queue = queue.Queue()
        self.cancelled = threading.Event()

    def __iter__(self):
        return self

    def __next__(self):
        item = self.events.get()
        if item is None:
            raise StopIteration
        if item == "cancelled":
            raise FakeRpcError(grpc.StatusCode.CANCELLED, "Locally cancelled by application!")
        return item

    def cancel(self):
        self.cancelled.set()
        self.events.put("cancelled")


class FakeClient:
    """The AdminClient calls the dashboard makes, answered from memory."""

    def __init__(self):
        self.status = "running"
        self.aborted: list[str] = []
        self.watches: list[FakeWatch] = []

    def _summary(self, job_id="j1"):
        return apb.JobSummary(job_id=job_id, name="heart", status=self.status, rounds=3, current_round=1,
                              strategy="fedavg", submitted_by="ops", created_unix_s=1.0, updated_unix_s=2.0)

    def jobs(self):
        return [self._summary()]

    def job(self, job_id):
        if job_id != "j1":
            raise FakeRpcError(grpc.StatusCode.NOT_FOUND, f"no job {job_id!r}")
        return apb.JobDetail(summary=self._summary(), config_yaml=JOB)

    def watch(self, job_id):
        call = FakeWatch()
        self.watches.append(call)
        return call

    def abort(self, job_id):
        if self.status != "running":
            raise FakeRpcError(grpc.StatusCode.FAILED_PRECONDITION, f"job {job_id} is already {self.status}")
        self.aborted.append(job_id)
        self.status = "aborted"
        return self._summary(job_id)

    def sites(self):
        raise FakeRpcError(grpc.StatusCode.UNAVAILABLE, "failed to connect to all addresses")

    def audit(self, *, verify=False, limit=0):
        assert verify and limit == 50
        entry = apb.AuditEntry(seq=1, at=1.0, actor="admin:ops", action="job_submitted", subject="job:j1")
        return apb.AuditReply(verified=True, count=1, entries=[entry])


def _session(role="operator") -> Session:
    return Session(name="ops" if role != "viewer" else "viewer", role=role, coordinator="127.0.0.1:50051",
                   cookie="plexus_dashboard_8765", token="the-token", csrf="the-csrf")


def _browser(client=None, role="operator", **kwargs) -> TestClient:
    """A TestClient that opened the printed URL, as a browser on 127.0.0.1:8765 does."""
    app = create_app(client or FakeClient(), _session(role), hosts=("127.0.0.1", "localhost"), **kwargs)
    browser = TestClient(app, base_url=ORIGIN)
    assert browser.get("/?token=the-token", follow_redirects=False).status_code == 303
    return browser


def test_without_the_token_every_page_and_api_answers_401_saying_to_open_the_printed_url():
    anon = TestClient(create_app(FakeClient(), _session()), base_url=ORIGIN)
    for path in ("/", "/jobs/j1", "/sites", "/audit", "/static/job.js"):
        page = anon.get(path)
        assert page.status_code == 401 and "Open the URL that <code>plexus dashboard</code> printed" in page.text
    for path in ("/api/me", "/api/jobs", "/api/jobs/j1", "/api/jobs/j1/events", "/api/sites", "/api/audit"):
        reply = anon.get(path)
        assert reply.status_code == 401 and "printed" in reply.json()["error"]
    assert anon.post("/api/jobs/j1/abort", headers={CSRF_HEADER: "the-csrf", "Origin": ORIGIN}).status_code == 401
    wrong = anon.get("/?token=guess", follow_redirects=False)
    assert wrong.status_code == 401 and "not this dashboard's" in wrong.text and "set-cookie" not in wrong.headers
    anon.cookies.set("plexus_dashboard_8765", "guess")
    assert anon.get("/api/me").status_code == 401


def test_the_token_sets_an_httponly_samesite_strict_cookie_and_leaves_the_url():
    anon = TestClient(create_app(FakeClient(), _session()), base_url=ORIGIN)
    reply = anon.get("/?token=the-token", follow_redirects=False)
    assert reply.status_code == 303 and reply.headers["location"] == "/"
    cookie = reply.headers["set-cookie"]
    assert cookie.startswith("plexus_dashboard_8765=the-token;")
    assert "HttpOnly" in cookie and "SameSite=strict" in cookie and "Path=/" in cookie
    assert anon.get("/").status_code == 200 and "jobs-table" in anon.get("/").text
    assert anon.get("/api/me").json() == {"name": "ops", "role": "operator", "coordinator": "127.0.0.1:50051",
                                          "can_abort": True, "csrf": "the-csrf"}


def test_a_host_header_not_on_the_allow_list_is_refused_against_dns_rebinding():
    browser = _browser()
    assert browser.get("/api/me", headers={"Host": "evil.example:8765"}).status_code == 400
    assert browser.get("/api/me", headers={"Host": "localhost:8765"}).status_code == 200


def test_every_response_carries_the_csp_and_its_companions():
    browser = _browser()
    anon = TestClient(create_app(FakeClient(), _session()), base_url=ORIGIN)
    for reply in (browser.get("/"), browser.get("/api/jobs"), browser.get("/static/dashboard.js"),
                  browser.get("/api/sites"), anon.get("/"), browser.get("/", headers={"Host": "evil.example"}),
                  browser.post("/api/jobs/j1/abort")):
        for name, value in SECURITY_HEADERS.items():
            assert reply.headers[name] == value, (reply.request.url, name)
    csp = SECURITY_HEADERS["Content-Security-Policy"]
    assert "script-src 'self';" in csp and "unsafe-inline" not in csp and "frame-ancestors 'none'" in csp
    assert browser.get("/api/jobs").headers["cache-control"] == "no-store"


def test_a_post_without_the_csrf_header_or_from_another_origin_is_refused_and_nothing_is_aborted():
    client = FakeClient()
    browser = _browser(client)
    for headers, says in (({"Origin": ORIGIN}, "X-Plexus-CSRF header is missing or wrong"),
                          ({CSRF_HEADER: "guess", "Origin": ORIGIN}, "X-Plexus-CSRF header is missing or wrong"),
                          ({CSRF_HEADER: "the-csrf"}, "Origin None is not the dashboard's own"),
                          ({CSRF_HEADER: "the-csrf", "Origin": "http://evil.example"}, "'http://evil.example'"),
                          ({CSRF_HEADER: "the-csrf", "Origin": "http://127.0.0.1:9999"}, "is not the dashboard's")):
        reply = browser.post("/api/jobs/j1/abort", headers=headers)
        assert reply.status_code == 403 and says in reply.json()["error"], headers
    assert client.aborted == []


def test_an_operator_aborts_with_csrf_and_origin_and_gets_the_coordinators_refusal_after():
    client = FakeClient()
    browser = _browser(client)
    good = {CSRF_HEADER: "the-csrf", "Origin": ORIGIN}
    reply = browser.post("/api/jobs/j1/abort", headers=good)
    assert reply.status_code == 200 and reply.json()["summary"]["status"] == "aborted"
    assert client.aborted == ["j1"]
    again = browser.post("/api/jobs/j1/abort", headers=good)
    assert again.status_code == 409 and again.json() == {"error": "FAILED_PRECONDITION: job j1 is already aborted"}


def test_a_viewers_dashboard_refuses_an_abort_itself():
    client = FakeClient()
    browser = _browser(client, role="viewer")
    assert browser.get("/api/me").json()["can_abort"] is False
    reply = browser.post("/api/jobs/j1/abort", headers={CSRF_HEADER: "the-csrf", "Origin": ORIGIN})
    assert reply.status_code == 403 and "viewer kit, which may not abort jobs" in reply.json()["error"]
    assert client.aborted == []


def test_grpc_errors_are_json_with_a_fitting_status():
    browser = _browser()
    missing = browser.get("/api/jobs/nope")
    assert missing.status_code == 404 and missing.json() == {"error": "NOT_FOUND: no job 'nope'"}
    down = browser.get("/api/sites")
    assert down.status_code == 503 and down.json()["error"].startswith("UNAVAILABLE: ")
    assert browser.get("/api/jobs/nope/events").status_code == 404


def test_the_api_answers_the_pages():
    browser = _browser()
    [job] = browser.get("/api/jobs").json()
    assert job["job_id"] == "j1" and job["mode"] == "sync" and job["round"] == 1
    assert browser.get("/api/jobs/j1").json()["config_yaml"] == JOB
    assert browser.get("/api/audit").json()["verified"] is True
    for page, marker in (("/jobs/j1", 'id="round-counter"'), ("/sites", "sites-table"), ("/audit", "audit-table")):
        assert marker in browser.get(page).text


def test_no_page_has_an_inline_script_or_style():
    browser = _browser()
    for page in ("/", "/jobs/j1", "/sites", "/audit"):
        html = browser.get(page).text
        assert "<style" not in html and " style=" not in html and " on" not in html.replace(" one", "")
        assert all("src=" in tag for tag in html.split("<script")[1:])


def test_a_finished_jobs_stream_sends_its_view_then_end():
    client = FakeClient()
    browser = _browser(client, coalesce_s=0.01)

    def finish():
        call = wait_until(lambda: client.watches and client.watches[0], 10, "the WatchJob call")
        call.events.put(apb.JobEvent(kind="round_closed", round=1, unix_s=3.0, message="closed"))
        client.status = "completed"
        call.events.put(None)

    feeder = threading.Thread(target=finish)
    feeder.start()
    reply = browser.get("/api/jobs/j1/events")   # the TestClient reads the stream to its end
    feeder.join()
    assert reply.headers["content-type"].startswith("text/event-stream")
    events = _parse_sse(reply.text)
    assert [kind for kind, _ in events] == ["job", "end"]
    assert events[0][1]["event"] == {"kind": "round_closed", "round": 1, "site": "", "message": "closed",
                                     "unix_s": 3.0}
    assert events[0][1]["status"] == "completed" and events[1][1] == {"status": "completed"}


def test_a_failed_watch_is_a_problem_event():
    client = FakeClient()
    browser = _browser(client)

    def fail():
        wait_until(lambda: client.watches, 10, "the WatchJob call")[0].events.put("cancelled")

    feeder = threading.Thread(target=fail)
    feeder.start()
    events = _parse_sse(browser.get("/api/jobs/j1/events").text)
    feeder.join()
    assert events == [("problem", {"error": "CANCELLED: Locally cancelled by application!"})]


def test_the_browser_going_away_cancels_the_watch_and_its_thread_ends():
    client = FakeClient()
    app = create_app(client, _session(), coalesce_s=0.01)
    sent: list[bytes] = []

    async def browse():
        gone = asyncio.Event()
        requested = []

        async def receive():
            if not requested:
                requested.append(True)
                return {"type": "http.request", "body": b"", "more_body": False}
            await gone.wait()
            return {"type": "http.disconnect"}

        async def send(message):
            if message["type"] == "http.response.body" and b"event: job" in message.get("body", b""):
                gone.set()   # the browser read one update, then the tab was closed
            sent.append(message.get("body", b""))

        async def feed():
            call = await asyncio.to_thread(wait_until, lambda: client.watches, 10, "the WatchJob call")
            call[0].events.put(apb.JobEvent(kind="round_opened", round=2, unix_s=4.0))

        scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.4"}, "http_version": "1.1",
                 "method": "GET", "scheme": "http", "path": "/api/jobs/j1/events", "raw_path": b"/api/jobs/j1/events",
                 "query_string": b"", "root_path": "", "server": ("127.0.0.1", 8765), "client": ("127.0.0.1", 5000),
                 "headers": [(b"host", b"127.0.0.1:8765"), (b"cookie", b"plexus_dashboard_8765=the-token")]}
        await asyncio.wait_for(asyncio.gather(app(scope, receive, send), feed()), scaled(10))

    asyncio.run(browse())
    assert any(b"event: job" in body for body in sent)
    [call] = client.watches
    assert call.cancelled.is_set()
    assert app.state.followers == set()
    wait_until(lambda: not [t for t in threading.enumerate() if t.name.startswith("dashboard-watch")], 10,
               "the watch thread to end")


def _parse_sse(text: str) -> list[tuple[str, dict]]:
    out = []
    for block in text.split("\n\n"):
        fields = dict(line.split(": ", 1) for line in block.splitlines() if line and not line.startswith(":"))
        if "event" in fields:
            out.append((fields["event"], json.loads(fields["data"])))
    return out
