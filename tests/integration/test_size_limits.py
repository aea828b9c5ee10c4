"""Size limits over real gRPC + mTLS: configs too large to use, error messages too long to send, and
update streams of empty or tiny chunks are refused early, and the federation goes on serving."""

from __future__ import annotations

import threading

import grpc
import pytest

from plexus.proto.plexus.v1 import federation_pb2 as fpb

from integration.harness import heart_job


def _details(err) -> str:
    return err.value.details()


def test_a_4_5_mb_round_config_is_refused_with_its_size_and_the_limit(federation):
    """Reported: a 4.5 MB YAML timed the submit out."""
    admin = federation.admin()
    text = heart_job() + "# " + "padding " * 560_000 + "\n"
    with pytest.raises(grpc.RpcError) as err:
        admin.submit(text)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert _details(err) == (f"submitted round config: the config is {len(text)} bytes, over the limit of 262144 "
                             "bytes (256 KiB) that is read at all; shorten it (fewer or shorter lists)")
    assert admin.jobs() == []


def test_an_error_leaving_the_coordinator_is_bounded_and_keeps_its_start_and_its_fix(federation):
    """A config error quotes the value it refuses: a 200,000-character name made a 200 KB status message."""
    admin = federation.admin()
    with pytest.raises(grpc.RpcError) as err:
        admin.submit(heart_job().replace("name: heart", "name: " + "n" * 200_000))
    details = _details(err)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert len(details.encode()) <= 2048 + 64, len(details)
    assert details.startswith("submitted round config:1: name: 'nnnn")
    assert "more characters) …" in details
    assert details.endswith("is not a valid name; use 1-64 letters, digits, '.', '_' or '-', starting with a "
                            "letter or digit")


def test_a_sites_long_failure_reason_is_stored_bounded(federation):
    site = federation.raw_site("a")
    site.join()
    job_id = federation.admin().submit(heart_job(name="failing", min=1, rounds=1)).job_id
    reason = "disk trouble: " + "x" * 1_000_000 + " (see the site log)"
    site.report(site.next_task(), fpb.RESULT_FAILED, reason)
    federation.wait_job(job_id)

    (event,) = federation.admin().job(job_id).site_events
    assert event.status == "failed" and len(event.reason.encode()) <= 2048 + 64
    assert event.reason.startswith("disk trouble: xxx") and event.reason.endswith("xxx (see the site log)")
    assert "more characters" in event.reason


def test_streams_of_empty_or_one_byte_chunks_are_refused_and_the_round_completes(federation):
    """Reported: 200,000 empty chunks were accepted and cost the coordinator 17.9 s of CPU. An empty chunk
    is refused outright, and an update comes in at most ceil(bytes / 4 KiB) + 64 chunks."""
    federation.start_site("a")
    federation.start_site("b")
    empty, tiny = federation.raw_site("c"), federation.raw_site("d")
    for site in (empty, tiny):
        site.join()
    federation.wait_online("a", "b", "c", "d")
    job_id = federation.admin().submit(heart_job(rounds=1, min=2)).job_id

    task = empty.next_task()
    layout, state = empty.fetch(task)
    header = fpb.UpdateHeader(task_id=task.task_id, job_id=task.job_id, round=task.round, nonce=task.nonce,
                              num_samples=10, manifest=layout.to_proto())

    def empty_chunks():
        yield fpb.UpdateMessage(header=header)
        for _ in range(200_000):
            yield fpb.UpdateMessage(chunk={"offset": 0, "data": b""})
    with pytest.raises(grpc.RpcError) as err:
        empty.stub.SubmitUpdate(empty_chunks(), timeout=60)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert _details(err) == "empty chunk at byte 0; every chunk carries at least one byte"

    task = tiny.next_task()
    layout, state = tiny.fetch(task)
    assert layout.total_bytes == 112   # logistic 13 -> 2: at most 1 + 64 chunks
    with pytest.raises(grpc.RpcError) as err:
        tiny.submit(task, state, chunk=1)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert _details(err) == ("chunk 66 at byte 65: 112 bytes come in at most 65 chunks (on average at least 4096 "
                             "bytes each); send larger chunks")

    stop = threading.Event()
    for site in (empty, tiny):
        site.answer_everything_with_failure(stop)   # the evaluation round
    try:
        assert federation.wait_job(job_id) == "completed"
    finally:
        stop.set()
    detail = federation.admin().job(job_id)
    assert list(detail.rounds[0].contributors) == ["a", "b"]
    assert {(e.site, e.status) for e in detail.site_events if e.round == 1} >= {("c", "rejected"), ("d", "rejected")}
