"""Invariants that keep the coordinator's memory O(model): one update at a time, many sites at once."""

from __future__ import annotations

import json
import threading

import pytest

from coordinator import aggregate
from coordinator.server import Coordinator
from plexus import pki
from plexus.config import CoordinatorConfig
from plexus.proto.plexus.v1 import federation_pb2 as fpb

from integration.harness import RawSite, scaled, wait_until


def _echo_sites(address: str, kits: list, stop: threading.Event) -> list[threading.Thread]:
    """Sites with trivial training: fetch the model, send it back unchanged, until stopped."""
    def loop(kit):
        site = RawSite(kit, address)
        try:
            site.join({"none": 1000})   # the job's dataset: updates weigh at most these rows
            while not stop.is_set():
                task = site.stub.NextTask(fpb.NextTaskRequest(wait_s=0.5), timeout=10)
                if task.kind == fpb.TASK_TRAIN:
                    _, state = site.fetch(task)
                    site.submit(task, state, num_samples=10, chunk=1 << 20, timeout=120)
                elif task.kind == fpb.TASK_EVALUATE:
                    site.report(task, fpb.RESULT_EVALUATED)
        finally:
            site.close()
    threads = [threading.Thread(target=loop, args=(kit,), daemon=True, name=f"echo-site-{kit.name}") for kit in kits]
    for t in threads:
        t.start()
    return threads


@pytest.fixture
def fleet(tmp_path):
    root = tmp_path / "pki"
    pki.init_federation(root, "scale", hosts=["127.0.0.1"])
    admin = pki.add_admin(root, "ops", role="operator")
    kits = [pki.add_site(root, f"s{i:02d}") for i in range(32)]
    coordinator = Coordinator(CoordinatorConfig(listen="127.0.0.1:0", kit=root / "coordinator",
                                                state_dir=tmp_path / "state", poll_timeout_s=1.0, max_workers=256))
    coordinator.start()
    stop = threading.Event()
    yield coordinator, admin, kits, stop
    stop.set()
    # The sites end their own polls (a poll waits 0.5 s) before the server goes: no call is cut mid-way.
    for thread in [t for t in threading.enumerate() if t.name.startswith("echo-site")]:
        thread.join(scaled(30))
    coordinator.stop(grace=0.5)


def _run(coordinator, admin, kits, stop, *, sites: int, rounds: int, size: int) -> str:
    from plexus.admin_client import AdminClient

    address = f"127.0.0.1:{coordinator.port}"
    _echo_sites(address, kits[:sites], stop)
    wait_until(lambda: len(coordinator.engine.online_sites()) == sites, 60, f"{sites} sites online")
    with AdminClient(address, admin) as client:
        job_id = client.submit(f"name: scale\nmodel: {{name: vector, args: {{size: {size}, chunks: 3}}}}\n"
                               f"data: {{dataset: none}}\nrounds: {rounds}\nsites: {{min: {sites}, deadline_s: 120}}\n"
                               ).job_id
        wait_until(lambda: client.job(job_id).summary.status in ("completed", "failed"), 120, "the job to end")
        return job_id


def test_a_32_site_job_completes(fleet):
    coordinator, admin, kits, stop = fleet
    job_id = _run(coordinator, admin, kits, stop, sites=32, rounds=3, size=1000)
    rounds = coordinator.store.rounds(job_id)
    assert coordinator.store.job(job_id).status == "completed"
    assert [(r[0], r[2], len(json.loads(r[5]))) for r in rounds[:3]] == [(1, "closed", 32), (2, "closed", 32),
                                                                    (3, "closed", 32)]


def test_updates_are_folded_chunk_by_chunk_one_piece_at_a_time(fleet, monkeypatch):
    """Eight sites upload at once: every chunk goes into the one running sum as it arrives, one piece at
    a time under the sum's lock, and no piece is ever larger than the sites' 1 MiB chunk."""
    coordinator, admin, kits, stop = fleet
    active, seen = [0], {"max_active": 0, "pieces": 0, "largest_piece": 0, "sums": set(), "finished": 0}
    lock = threading.Lock()
    fold_bytes, finish = aggregate.WeightedSum.fold_bytes, aggregate.Fold.finish

    def instrumented(self, position, data, weight, max_abs, sign):
        with lock:
            active[0] += 1
            seen["max_active"] = max(seen["max_active"], active[0])
            seen["pieces"] += 1
            seen["largest_piece"] = max(seen["largest_piece"], len(data))
            seen["sums"].add(id(self))
        try:
            return fold_bytes(self, position, data, weight, max_abs, sign)
        finally:
            with lock:
                active[0] -= 1

    def counted(self):
        finish(self)
        seen["finished"] += 1

    monkeypatch.setattr(aggregate.WeightedSum, "fold_bytes", instrumented)
    monkeypatch.setattr(aggregate.Fold, "finish", counted)
    size = 3_000_000  # 12 MB per update: twelve 1 MiB chunks each
    job_id = _run(coordinator, admin, kits, stop, sites=8, rounds=1, size=size)
    assert coordinator.store.job(job_id).status == "completed"
    assert seen["finished"] == 8 and len(seen["sums"]) == 1   # eight updates, one running sum
    assert seen["pieces"] >= 8 * 12                            # folded chunk by chunk, not once per update
    assert seen["max_active"] == 1                             # never two pieces in the sum at once
    assert seen["largest_piece"] <= 1 << 20 < size * 4         # each update held a chunk at a time, never whole
