"""Size limits over real gRPC + mTLS: configs too large to use, error messages too long to send, and
update streams of empty or tiny chunks are refused early, and the federation goes on serving."""

from __future__ import annotations

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
