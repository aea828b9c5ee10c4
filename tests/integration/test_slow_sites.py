"""Slowloris over real gRPC + mTLS: one certificate's idle calls never take the coordinator's whole thread
pool, and a site that stalls its update every round is dropped and recorded late while the job goes on."""

from __future__ import annotations

import threading

import grpc
import pytest

from plexus.proto.plexus.v1 import federation_pb2 as fpb

from integration.harness import Federation, heart_job, scaled, wait_until

WORKERS = 64   # the harness's max_workers


@pytest.fixture
def limited(pki_root, tmp_path):
    fed = Federation(pki_root, tmp_path / "state", max_calls_per_identity=4)
    yield fed
    fed.close()


def test_idle_streams_beyond_one_certificates_limit_are_refused_and_everyone_else_is_served(limited):
    """Reported: 140 idle streaming calls from one certificate exhausted the 128-worker pool."""
    fed = limited
    job_id = fed.admin().submit(heart_job(min=2, rounds=1)).job_id   # waits for sites: its watches stay idle
    viewer = fed.admin("viewer")
    streams = [viewer.watch(job_id, timeout_s=scaled(60)) for _ in range(WORKERS + 6)]
    try:
        held, refused = [], []
        for stream in streams:
            try:
                next(stream)   # the job's first event: this stream holds a worker thread now
                held.append(stream)
            except grpc.RpcError as exc:
                refused.append(exc)
        assert len(held) == 4 and len(refused) == WORKERS + 2
        assert {exc.code() for exc in refused} == {grpc.StatusCode.RESOURCE_EXHAUSTED}
        assert refused[0].details() == (
            "admin 'viewer' already has 4 calls in progress, the most one identity may have at once "
            "(max_calls_per_identity: 4 in the coordinator's config); let earlier calls finish (close idle "
            "streams) before making more, or raise max_calls_per_identity")
        with pytest.raises(grpc.RpcError) as err:   # unary calls count too
            viewer.jobs()
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED

        ops = fed.admin("ops")
        assert [j.job_id for j in ops.jobs()] == [job_id]   # another identity is served at once
        fed.start_site("a")
        fed.start_site("b")
        assert fed.wait_job(job_id) == "completed"           # and a whole job runs, rounds and all
    finally:
        for stream in streams:
            stream.cancel()
    wait_until(lambda: _served(viewer), 10, "the viewer's cancelled streams to give their slots back")


def _served(admin) -> bool:
    try:
        admin.jobs()
        return True
    except grpc.RpcError as exc:
        assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        return False


class Staller:
    """A site that takes every training task, fetches the model, sends its update's header and then
    nothing more (it answers evaluation tasks with a failure)."""

    def __init__(self, site, stop: threading.Event):
        self.site, self.stop, self.codes = site, stop, []
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        while not self.stop.is_set():
            try:
                task = self.site.stub.NextTask(fpb.NextTaskRequest(wait_s=0.5), timeout=scaled(5))
                if task.kind == fpb.TASK_EVALUATE:
                    self.site.report(task, fpb.RESULT_FAILED, "this test site does not evaluate")
                elif task.kind == fpb.TASK_TRAIN:
                    _, state = self.site.fetch(task)
                    try:
                        self.site.submit(task, state, pause=(0, self.stop), timeout=120)
                    except grpc.RpcError as exc:
                        self.codes.append((exc.code(), exc.details()))
            except grpc.RpcError:
                return


def test_a_site_stalling_its_update_every_round_is_recorded_late_and_frees_its_transfer_slot(pki_root, tmp_path):
    """Reported: one site stalling its update stream in each round failed the job. With a single transfer
    slot the staller's upload held it, so no honest update could arrive. Now the stall is dropped after
    stream_idle_timeout_s (long before the round's deadline), taken back out of the sum, and recorded late;
    the rounds close with quorum from the honest sites."""
    deadline = scaled(60)
    # Run out twice (once a round); an honest site's update here is one header and one chunk, sent back to back.
    fed = Federation(pki_root, tmp_path / "state", max_transfers=1, stream_idle_timeout_s=scaled(0.5))
    stop = threading.Event()
    try:
        staller = fed.raw_site("c")
        staller.join()
        fed.start_site("a")
        fed.start_site("b")
        fed.wait_online("a", "b", "c")
        job_id = fed.admin().submit(heart_job(min=2, rounds=2, deadline=deadline)).job_id
        stalling = Staller(staller, stop)
        assert fed.wait_job(job_id, timeout=120) == "completed"

        detail = fed.admin().job(job_id)
        training = [r for r in detail.rounds if "evaluation" not in r.status]
        assert [(r.round, list(r.contributors)) for r in training] == [(1, ["a", "b"]), (2, ["a", "b"])]
        assert all(r.closed_unix_s - r.opened_unix_s < deadline for r in training)   # not held to the deadline
        late = {(e.round, e.status) for e in detail.site_events if e.site == "c"}
        assert {(1, "late"), (2, "late")} <= late
        reasons = [e.reason for e in detail.site_events if e.site == "c" and e.status == "late"]
        assert all("did not arrive within" in r and "stream_idle_timeout_s" in r for r in reasons), reasons
    finally:
        stop.set()
        fed.close()
    stalling.thread.join(scaled(10))
    assert len(stalling.codes) >= 2, stalling.codes   # what the staller was told, each round
    for code, details in stalling.codes:
        assert code == grpc.StatusCode.DEADLINE_EXCEEDED and "stream_idle_timeout_s" in details, details


VECTOR_JOB = """\
name: big
model: {name: vector, args: {size: 8000000}}
data: {dataset: heart-disease}
rounds: 1
sites: {min: 1, deadline_s: %s}
"""


def test_a_model_download_nobody_reads_is_cancelled_and_gives_its_transfer_slot_back(pki_root, tmp_path):
    """A site that asks for the model (32 MB, far beyond what flow control lets the coordinator send unread)
    and never reads it held the only transfer slot for as long as it kept the call open."""
    fed = Federation(pki_root, tmp_path / "state", max_transfers=1, stream_idle_timeout_s=scaled(1))
    stalled = None
    try:
        reader, honest = fed.raw_site("c"), fed.raw_site("d")
        for site in (reader, honest):
            site.join()
        job_id = fed.admin().submit(VECTOR_JOB % scaled(60)).job_id
        unread = reader.next_task()
        stalled = reader.stub.FetchModel(fpb.FetchModelRequest(task_id=unread.task_id), timeout=scaled(60))
        assert next(stalled).WhichOneof("body") == "header"   # and then nothing more is read

        task = honest.next_task()
        _, state = honest.fetch(task)   # waits for the slot the stalled download gives back
        honest.submit(task, state, num_samples=100, chunk=1 << 20, timeout=60)
        with pytest.raises(grpc.RpcError) as err:
            for _ in stalled:
                pass
        assert err.value.code() == grpc.StatusCode.CANCELLED
        reader.report(unread, fpb.RESULT_FAILED, "this test site reads no models")
        wait_until(lambda: fed.store.job(job_id).current_round == 1, 30, "the round to close with d's update")
    finally:
        if stalled is not None:
            stalled.cancel()
        fed.close()
