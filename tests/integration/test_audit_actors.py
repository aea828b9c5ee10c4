"""Audit actors and rejection reasons are fields set where the event happens, never parsed from messages:
a site cannot pass itself off as an admin by writing "aborted by adam" into its failure message."""

from __future__ import annotations

import grpc
import numpy as np
import pytest

from plexus.proto.plexus.v1 import federation_pb2 as fpb

from integration.harness import heart_job, wait_until


def _entries(federation, action):
    return [e for e in federation.coordinator.audit_log.entries() if e.action == action]


def test_a_site_failure_message_naming_an_admin_is_recorded_as_the_site(federation):
    site = federation.raw_site("a")
    site.join()
    job_id = federation.admin("ops").submit(heart_job(min=1, rounds=1)).job_id
    task = site.next_task()
    site.report(task, fpb.RESULT_FAILED, "aborted by adam")
    (failed,) = wait_until(lambda: _entries(federation, "site_failed"), what="the failure in the audit log")
    assert failed.actor == "site:a"
    assert failed.details["message"] == "aborted by adam"
    assert failed.subject == f"job:{job_id}"
    assert not [e for e in federation.coordinator.audit_log.entries() if e.actor == "admin:adam"]
    (submitted,) = _entries(federation, "job_submitted")
    assert submitted.actor == "admin:ops"


def test_a_rejection_carries_its_reason_code_whatever_its_message_says(federation):
    site = federation.raw_site("a")
    site.join()
    federation.admin("ops").submit(heart_job(min=1, rounds=1))
    task = site.next_task()
    _, state = site.fetch(task)
    # A tensor named "nan": the message mentions NaN, but the update was refused for its layout.
    with pytest.raises(grpc.RpcError) as err:
        site.submit(task, {**state, "nan": np.zeros(1, np.float32)})
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "nan" in err.value.details()
    (rejected,) = wait_until(lambda: _entries(federation, "site_rejected"), what="the rejection in the audit log")
    assert rejected.actor == "coordinator"
    assert rejected.details["reason"] == "layout"
    metrics = federation.coordinator.metrics.registry
    assert metrics.get_sample_value("plexus_updates_rejected_total", {"reason": "layout"}) == 1
    assert metrics.get_sample_value("plexus_updates_rejected_total", {"reason": "non_finite"}) == 0
