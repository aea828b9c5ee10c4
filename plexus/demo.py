"""`plexus demo`: a whole federation on this machine, over mTLS, in one command.

Fresh PKI, a coordinator and one site agent per hospital as separate processes
on 127.0.0.1, a FedAvg job on the UCI heart-disease data, live progress, then
the federated model against a pooled model (the ceiling) and each site alone.
Every process it starts is stopped again, also on Ctrl-C. A run that fails keeps
its folder (PKI, state, logs), also a temporary one, and says where it is.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import grpc

from plexus.config import MIN_SECURE_COHORT
from plexus.datasets import HOSPITALS
from plexus.errors import ConfigError, PlexusError
from plexus.text import printable

DEMO_ROUND_CONFIG = """\
name: heart-fedavg
model: {{name: mlp, args: {{in_features: 13, hidden: [16], num_classes: 2}}}}
data: {{dataset: heart-disease}}
strategy: {{name: fedavg}}
rounds: {rounds}
sites: {{min: {sites}, deadline_s: 60}}
train: {{epochs: 1, batch_size: 16, optimizer: {{name: sgd, lr: 0.1, momentum: 0.9}}}}
seed: 0
"""
SECURE_BLOCK = "privacy: {secure_aggregation: true}\n"
GUARD_TICK_S = 0.2   # how often the demo looks at its children while it waits for the job's next event


class Federation:
    """The demo's child processes; `stop()` ends exactly the processes it started."""

    def __init__(self, workdir: Path):
        self.workdir = workdir
        self.logs = workdir / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.procs: dict[str, subprocess.Popen] = {}
        self.interrupted = False   # Ctrl-C arrived (see `interrupt`)

    def interrupt(self, signum: int, frame) -> None:
        """The demo's SIGINT handler: raise KeyboardInterrupt as Python's does, and remember it. Python drops
        an exception a signal handler raises while a finalizer runs (gRPC's call objects have them), so a
        Ctrl-C could vanish; check_alive raises it again (after every job event, and through `guarding` within a
        tick)."""
        self.interrupted = True
        raise KeyboardInterrupt

    def spawn(self, name: str, *args: str) -> subprocess.Popen:
        log = open(self.logs / f"{name}.log", "wb")
        env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
        proc = subprocess.Popen([sys.executable, "-m", "plexus", *args], stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, env=env, start_new_session=True)
        log.close()
        self.procs[name] = proc
        with open(self.workdir / "pids", "a") as fh:  # lets an operator (and the tests) check nothing is left
            fh.write(f"{proc.pid} {name}\n")
        return proc

    def check_alive(self) -> None:
        if self.interrupted:
            raise KeyboardInterrupt
        for name, proc in self.procs.items():
            if proc.poll() is not None:
                tail = (self.logs / f"{name}.log").read_text(errors="replace")[-2000:]
                raise PlexusError(f"{name} exited with code {proc.returncode}; its log ends:\n{tail}")

    @contextmanager
    def guarding(self, call):
        """Cancel `call` (the job's watch) once a child exits or a Ctrl-C was dropped, and raise why: the demo
        stops on it at once, not at the job's next event (a round that lost a site first waits out its deadline)."""
        done = threading.Event()

        def guard() -> None:
            while not done.wait(GUARD_TICK_S):
                if self.interrupted or any(proc.poll() is not None for proc in self.procs.values()):
                    call.cancel()
                    return

        thread = threading.Thread(target=guard, name="plexus-demo-guard", daemon=True)
        thread.start()
        try:
            yield
        except grpc.RpcError:
            self.check_alive()   # the guard cancelled the watch: its reason, not the cancellation
            raise
        finally:
            done.set()
            thread.join()

    def peak_rss_mb(self, name: str) -> float:
        try:
            for line in Path(f"/proc/{self.procs[name].pid}/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
        except OSError:
            pass
        return float("nan")

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 10
        for proc in self.procs.values():
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _site_yaml(name: str, hospital: str, address: str) -> str:
    return (f'site: "{name}"\ncoordinator: "{address}"\nkit: "."\nstate_dir: "./state"\n'
            f"datasets:\n  heart-disease: {{kind: heart-disease, hospital: {hospital}}}\n"
            "policy:\n  allowed_models: [logistic, mlp]\n  require_secure_aggregation: false\n")


def _wait_for(path: Path, fed: Federation, timeout_s: float = 120) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if path.exists():
            return path.read_text().strip()
        fed.check_alive()
        time.sleep(0.05)
    raise PlexusError(f"the coordinator did not start within {timeout_s:.0f}s; see {fed.logs}")


def start_coordinator(fed: Federation, root: Path, federation: str, *, poll_timeout_s: float) -> str:
    """A new federation's PKI in `root` and its coordinator, a child of `fed`, on 127.0.0.1; its address."""
    from plexus import pki

    pki.init_federation(root, federation, hosts=["127.0.0.1"])
    coord_yaml = root / "coordinator" / "coordinator.yaml"
    # Port 0: the OS picks a free port; the coordinator writes the one it bound to coordinator.addr.
    coord_yaml.write_text(coord_yaml.read_text().replace('listen: "127.0.0.1:8443"', 'listen: "127.0.0.1:0"')
                          + f"poll_timeout_s: {poll_timeout_s:g}\n")
    fed.spawn("coordinator", "coordinator", "run", "--config", str(coord_yaml))
    return _wait_for(root / "coordinator" / "state" / "coordinator.addr", fed)


def run_demo(*, sites: int = 4, rounds: int = 20, workdir: Path | None = None, secure: bool = False,
             plot: Path | None = None, out=sys.stdout) -> int:
    if not 1 <= sites <= len(HOSPITALS):
        raise ConfigError(f"--sites must be between 1 and {len(HOSPITALS)} (one per hospital in the data)")
    if rounds < 1:
        raise ConfigError("--rounds must be at least 1")
    if secure and sites < MIN_SECURE_COHORT:
        raise ConfigError(f"--secure-aggregation needs --sites {MIN_SECURE_COHORT} or more: a sum over fewer "
                          "sites would tell the coordinator their updates")
    started = time.monotonic()
    temporary = workdir is None
    workdir = Path(tempfile.mkdtemp(prefix="plexus-demo-")) if temporary else Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    fed = Federation(workdir)
    outcome = "failed"
    on_main = threading.current_thread() is threading.main_thread()   # only the main thread sets handlers
    previous = signal.signal(signal.SIGINT, fed.interrupt) if on_main else None
    try:
        code = _run(fed, workdir, sites, rounds, started, out, secure, plot)
        outcome = "ok" if code == 0 else "failed"
        return code
    except KeyboardInterrupt:
        outcome = "interrupted"
        raise
    finally:
        if previous is not None:
            signal.signal(signal.SIGINT, previous)
        fed.stop()
        if outcome == "failed":   # what went wrong is in there: never remove it
            print(f"plexus demo failed; its PKI, state and logs are kept in {workdir} (logs: {fed.logs})",
                  file=sys.stderr, flush=True)
        elif temporary:
            shutil.rmtree(workdir, ignore_errors=True)


def _run(fed: Federation, workdir: Path, sites: int, rounds: int, started: float, out, secure: bool,
         plot: Path | None) -> int:
    from plexus import pki
    from plexus.admin_client import AdminClient, mean_eval

    def say(text: str = "") -> None:
        print(text, file=out, flush=True)

    hospitals = HOSPITALS[:sites]
    root = workdir / "pki"
    say(f"plexus demo: federation in {workdir} (PKI, state, logs)")
    address = start_coordinator(fed, root, "plexus-demo", poll_timeout_s=10)
    admin_kit = pki.add_admin(root, "demo-operator", role="operator")
    kits = {h: pki.add_site(root, h) for h in hospitals}
    say(f"coordinator up on {address} (mutual TLS); starting {sites} site agents: {', '.join(hospitals)}")
    for h, kit in kits.items():
        (kit / "site.yaml").write_text(_site_yaml(h, h, address))
        fed.spawn(f"site-{h}", "site", "run", "--config", str(kit / "site.yaml"), "--threads", "1")

    config = DEMO_ROUND_CONFIG.format(rounds=rounds, sites=sites) + (SECURE_BLOCK if secure else "")
    with AdminClient(address, admin_kit) as client:
        # The first submit also starts the coordinator's model worker (it imports torch), which on a busy
        # machine can outlast a deadline: it is retried under its request id, so the demo neither gives
        # up (and stops the coordinator) while that submit is still building the model, nor makes two jobs.
        job_id = client.submit(config).job_id
        mode = "with secure aggregation" if secure else "plain"
        say(f"submitted job {job_id}: FedAvg ({mode}), MLP, {rounds} rounds, {sites} hospitals\n")
        round_times = []
        status = "unknown"
        watch = client.watch(job_id)
        with fed.guarding(watch):
            for event in watch:
                status = event.summary.status
                if event.kind == "round_closed":
                    detail = client.job(job_id)
                    info = next(r for r in detail.rounds if r.round == event.round)
                    round_times.append(info.closed_unix_s - info.opened_unix_s)
                    ev = mean_eval(detail).get(event.round - 1, {})
                    say(f"  round {event.round:>3}/{rounds}  {len(info.contributors)} sites"
                        f"  {info.total_samples:>4} samples  {round_times[-1]:6.3f}s   global model before it:"
                        f" acc {ev.get('accuracy', float('nan')):.3f}  auc {ev.get('auc', float('nan')):.3f}")
                elif event.kind in ("site_declined", "site_failed", "site_rejected", "job_failed", "job_aborted"):
                    say(printable(f"  {event.kind} {event.site} {event.message}"))
                fed.check_alive()
        if status != "completed":
            say(f"\njob ended {status}: {printable(client.job(job_id).summary.message)}")
            return 1
        model = workdir / "model.safetensors"
        final_round = client.download_to(job_id, model)
        if plot is not None:
            from plexus.plot import plot_metrics

            detail = client.job(job_id)
            panels = plot_metrics([(m.round, m.site, m.kind, m.name, m.value) for m in detail.metrics], plot,
                                  title=f"{detail.summary.name} ({job_id})")
            say(f"wrote {', '.join(panels)} to {plot}")
    coordinator_rss = fed.peak_rss_mb("coordinator")
    say(f"\njob {job_id} completed; downloaded the round-{final_round} global model")
    _compare(DEMO_ROUND_CONFIG.format(rounds=rounds, sites=sites), model, hospitals, rounds, say)
    say(f"\nwall time {time.monotonic() - started:.1f}s; median round {statistics.median(round_times):.3f}s; "
        f"coordinator peak RSS {coordinator_rss:.0f} MiB")
    return 0


def _compare(job_yaml: str, model: Path, hospitals: tuple[str, ...], rounds: int, say) -> None:
    """The federated model vs pooled (ceiling) and each site alone, at equal local compute.

    The site's training code computes them in a process of its own (site_agent.baselines), as the demo runs
    every other part of the federation: the kernel imports no site code."""
    job = model.with_name("job.yaml")
    job.write_text(job_yaml)
    done = subprocess.run([sys.executable, "-m", "site_agent.baselines", "--job", str(job), "--model", str(model),
                           "--hospitals", ",".join(hospitals), "--rounds", str(rounds)],
                          capture_output=True, text=True, stdin=subprocess.DEVNULL)
    if done.returncode != 0:
        raise PlexusError(f"the baselines exited with code {done.returncode}; they printed:\n{done.stderr[-2000:]}")
    scores = json.loads(done.stdout)
    labels = {"federated": "federated (FedAvg)", "pooled": "pooled (ceiling)", **{h: f"{h} alone" for h in hospitals}}

    columns = [*hospitals, "pooled test"]
    say("\naccuracy on held-out rows (each site's test split, and all of them pooled):")
    say(f"  {'model':<22}" + "".join(f"{c:>13}" for c in columns) + f"{'pooled AUC':>12}")
    for key, name in labels.items():
        got = scores[key]
        say(f"  {name:<22}" + "".join(f"{got[h]:>13.3f}" for h in hospitals)
            + f"{got['pooled']:>13.3f}{got['pooled_auc']:>12.3f}")
