"""`plexus dashboard` in a real browser (Debian's headless Chromium via Selenium) against a real federation over
mTLS: the dashboards run as `plexus` processes, one with the operator's kit and one with the viewer's.

One test, one federation: its coordinator's gRPC threads start as the test needs them, and each test must end
every thread it started (tests/conftest.py), so the scenario is told in order:

1. sites a (cleveland) and c (va, whose policy allows only logistic models) are online, and e, a site speaking
   the protocol by hand that declines every job with a reason full of markup; the live job (an MLP) opens
   round 1 for all three, c and e decline it, the round misses its quorum of 2 and the job waits for sites;
2. the operator's browser opens the job's page (round 0); sites b and d join and the job runs its rounds while
   the page, never reloaded, follows: the counter moves, the charts fill, c's reason shows in the rounds table
   and e's markup shows as text;
3. a job with central DP: its page draws ε against the target;
4. a job that waits for more sites than there are: forged POSTs (without the CSRF header; the viewer's, with
   it) are refused 403 and the job runs on; the viewer's page has no abort button; the operator's aborts it;
5. the jobs, sites and audit pages; a screenshot of every page.
"""

from __future__ import annotations

import contextlib
import http.server
import os
import re
import shutil
import threading
from pathlib import Path

import pytest

from integration.harness import Federation, Processes, heart_job, scaled, wait_until

CHROMIUM, CHROMEDRIVER = Path("/usr/bin/chromium"), Path("/usr/bin/chromedriver")
URL_LINE = re.compile(r"^dashboard: (http://127\.0\.0\.1:\d+)/\?token=(\S+) \(as (\w+), role (\w+)\)$", re.M)
LIVE_ROUNDS = 6
# What a site may write as its reason: the page must show it as text, never run or render it.
MARKUP = '<img src=x id="injected" onerror="window.plexusInjected = 1">declined by <b>markup</b>'
# Central DP (under which no site reports metrics): the page shows the privacy ledger, ε 8.04 after 3 rounds.
DP_JOB = heart_job(name="private", rounds=3, min=2) + (
    "privacy: {dp: {mode: central, noise_multiplier: 1.1, clip_norm: 0.5, target_epsilon: 20}}\n")


@pytest.fixture
def driver(tmp_path, monkeypatch):
    missing = [str(p) for p in (CHROMIUM, CHROMEDRIVER) if not p.exists()]
    if missing:
        message = f"the browser tests need Debian's chromium and chromium-driver; missing: {', '.join(missing)}"
        if os.environ.get("CI"):
            pytest.fail(message + " (CI installs them: .ci/run)")
        pytest.skip(message)
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    monkeypatch.setenv("SE_OFFLINE", "true")   # Selenium Manager must never download a driver
    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1400,1000",
                f"--user-data-dir={tmp_path / 'chromium'}"):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    browser = webdriver.Chrome(service=Service(str(CHROMEDRIVER), log_output=str(tmp_path / "chromedriver.log")),
                               options=options)
    browser.set_script_timeout(scaled(20))
    yield browser
    browser.quit()


class Shots:
    """Screenshots of whole pages into tmp_path, and into $PLEXUS_TEST_ARTEFACTS when set."""

    def __init__(self, driver, where: Path):
        self.driver, self.where = driver, where
        where.mkdir()

    def take(self, name: str) -> Path:
        height = self.driver.execute_script("return document.documentElement.scrollHeight")
        self.driver.set_window_size(1400, max(800, min(int(height) + 40, 4000)))
        path = self.where / f"{name}.png"
        assert self.driver.save_screenshot(str(path))
        self.driver.set_window_size(1400, 1000)
        if out := os.environ.get("PLEXUS_TEST_ARTEFACTS"):
            Path(out).mkdir(parents=True, exist_ok=True)
            shutil.copy(path, Path(out) / path.name)
        return path


def _dashboard(procs: Processes, fed: Federation, admin: str) -> tuple[str, str]:
    """Start `plexus dashboard` for an admin's kit on a free port; (its origin, its token)."""
    procs.start(f"dashboard-{admin}", "dashboard", "--kit", str(fed.root / "admins" / admin),
                "--coordinator", fed.address, "--listen", "127.0.0.1:0")
    found = wait_until(lambda: URL_LINE.search(procs.log(f"dashboard-{admin}")), 60, f"{admin}'s dashboard URL")
    assert found.group(3) == admin
    return found.group(1), found.group(2)


def _wait(driver, predicate, what: str, timeout: float = 30):
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(driver, scaled(timeout), poll_frequency=0.05).until(lambda d: predicate(d), what)


def _text(driver, selector: str) -> str:
    from selenium.webdriver.common.by import By

    found = driver.find_elements(By.CSS_SELECTOR, selector)
    return found[0].text if found else ""


def _post_from_page(driver, path: str, with_csrf: bool) -> dict:
    """POST from the page's own script context, as a forged or a real request would be sent."""
    return driver.execute_async_script("""
        const [path, withCsrf, done] = arguments;
        (async () => {
          const headers = {};
          if (withCsrf) headers["X-Plexus-CSRF"] = (await (await fetch("/api/me")).json()).csrf;
          const reply = await fetch(path, {method: "POST", headers});
          done({status: reply.status, body: await reply.json()});
        })().catch(e => done({status: -1, body: {error: String(e)}}));
    """, path, with_csrf)


@contextlib.contextmanager
def _elsewhere():
    """Another origin on 127.0.0.1 serving an empty page, as any local web app might; yields its URL."""
    class Page(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.send_header("Content-Type", "text/html")
            self.end_headers()
            self.wfile.write(b"<!doctype html><title>elsewhere</title>")

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Page)
    thread = threading.Thread(target=server.serve_forever, name="elsewhere", daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_port}/"
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def test_the_dashboard_follows_a_job_live_and_guards_what_it_can_do(pki_root, tmp_path, driver):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions

    fed = Federation(pki_root, tmp_path / "state")
    procs = Processes(tmp_path)
    shots = Shots(driver, tmp_path / "shots")
    stop = threading.Event()
    try:
        fed.start_site("a")
        fed.start_site("c", allowed_models=("logistic",))
        marked = fed.raw_site("e")
        marked.join()
        marked.decline_everything(stop, MARKUP)
        fed.wait_online("a", "c", "e")
        ops_url, ops_token = _dashboard(procs, fed, "ops")
        viewer_url, viewer_token = _dashboard(procs, fed, "viewer")
        admin = fed.admin()

        live = admin.submit(heart_job(name="live-mlp", model="mlp", rounds=LIVE_ROUNDS, min=2, retries=1)).job_id
        wait_until(lambda: "waiting for sites" in admin.job(live).summary.message, 60, "c to decline and the job "
                   "to wait for sites")

        # The token URL sets the cookie and leaves the address bar; the jobs page lists the job.
        driver.get(f"{ops_url}/?token={ops_token}")
        assert driver.current_url == f"{ops_url}/"
        _wait(driver, lambda d: d.find_elements(By.CSS_SELECTOR, "#jobs-table a.job-link"), "the jobs table")
        driver.find_element(By.CSS_SELECTOR, "#jobs-table a.job-link").click()
        _wait(driver, lambda d: _text(d, "#round-counter") == f"Round 0 of {LIVE_ROUNDS}", "the job page")
        _wait(driver, lambda d: _text(d, "#live") == "● live", "the live stream to open")
        assert driver.current_url == f"{ops_url}/jobs/{live}"
        driver.execute_script("""
            window.plexusTestSeen = [document.getElementById("round-counter").textContent];
            new MutationObserver(() => window.plexusTestSeen.push(document.getElementById("round-counter").textContent))
              .observe(document.getElementById("round-counter"), {childList: true, characterData: true, subtree: true});
        """)
        shots.take("job-waiting-for-sites")

        fed.start_site("b")
        fed.start_site("d")
        seen = {_text(driver, "#round-counter")}
        _wait(driver, lambda d: seen.add(_text(d, "#round-counter")) or len(seen) >= 2, "the counter to move", 60)
        _wait(driver, lambda d: _text(d, "#job-status") == "completed", "the job to complete on the page", 120)
        assert _text(driver, "#round-counter") == f"Round {LIVE_ROUNDS} of {LIVE_ROUNDS}"
        counted = driver.execute_script("return window.plexusTestSeen")   # set once: the page was never reloaded
        assert counted is not None and len(set(counted)) >= 2, counted
        assert _text(driver, "#live") == "job over" and not driver.find_elements(By.ID, "abort")
        points = driver.execute_script("""
            return [...document.querySelectorAll(".chart")].map(c => [c.id, Number(c.dataset.points),
                                                                     c.querySelectorAll("canvas").length]);
        """)
        charts = {key: (n, canvases) for key, n, canvases in points}
        assert {"chart-eval-accuracy", "chart-eval-auc", "chart-eval-loss", "chart-train-train_loss"} <= set(charts)
        # the global mean and three sites, for the initial model and each round's
        assert charts["chart-eval-accuracy"][0] >= 4 * LIVE_ROUNDS and charts["chart-eval-accuracy"][1] == 1
        reasons = [e.text for e in driver.find_elements(By.CSS_SELECTOR, "#rounds-table .site-reason")]
        assert any("'mlp' is not in this site's policy.allowed_models ['logistic']" in r for r in reasons), reasons
        assert MARKUP in reasons   # as text: no element of it was made, nothing of it ran
        assert not driver.find_elements(By.ID, "injected") and driver.execute_script("return window.plexusInjected")\
            is None
        assert "name: live-mlp" in _text(driver, "#config")
        shots.take("job-completed")

        private = admin.submit(DP_JOB).job_id
        assert fed.wait_job(private) == "completed"
        driver.get(f"{ops_url}/jobs/{private}")
        _wait(driver, lambda d: _text(d, "#live") == "job over", "the private job's page")
        assert "dp-fedavg central σ=1.1 clip 0.5 (ε 8.039 of 20)" in _text(driver, "#facts")
        points = driver.execute_script("return document.querySelector('#chart-epsilon').dataset.points")
        assert points == "6"   # ε after each of 3 rounds, and the target's line
        shots.take("job-private")

        # A job that waits for six sites, with five online: it runs until someone aborts it.
        held = admin.submit(heart_job(name="held", rounds=3, min=6)).job_id
        wait_until(lambda: "waiting for sites" in admin.job(held).summary.message, 60, "the second job to wait")
        driver.get(f"{viewer_url}/?token={viewer_token}")
        driver.get(f"{viewer_url}/jobs/{held}")
        _wait(driver, lambda d: _text(d, "#round-counter") == "Round 0 of 3", "the viewer's job page")
        _wait(driver, lambda d: "viewer" in _text(d, "#who"), "the viewer's name in the nav bar")
        assert not driver.find_elements(By.ID, "abort")
        shots.take("job-viewer")   # before the browser leaves for the other server's page below
        refused = _post_from_page(driver, f"/api/jobs/{held}/abort", with_csrf=True)
        assert refused["status"] == 403 and "may not abort" in refused["body"]["error"], refused
        # A page of another web server on this machine: the same site as the dashboard (ports do not count),
        # so the browser sends the operator's cookie along, but not the CSRF header it cannot read.
        with _elsewhere() as other:
            driver.get(other)
            sent = driver.execute_async_script("""
                const [url, done] = arguments;
                fetch(url, {method: "POST", mode: "no-cors", credentials: "include"}).then(r => done(r.type),
                                                                                          e => done(String(e)));
            """, f"{ops_url}/api/jobs/{held}/abort")
        assert sent == "opaque" and admin.job(held).summary.status == "running"

        driver.get(f"{ops_url}/jobs/{held}")
        _wait(driver, lambda d: d.find_elements(By.ID, "abort"), "the operator's abort button")
        forged = _post_from_page(driver, f"/api/jobs/{held}/abort", with_csrf=False)
        assert forged["status"] == 403 and "X-Plexus-CSRF" in forged["body"]["error"], forged
        assert admin.job(held).summary.status == "running" and admin.job(live).summary.status == "completed"
        driver.find_element(By.ID, "abort").click()
        _wait(driver, expected_conditions.alert_is_present(), "the confirm dialog").accept()
        _wait(driver, lambda d: _text(d, "#job-status") == "aborted", "the page to show the abort")
        assert admin.job(held).summary.status == "aborted" and "aborted by ops" in admin.job(held).summary.message
        _wait(driver, lambda d: not d.find_elements(By.ID, "abort"), "the abort button to go")

        driver.get(f"{ops_url}/")
        _wait(driver, lambda d: len(d.find_elements(By.CSS_SELECTOR, "#jobs-table tbody tr")) == 3, "the three jobs")
        shots.take("jobs")
        driver.get(f"{ops_url}/sites")
        _wait(driver, lambda d: len(d.find_elements(By.CSS_SELECTOR, "#sites-table tbody tr")) == 5, "five sites")
        names = [e.text for e in driver.find_elements(By.CSS_SELECTOR, "#sites-table .site-name")]
        assert sorted(names) == ["a", "b", "c", "d", "e"]
        shots.take("sites")
        driver.get(f"{ops_url}/audit")
        _wait(driver, lambda d: "hash chain verified" in _text(d, "#verified"), "the audit verdict")
        assert "job_aborted" in _text(driver, "#audit-table")
        shots.take("audit")

        problems = [e["message"] for e in driver.get_log("browser")
                    if "Content Security Policy" in e["message"] or "Uncaught" in e["message"]]
        assert not problems, problems
    except Exception:
        shots.take("failure")   # what the browser showed when the test failed, and what its console said
        print("browser console:", *(e["message"] for e in driver.get_log("browser")), sep="\n  ")
        raise
    finally:
        stop.set()
        procs.stop_all()
        fed.close()
