"""A round that misses its quorum is not the end of the job: sites.retries opens it again, and a job that failed
on one runs again with `plexus job resume` once its sites are back. Real site agents over mTLS; site c drops
out (a raw site that fails its task) and its real agent joins later."""

from __future__ import annotations

from plexus.cli import main as cli
from plexus.proto.plexus.v1 import federation_pb2 as fpb

from integration.harness import heart_job, wait_until


def _admin_args(fed, name="ops"):
    return ["--kit", str(fed.root / "admins" / name), "--coordinator", fed.address]


def _events(fed, job_id: str) -> list[tuple]:
    return fed.store.events_after(job_id, 0)


def _two_sites_and_a_dropout(fed):
    dropout = fed.raw_site("c")
    dropout.join()
    for name in "ab":
        fed.start_site(name)
    fed.wait_online("a", "b", "c")
    return dropout


def test_a_round_that_misses_its_quorum_is_retried_and_completes_once_the_third_site_joins(federation):
    dropout = _two_sites_and_a_dropout(federation)
    job_id = federation.admin().submit(heart_job(name="retried", rounds=1, min=3, retries=1)).job_id
    task = dropout.next_task()
    dropout.report(task, fpb.RESULT_FAILED, "site c went offline")   # round 1 gets 2 of the 3 updates it needs
    wait_until(lambda: [e for e in _events(federation, job_id) if e[2] == "round_retry"], 60, "round 1's retry")
    federation.start_site("c")   # the third site joins; the round runs again with it

    assert federation.wait_job(job_id) == "completed"
    detail = federation.admin().job(job_id)
    assert [(r.round, r.status, sorted(r.contributors)) for r in detail.rounds][0] == (1, "closed", ["a", "b", "c"])
    [retry] = [e[5] for e in _events(federation, job_id) if e[2] == "round_retry"]
    assert retry.startswith("round 1 missed its quorum: 2 update(s), below sites.min=3 (other sites — c: failed)")
    assert retry.endswith("opening it again (retry 1 of sites.retries=1)")
    assert ("c", "failed", 1, "site c went offline") in [(e.site, e.status, e.round, e.reason)
                                                         for e in detail.site_events]


def test_a_job_that_failed_on_a_missed_quorum_resumes_from_its_last_round_with_job_resume(federation, capsys):
    dropout = _two_sites_and_a_dropout(federation)
    job_id = federation.admin().submit(heart_job(name="resumed", rounds=2, min=3)).job_id
    first = dropout.next_task()
    _, model = dropout.fetch(first)
    dropout.submit(first, model, num_samples=10)   # round 1 has its quorum
    second = dropout.next_task()
    assert second.round == 2
    dropout.report(second, fpb.RESULT_FAILED, "site c went offline")
    assert federation.wait_job(job_id) == "failed"

    assert cli(["job", "show", job_id, *_admin_args(federation, "viewer")]) == 0
    shown = capsys.readouterr().out
    assert "round 2 failed: 2 update(s), below sites.min=3" in shown and "plexus job resume" in shown
    assert cli(["job", "resume", job_id, *_admin_args(federation, "viewer")]) == 1
    assert "PERMISSION_DENIED" in capsys.readouterr().err

    checkpoint = federation.store.checkpoint_path(job_id, 1)
    good = checkpoint.read_bytes()
    checkpoint.write_bytes(good[:-1] + bytes([good[-1] ^ 1]))
    assert cli(["job", "resume", job_id, *_admin_args(federation)]) == 1
    err = capsys.readouterr().err
    assert f"FAILED_PRECONDITION: job {job_id} cannot be resumed: checkpoint" in err and "is damaged" in err
    checkpoint.write_bytes(good)   # restored from a backup

    assert cli(["job", "resume", job_id, *_admin_args(federation)]) == 0
    assert f"job {job_id}: running, resuming after round 1" in capsys.readouterr().out
    federation.start_site("c")
    assert federation.wait_job(job_id) == "completed"
    detail = federation.admin().job(job_id)
    closed = {r.round: sorted(r.contributors) for r in detail.rounds if r.status == "closed"}
    assert closed[1] == ["a", "b", "c"] and closed[2] == ["a", "b", "c"]   # round 1 kept, round 2 run again
    kinds = [e[2] for e in _events(federation, job_id)]
    assert kinds.index("job_failed") < kinds.index("job_resume_requested") < kinds.index("job_resumed")

    assert cli(["job", "resume", job_id, *_admin_args(federation)]) == 1
    assert "is completed; only a failed job can be resumed (it has ended" in capsys.readouterr().err


def test_the_retries_of_a_round_wait_longer_each_time(federation):
    """Before: a site failing its task at once (its disk full) had every retry of the round spent within
    milliseconds (3 in 32 ms in the probe). Now the round opens again after 1 s, then 2 s."""
    dropout = _two_sites_and_a_dropout(federation)
    job_id = federation.admin().submit(heart_job(name="paced", rounds=1, min=3, retries=2)).job_id
    for _ in range(3):   # round 1, then its two retries: c fails each at once
        dropout.report(dropout.next_task(), fpb.RESULT_FAILED, "the site's disk is full (test)")
    assert federation.wait_job(job_id) == "failed"
    kinds = [(e.kind, e.at) for e in _events(federation, job_id) if e.kind in ("round_opened", "round_retry")]
    opened = [at for kind, at in kinds if kind == "round_opened"]
    retried = [at for kind, at in kinds if kind == "round_retry"]
    assert len(opened) == 3 and len(retried) == 2, kinds
    assert opened[1] - retried[0] >= 0.9 and opened[2] - retried[1] >= 1.9, kinds
