"""coordinator.local: the Admin service over a state dir at rest, called in this process."""

from __future__ import annotations

import getpass

import grpc
import pytest

from coordinator.local import LIVE_ONLY, LocalAuth, admin_client
from coordinator.model_worker import shared_worker
from coordinator.store import Store
from plexus.identity import Identity

from integration.harness import heart_job


@pytest.fixture
def state(tmp_path):
    Store(tmp_path / "state").close()   # an empty state dir, as a coordinator leaves one before any job
    return tmp_path / "state"


def test_writes_are_refused_and_start_nothing(state):
    worker = shared_worker().pid
    with admin_client(state) as client:
        for call in (lambda: client.submit(heart_job(), attempts=1), lambda: client.abort("j"),
                     lambda: client.resume("j"), lambda: client.audit()):
            with pytest.raises(grpc.RpcError) as refused:
                call()
            assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert refused.value.details() == LIVE_ONLY
        assert client.jobs() == []
    assert shared_worker().pid == worker   # no model was built: the submit never reached the engine


def test_a_missing_job_reads_as_not_found(state):
    with admin_client(state) as client:
        with pytest.raises(grpc.RpcError) as missing:
            client.job("nope")
        assert missing.value.code() == grpc.StatusCode.NOT_FOUND
        assert client.address == f"state dir {state}"


def test_the_reader_is_a_local_operator_and_without_a_crl_no_one_is_revoked():
    auth = LocalAuth()
    assert auth.identify(None) == Identity(name=f"local:{getpass.getuser()}", kind="admin", role="operator", serial=0)
    assert not auth.revoked(12345)


def test_the_state_dir_is_released_on_close(state):
    admin_client(state).close()
    Store(state).close()
