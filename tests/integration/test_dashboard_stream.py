"""The dashboard's live stream under uvicorn, over a real WatchJob call to a real coordinator (mTLS): a client that
goes away ends the call and its thread, while the job runs on."""

from __future__ import annotations

import socket
import threading

import httpx2 as httpx
import uvicorn

from plexus.dashboard.app import Session, create_app

from integration.harness import heart_job, scaled, wait_until


def _watch_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("dashboard-watch")]


def test_a_client_that_leaves_ends_the_watch_and_its_thread(federation):
    admin = federation.admin()
    job_id = admin.submit(heart_job(name="waits", min=1)).job_id   # no site ever joins: it waits
    session = Session(name="ops", role="operator", coordinator=federation.address)
    app = create_app(admin, session)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off",
                                           timeout_graceful_shutdown=1))
    serving = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="uvicorn")
    serving.start()
    try:
        wait_until(lambda: server.started, 10, "uvicorn to start")
        origin = f"http://127.0.0.1:{sock.getsockname()[1]}"
        with httpx.Client(base_url=origin, cookies={session.cookie: session.token}, timeout=scaled(10)) as http:
            for _ in range(2):   # twice: each visit has its own call, ended when it leaves
                with http.stream("GET", f"/api/jobs/{job_id}/events") as stream:
                    assert stream.status_code == 200
                    lines = stream.iter_lines()
                    assert next(line for line in lines if line.startswith("event: ")) == "event: job"
                    assert '"status":"running"' in next(lines) or admin.job(job_id).summary.status == "queued"
                    assert len(app.state.followers) == 1 and len(_watch_threads()) == 1
                wait_until(lambda: not app.state.followers and not _watch_threads(), 10,
                           "the watch to end once the client left")
            assert http.get(f"/api/jobs/{job_id}").json()["status"] in ("queued", "running")
    finally:
        server.should_exit = True
        serving.join(scaled(10))
        sock.close()
