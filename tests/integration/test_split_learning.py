"""Split learning over mTLS on loopback: sites train the parts of one model cut in two (vanilla) or three (u-shaped)
against the server part in the coordinator's compute worker, in turn (sequential) or side by side (SplitFed).

The federated job ends with the model an in-process reference of the same schedule gives; a malformed message is
refused; a site that drops mid-epoch is recorded and the epoch goes on; labels never reach the coordinator in a
u-shaped split; the joined model shows in `job show` and comes whole from `job download`."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import os
import signal
import sqlite3
import time
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch
from safetensors.numpy import load_file

from coordinator.drivers import split as split_driver
from coordinator.tasks import site_seed
from plexus import pki
from plexus.admin_client import AdminClient
from plexus.cli import main as cli
from plexus.config import DatasetSpec, parse_round_config
from plexus.datasets import Split, load_for_job
from plexus.models import build_job_model, state_to_numpy
from plexus.proto.plexus.v1 import federation_pb2 as fpb
from plexus.split import ServerStep, SiteOptions, SiteStep, label_log_prior, split, synchronous_epoch, train_batch
from plexus.split_wire import tensor_message
from site_agent import split as site_split
from site_agent.agent import SiteAgent

from integration.harness import HOSPITAL_OF, Federation, cli_kits, scaled, wait_until

SITES = ("a", "b", "c")
CUTS = {"vanilla": "[hidden1]", "u-shaped": "[hidden1, hidden2]"}


def split_job(variant: str, schedule: str, *, rounds: int = 2, min_sites: int = 3, seed: int = 5, name: str = "sl",
              timeout: float = 30.0, tau: float = 0.0) -> str:
    return f"""\
name: {name}
model: {{name: mlp, args: {{in_features: 13, hidden: [32, 16], num_classes: 2}}}}
data: {{dataset: heart-disease}}
rounds: {rounds}
mode: split
split: {{variant: {variant}, cuts: {CUTS[variant]}, schedule: {schedule}, batch_timeout_s: {timeout}, \
logit_adjustment: {tau}}}
sites: {{min: {min_sites}, deadline_s: {scaled(60)}}}
train: {{batch_size: 32, optimizer: {{name: sgd, lr: 0.1, momentum: 0.5}}}}
seed: {seed}
"""


def reference(job: str, sites: tuple[str, ...], *, few: dict[str, int] | None = None) -> dict[str, np.ndarray]:
    """The same schedule in process: each site's seeded batches (site_seed of the job seed, epoch and site) through
    plexus.split's steps; sequential hands the site-side weights on in name order, SplitFed takes batch t of every
    site in name order before batch t+1 and averages the site-side copies by rows (float64) each epoch, synchronous
    is plexus.split.synchronous_epoch over the sites in name order. `few`: sites that keep only their first N
    training rows (FewRows)."""
    cfg = parse_round_config(job)
    spec, opt = cfg.split, cfg.train.optimizer
    data = {s: load_for_job(DatasetSpec(kind="heart-disease", hospital=HOSPITAL_OF[s]), cfg.data) for s in sites}
    for site, n in (few or {}).items():
        data[site] = FewRows.first(data[site], n)
    model = build_job_model(cfg)
    parts = split(model, spec.variant, list(spec.cuts))
    server = ServerStep(parts, torch.optim.SGD(parts.middle.parameters(), lr=opt.lr, momentum=opt.momentum))

    def site_step(p, epoch, site):
        generator = torch.Generator().manual_seed(site_seed(cfg.seed, epoch, site))
        params = [q for m in p.site_modules for q in m.parameters()]
        x = torch.as_tensor(data[site].x_train, dtype=torch.float32)
        y = torch.as_tensor(data[site].y_train, dtype=torch.int64)
        step = SiteStep(p, torch.optim.SGD(params, lr=opt.lr, momentum=opt.momentum),
                        SiteOptions(logit_adjustment=spec.logit_adjustment), generator=generator,
                        log_prior=label_log_prior(y, 2) if spec.logit_adjustment else None)
        order = torch.randperm(len(x), generator=generator)
        return step, [(x[r], y[r]) for r in (order[k:k + 32] for k in range(0, len(x), 32))]

    for epoch in range(1, cfg.rounds + 1):
        if spec.schedule == "synchronous":
            ordered = sorted(sites)
            synchronous_epoch(model, spec.variant, list(spec.cuts), server,
                              [(torch.as_tensor(data[s].x_train, dtype=torch.float32),
                                torch.as_tensor(data[s].y_train, dtype=torch.int64)) for s in ordered],
                              lambda params: torch.optim.SGD(params, lr=opt.lr, momentum=opt.momentum),
                              batch_size=cfg.train.batch_size, seed=cfg.seed,
                              options=SiteOptions(logit_adjustment=spec.logit_adjustment),
                              generators=[torch.Generator().manual_seed(site_seed(cfg.seed, epoch, s))
                                          for s in ordered])
            continue
        if spec.schedule == "sequential":
            for site in sorted(sites):
                step, batches = site_step(parts, epoch, site)
                for x, y in batches:
                    train_batch(step, server, x, y)
            continue
        copies, plans = {}, {}
        for site in sorted(sites):
            mine = copy.deepcopy(model)
            p = split(mine, spec.variant, list(spec.cuts))
            p.middle = parts.middle
            copies[site] = mine
            plans[site] = site_step(p, epoch, site)
        for t in range(max(len(b) for _, b in plans.values())):
            for site in sorted(sites):
                step, batches = plans[site]
                if t < len(batches):
                    train_batch(step, server, *batches[t])
        rows = {s: len(data[s].y_train) for s in sites}
        total = sum(rows.values())
        states = {s: state_to_numpy(c) for s, c in copies.items()}
        merged = state_to_numpy(model)
        for name in merged:
            if not any(name.startswith(f"layers.{i}.") for i in _server_layers(spec.variant)):
                acc = np.zeros(merged[name].shape, np.float64)
                for s in sorted(sites):
                    acc += rows[s] / total * states[s][name].astype(np.float64)
                merged[name] = acc.astype(np.float32)
        model.load_state_dict({k: torch.from_numpy(v) for k, v in merged.items()})
    return state_to_numpy(model)


def _server_layers(variant: str) -> tuple[int, ...]:
    # mlp 13-32-16-2 as layers 0 (Linear) 1 (ReLU) 2 (Linear) 3 (ReLU) 4 (Linear); hidden1 cuts after 1, hidden2 after 3
    return (2, 4) if variant == "vanilla" else (2,)


class FewRows(SiteAgent):
    """A site that trains on its first `rows` training rows only (and says so at Join)."""

    rows = 5

    @staticmethod
    def first(data: Split, n: int) -> Split:
        return dataclasses.replace(data, x_train=data.x_train[:n], y_train=data.y_train[:n])

    def load_data(self, data):
        return self.first(super().load_data(data), self.rows)

    def advertised_rows(self):
        return {name: min(n, self.rows) for name, n in super().advertised_rows().items()}


def run_job(fed: Federation, job: str, timeout: float = 120) -> str:
    job_id = fed.admin().submit(job).job_id
    status = fed.wait_job(job_id, scaled(timeout))
    assert status == "completed", fed.store.job(job_id).message
    return job_id


@pytest.fixture
def three_sites(federation):
    return federation.start_sites(*SITES)


@pytest.mark.parametrize("variant,schedule,tau", [("u-shaped", "sequential", 0.0), ("vanilla", "splitfed", 0.0),
                                                  ("u-shaped", "splitfed", 1.0), ("vanilla", "synchronous", 0.0)])
def test_a_split_job_ends_with_the_in_process_schedule_s_model(three_sites, variant, schedule, tau):
    """Sequential hands the site-side weights on site by site; SplitFed averages the sites' copies by rows (here
    with each site's head trained logit-adjusted to its own labels)."""
    job = split_job(variant, schedule, tau=tau)
    job_id = run_job(three_sites, job)
    store = three_sites.store
    final = store.load_checkpoint(job_id, 2)
    expected = reference(job, SITES)
    assert sorted(final) == sorted(expected)   # the whole model: the sites' parts and the server's
    for name in expected:
        np.testing.assert_allclose(final[name], expected[name], rtol=1e-5, atol=1e-6, err_msg=name)
        if schedule == "synchronous":   # the same float operations in the same order: bit for bit
            assert final[name].tobytes() == expected[name].tobytes(), name
    rounds = store.rounds(job_id)
    assert [r.status for r in rounds] == ["closed", "closed"]
    events = {(e.round, e.site): e.status for e in store.site_events(job_id)}
    assert all(events[(r, s)] in ("submitted", "evaluated") for r in (1, 2) for s in SITES)
    evaluated = {(m.round, m.site) for m in store.metrics(job_id) if m.kind == "eval" and m.name == "accuracy"}
    assert evaluated == {(r, s) for r in (1, 2) for s in SITES}   # every site evaluates the joined model each epoch


def test_a_synchronous_site_with_fewer_rows_than_turns_steps_on_every_turn_s_sum(federation):
    """Site c keeps 5 rows, so in most of the epoch's turns its share is empty: it sends only its (empty) part of
    the sum, and steps on the others' sum as they do; the model is the in-process reference's, bit for bit (u-shaped,
    each site's head logit-adjusted to its own labels)."""
    federation.start_site("a")
    federation.start_site("b")
    federation.start_site("c", agent_cls=FewRows)
    federation.wait_online(*SITES)
    job = split_job("u-shaped", "synchronous", tau=1.0)
    job_id = run_job(federation, job)
    final, expected = federation.store.load_checkpoint(job_id, 2), reference(job, SITES, few={"c": FewRows.rows})
    assert sorted(final) == sorted(expected)
    assert all(final[n].tobytes() == expected[n].tobytes() for n in expected)
    turns = {(m.round, m.site): m.value for m in federation.store.metrics(job_id)
             if m.kind == "train" and m.name == "batches"}   # the turns in which the site had rows
    assert turns[(1, "c")] == turns[(2, "c")] == 5 and turns[(1, "a")] > 5


class SlowToFinish(SiteAgent):
    """A site whose training session waits `wait_s` before its SplitDone: a session longer than the online window."""

    wait_s = 0.0

    def split_stream(self, stub):
        stream = site_split.Stream(stub)
        ask = stream.ask

        def slow(message):
            if message.WhichOneof("body") == "done" and message.done.weights:
                time.sleep(self.wait_s)
            return ask(message)

        stream.ask = slow
        return stream


def test_a_training_session_longer_than_the_online_window_still_evaluates(federation):
    """The sites' only calls during an epoch are their sessions' messages: its end counts as their presence, so
    the evaluation that follows asks every site (it asked only the sites that had polled again since)."""
    federation.coordinator.engine.online_window_s = 1.5
    agent = type("Slow", (SlowToFinish,), {"wait_s": 2.0})
    for name in ("a", "b"):
        federation.start_site(name, agent_cls=agent)
    federation.wait_online("a", "b")
    job_id = run_job(federation, split_job("u-shaped", "synchronous", rounds=1, min_sites=2))
    evaluated = {m.site for m in federation.store.metrics(job_id) if m.kind == "eval" and m.name == "accuracy"}
    assert evaluated == {"a", "b"}


@pytest.mark.parametrize("case", ["turns", "share", "order"])
def test_a_malformed_synchronous_message_is_refused(federation, case):
    """A synchronous epoch over one raw site of 200 rows has 7 turns of 28 or 29 rows: an open that announces
    another number of turns, a batch that is not the site's share, and a sum before the turn's batch are refused."""
    site = federation.raw_site("d")
    site.join({"heart-disease": 200})
    job_id = federation.admin().submit(split_job("u-shaped", "synchronous", min_sites=1, rounds=1)).job_id
    task = site.next_task()
    assert task.kind == fpb.TASK_SPLIT_TRAIN and task.local_steps == 7   # ⌈200 / 32⌉
    site.fetch(task)

    def messages():
        yield fpb.SplitMessage(open=fpb.SplitOpen(task_id=task.task_id, job_id=task.job_id, round=task.round,
                                                  nonce=task.nonce, batches=8 if case == "turns" else 7))
        if case == "order":
            yield fpb.SplitMessage(sum=fpb.SplitSum(seq=0))
        yield fpb.SplitMessage(batch=fpb.SplitBatch(seq=0, activations=tensor_message(np.ones((32, 32), np.float32))))

    with pytest.raises(grpc.RpcError) as info:
        list(site.stub.Split(messages(), timeout=scaled(20)))
    expected = {"turns": "SplitOpen.batches 8: this synchronous epoch has 7 turns",
                "share": "turn 0's activations: shape [32, 32], expected [28, 32]",
                "order": "turn 0 takes a batch from this site next (28 row(s) its share this turn), not a sum"}[case]
    assert expected in info.value.details()
    if case == "turns":   # refused before the session opened: the task stands, and the site may open it again
        assert not federation.store.site_events(job_id)
        federation.admin().abort(job_id)
        return
    assert federation.wait_job(job_id, scaled(60)) == "failed"
    (event,) = [e for e in federation.store.site_events(job_id) if e.site == "d"]
    assert event.status == "rejected" and expected in event.reason


def test_a_synchronous_epoch_too_long_for_a_session_fails_the_job_naming_the_site(federation):
    """A site reporting the most rows Join takes (2**31) would make 67,108,864 turns of 32 rows: more than a session
    may have (and than a task's local_steps holds). The job fails at once, saying why; the engine stays free."""
    site = federation.raw_site("d")
    site.join({"heart-disease": 2**31})
    job_id = federation.admin().submit(split_job("u-shaped", "synchronous", min_sites=1, rounds=1)).job_id
    assert federation.wait_job(job_id, scaled(30)) == "failed"
    message = federation.store.job(job_id).message
    assert "would take 67108864 turns" in message and "site d reported 2147483648" in message, message
    assert federation.admin().jobs()   # the engine answers


@pytest.mark.parametrize("announced", [10, 9])
def test_an_evaluation_weighs_at_most_the_rows_its_site_reported(federation, announced):
    """d joined with 10 training rows, then pushes 10 batches of 256 rows through its evaluation session: its held-out
    metrics weigh 10 in the job's mean, as a federated job caps them (they weighed 2,560, and a claimed accuracy of
    1.0 set the job's mean). An evaluation session that sends more batches than it announced is refused at the
    first one too many, as a training session is (it was served to the end)."""
    federation.start_site("a")
    raw = federation.raw_site("d")
    raw.join({"heart-disease": 10})
    federation.wait_online("a", "d")
    job_id = federation.admin().submit(split_job("vanilla", "splitfed", rounds=1, min_sites=2)).job_id
    task = raw.next_task()
    assert task.kind == fpb.TASK_SPLIT_TRAIN
    raw.report(task, fpb.RESULT_FAILED, "sits this epoch out")
    task = raw.next_task(timeout=scaled(120))
    assert task.kind == fpb.TASK_SPLIT_EVALUATE
    raw.fetch(task)

    def messages():
        yield fpb.SplitMessage(open=fpb.SplitOpen(task_id=task.task_id, job_id=task.job_id, round=task.round,
                                                  nonce=task.nonce, batches=announced))
        for seq in range(10):
            yield fpb.SplitMessage(batch=fpb.SplitBatch(seq=seq, activations=tensor_message(
                np.zeros((256, 32), np.float32)), labels=tensor_message(np.zeros(256, np.int64))))
        yield fpb.SplitMessage(done=fpb.SplitDone(num_samples=2560, metrics={"accuracy": 1.0, "loss": 0.0}))

    if announced == 9:
        with pytest.raises(grpc.RpcError) as info:
            list(raw.stub.Split(messages(), timeout=scaled(60)))
        assert "batch 9 is out of order: expected batch 9 of the 9 the session announced" in info.value.details()
    else:
        list(raw.stub.Split(messages(), timeout=scaled(60)))
    federation.wait_job(job_id, scaled(120))
    weights = {m.site: m.value for m in federation.store.metrics(job_id)
               if m.kind == "eval" and m.name == "num_samples"}
    if announced == 9:
        assert "d" not in weights and weights["a"] > 10, weights
        (event,) = [e for e in federation.store.site_events(job_id) if e.site == "d" and e.status == "rejected"]
        assert "the session announced" in event.reason, event
    else:
        assert weights["d"] == 10 and weights["a"] > 10, weights


def test_job_show_download_and_a_seeded_rerun(three_sites, tmp_path, capsys):
    job = split_job("u-shaped", "splitfed", seed=11)
    first, second = run_job(three_sites, job), run_job(three_sites, job)
    a, b = three_sites.store.load_checkpoint(first, 2), three_sites.store.load_checkpoint(second, 2)
    assert all(a[k].tobytes() == b[k].tobytes() for k in a)   # the server's turns are fixed: bit for bit

    out = tmp_path / "model.safetensors"
    assert cli(["job", "download", first, "-o", str(out), *three_sites.cli_args()]) == 0
    downloaded = load_file(str(out))
    assert sorted(downloaded) == sorted(a) and all(downloaded[k].tobytes() == a[k].tobytes() for k in a)
    capsys.readouterr()
    assert cli(["job", "show", first, *three_sites.cli_args()]) == 0
    shown = capsys.readouterr().out
    assert "accuracy" in shown and "completed" in shown
    assert cli(["job", "metrics", first, "--format", "json", *three_sites.cli_args()]) == 0
    text = str(json.loads(capsys.readouterr().out))
    assert "site_compute_s" in text and "accuracy" in text and "hop_s_per_batch" in text
    png = tmp_path / "plot.png"
    assert cli(["job", "plot", first, "-o", str(png), *three_sites.cli_args()]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    metrics = three_sites.store.metrics(first)
    for epoch in (1, 2):   # a u-shaped batch is two calls to the worker, and one batch
        batches = sum(m.value for m in metrics if (m.round, m.kind, m.name) == (epoch, "train", "batches"))
        (counted,) = [m.value for m in metrics if (m.round, m.site, m.name) == (epoch, "", "server_batches")]
        assert counted == batches > 0
    wire = {m.name for m in metrics if m.kind == "wire"}
    assert wire == {"train_bytes_up", "train_bytes_down", "eval_bytes_up", "eval_bytes_down"}


def test_labels_never_reach_the_coordinator_in_a_u_shaped_split(three_sites, monkeypatch):
    seen: list[tuple[str, fpb.SplitMessage]] = []
    take = split_driver.Session.take

    def recording(self, message):
        seen.append((self.driver.cfg.split.variant, fpb.SplitMessage.FromString(message.SerializeToString())))
        return take(self, message)

    monkeypatch.setattr(split_driver.Session, "take", recording)
    run_job(three_sites, split_job("u-shaped", "splitfed", rounds=1))
    run_job(three_sites, split_job("vanilla", "splitfed", rounds=1))
    batches = {v: [m.batch for k, m in seen if k == v and m.WhichOneof("body") == "batch"] for v in CUTS}
    assert batches["u-shaped"] and batches["vanilla"]
    assert not any(b.HasField("labels") for b in batches["u-shaped"])
    assert all(list(b.activations.shape)[1:] == [32] for b in batches["u-shaped"])   # the cut, never the 13 inputs
    grads = [m.grad for k, m in seen if k == "u-shaped" and m.WhichOneof("body") == "grad"]
    assert grads and all(list(g.grad.shape)[1:] == [16] for g in grads)   # the loss's gradient at hidden2 only
    assert all(b.HasField("labels") for b in batches["vanilla"])   # the control: vanilla sends them


STALL_TIMEOUT_S = 3.0


class DropsMidEpoch(SiteAgent):
    """A site whose epoch-1 training session ends at its third batch: `how` "vanish" closes the stream (its end and
    a cancel, racing); "hang up" only ends its side of the stream, cleanly, without SplitDone; "stall" goes silent
    past split.batch_timeout_s after the server's forward (the server holding its turn meanwhile). Gone, it reports
    nothing."""

    how = "vanish"

    def report(self, stub, task, status, reason="", eval_metrics=None):
        if task.kind == fpb.TASK_SPLIT_TRAIN and task.round == 1:
            return None
        return super().report(stub, task, status, reason, eval_metrics)

    def split_stream(self, stub):
        stream, how = site_split.Stream(stub), self.how
        ask = stream.ask

        def failing(message):
            body = message.WhichOneof("body")
            if body == "open":
                stream.epoch = message.open.round
            if body == "batch" and message.batch.seq == 2 and stream.epoch == 1:   # evaluation: one batch
                if how == "stall":
                    ask(message)   # the forward: the server now holds its turn for this batch
                    with contextlib.suppress(StopIteration, grpc.RpcError):   # silent until the coordinator gives
                        next(stream._replies)   # up on it (split.batch_timeout_s) and ends the call
                if how == "hang up":   # the end of its requests, and no cancel: the coordinator sees the stream end
                    stream._out.put(None)
                    with contextlib.suppress(StopIteration, grpc.RpcError):
                        next(stream._replies)
                raise RuntimeError(f"the site {how.replace(' ', 's ')} (test)")
            return ask(message)

        stream.epoch = 0
        stream.ask = failing
        return stream


@pytest.mark.parametrize("schedule,how", [("splitfed", "vanish"), ("splitfed", "hang up"), ("splitfed", "stall"),
                                          ("synchronous", "vanish"), ("synchronous", "stall")])
def test_a_site_dropping_mid_epoch_is_recorded_and_the_epoch_goes_on(federation, schedule, how):
    """Synchronous: the others' turns wait for the dropped site only until it is out (a stalled site's gradient,
    owed for rows already through the server's forward, counts as zero)."""
    agent = type("Drops", (DropsMidEpoch,), {"how": how})
    for name in SITES:
        federation.start_site(name, agent_cls=agent if name == "b" else SiteAgent)
    federation.wait_online(*SITES)
    # Only the stalling run needs a short split.batch_timeout_s; the others keep the default, so a loaded machine
    # cannot make a healthy site look silent.
    timeout = STALL_TIMEOUT_S if how == "stall" else 60.0
    job_id = run_job(federation, split_job("u-shaped", schedule, timeout=timeout, min_sites=3))
    events = federation.store.site_events(job_id)
    outcomes = {(r, s): sorted(e.status for e in events if (e.round, e.site) == (r, s)) for r in (1, 2) for s in SITES}
    (dropped,) = [e for e in events if (e.round, e.site, e.status) == (1, "b", "failed")]
    unit = "batch(es)" if schedule == "splitfed" else "turn(s)"
    if how != "stall":   # recorded failed (a drop), not rejected, however the stream ended
        assert f"the Split session ended after 2 {unit}" in dropped.reason, dropped
    else:   # silent after batch 2's forward, the server holding its turn: the others went on after the timeout
        assert f"ended after {3 if schedule == 'splitfed' else 2} {unit}" in dropped.reason
        assert f"did not arrive within {STALL_TIMEOUT_S:g} s" in dropped.reason
        assert "split.batch_timeout_s" in dropped.reason
    assert outcomes[(1, "a")] == outcomes[(1, "c")] == ["evaluated", "submitted"]
    assert outcomes[(1, "b")] == ["evaluated", "failed"]   # it still evaluates the epoch's joined model
    assert outcomes[(2, "b")] == ["evaluated", "submitted"]   # and is back for the next epoch
    round1 = next(r for r in federation.store.rounds(job_id) if r.round == 1)
    assert sorted(json.loads(round1.contributors)) == ["a", "c"]


class RevokedMidEpoch(SiteAgent):
    """A site whose certificate is revoked (by the federation's operator, on the coordinator's CRL) just before its
    epoch-1 session sends batch 2."""

    pki_root: Path

    def split_stream(self, stub):
        stream = site_split.Stream(stub)
        ask = stream.ask

        def revoked_first(message):
            if message.WhichOneof("body") == "batch" and message.batch.seq == 2 and self.epoch == 1:
                pki.revoke(self.pki_root, "b")
            if message.WhichOneof("body") == "open":
                self.epoch = message.open.round
            return ask(message)

        self.epoch = 0
        stream.ask = revoked_first
        return stream


def test_a_site_revoked_mid_session_ends_it_and_the_epoch_goes_on(tmp_path):
    root = tmp_path / "pki"
    pki.init_federation(root, "split-revocation", hosts=["127.0.0.1"])
    for name in SITES:
        pki.add_site(root, name)
    pki.add_admin(root, "ops", role="operator")
    fed = Federation(root, tmp_path / "state")
    try:
        agent = type("Revoked", (RevokedMidEpoch,), {"pki_root": root})
        for name in SITES:
            fed.start_site(name, agent_cls=agent if name == "b" else SiteAgent)
        fed.wait_online(*SITES)
        job_id = run_job(fed, split_job("u-shaped", "splitfed", rounds=1, min_sites=2))
        events = fed.store.site_events(job_id)
        (dropped,) = [e for e in events if (e.round, e.site, e.status) == (1, "b", "failed")]
        assert "revoked" in dropped.reason, dropped
        assert sorted(e.site for e in events if e.round == 1 and e.status == "submitted") == ["a", "c"]
        assert "b" not in {e.site for e in events if e.status == "evaluated"}   # offline since: no evaluation
    finally:
        fed.close()


def test_aborting_a_split_job_mid_epoch_cuts_its_sessions_and_ends_its_compute_worker(three_sites):
    job_id = three_sites.admin().submit(split_job("u-shaped", "splitfed", rounds=500)).job_id
    engine = three_sites.coordinator.engine

    def training():
        driver = engine.driver
        phase = driver.phase if driver is not None else None
        return phase is not None and phase.kind == "train" and len(phase.sessions) == 3 and driver
    driver = wait_until(training, scaled(60), "the sites' sessions to open")
    pid = driver.worker.pid
    # Stopped, as a long batch would keep it: the abort ends its job at once, and the worker (told to end) once it
    # is through, without the engine's lock held meanwhile (it was, up to end_child's 10 s, before).
    os.kill(pid, signal.SIGSTOP)
    try:
        started = time.monotonic()
        three_sites.admin().abort(job_id)
        assert time.monotonic() - started < 5
        assert three_sites.store.job(job_id).status == "aborted"
        assert three_sites.admin().jobs()   # the engine answers meanwhile
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)
    wait_until(lambda: not os.path.exists(f"/proc/{pid}") or _zombie(pid), scaled(20), "the compute worker to end")
    # The sites are free at once for the next job, which runs to its end.
    run_job(three_sites, split_job("vanilla", "sequential", rounds=1))


def _zombie(pid: int) -> bool:
    with open(f"/proc/{pid}/stat") as fh:
        return fh.read().split(")")[-1].split()[0] == "Z"


def test_a_malformed_message_is_refused(federation):
    """A raw site answers its split task with labels in a u-shaped split: refused, recorded, and with no other
    site the epoch fails with that reason."""
    site = federation.raw_site("d")
    site.join({"heart-disease": 200})
    job_id = federation.admin().submit(split_job("u-shaped", "splitfed", min_sites=1, rounds=1)).job_id
    task = site.next_task()
    assert task.kind == fpb.TASK_SPLIT_TRAIN
    _, served = site.fetch(task)
    assert sorted(served) == ["layers.0.bias", "layers.0.weight", "layers.4.bias", "layers.4.weight"]

    def messages():
        yield fpb.SplitMessage(open=fpb.SplitOpen(task_id=task.task_id, job_id=task.job_id, round=task.round,
                                                  nonce=task.nonce, batches=1))
        yield fpb.SplitMessage(batch=fpb.SplitBatch(seq=0, activations=tensor_message(np.ones((4, 32), np.float32)),
                                                    labels=tensor_message(np.zeros(4, np.int64))))

    with pytest.raises(Exception) as info:
        list(site.stub.Split(messages(), timeout=scaled(20)))
    assert "keeps the labels at the site" in info.value.details()
    assert federation.wait_job(job_id, scaled(60)) == "failed"
    (event,) = [e for e in federation.store.site_events(job_id) if e.site == "d"]
    assert event.status == "rejected" and "labels" in event.reason
    assert "no site completed" in federation.store.job(job_id).message


def test_a_site_whose_policy_keeps_its_labels_declines_a_vanilla_split(federation):
    federation.start_site("a", split_variants=("u-shaped",))
    federation.start_site("b")
    federation.wait_online("a", "b")
    job_id = run_job(federation, split_job("vanilla", "sequential", min_sites=1, rounds=1))
    assert "split_variants allows u-shaped" in federation.store.declines(job_id)["a"]


def test_cuts_the_model_lacks_are_refused_at_submit(federation):
    with pytest.raises(grpc.RpcError) as info:
        federation.admin().submit(split_job("vanilla", "splitfed").replace("[hidden1]", "[hidden7]"))
    assert info.value.details() == "split: cut(s) ['hidden7'] are not among this model's: hidden1, hidden2"


def test_sigkill_mid_epoch_resumes_and_ends_bit_for_bit(tmp_path, procs):
    """Synchronous SplitFed (the resume path is the same for every schedule: the epoch restarts from the last
    closed epoch's checkpoint and the server optimizer's momentum)."""
    root = tmp_path / "pki"
    port, admin_kit, coord_cfg = cli_kits(root, "split-resume", ("a", "b"), allowed_models=("mlp",))
    addr = root / "coordinator" / "state" / "coordinator.addr"
    coordinator = procs.start("coordinator", "coordinator", "run", "--config", str(coord_cfg))
    for name in ("a", "b"):   # started beside the coordinator (a site dials until it listens): both import torch
        procs.start(f"site-{name}", "site", "run", "--config", str(root / "sites" / name / "site.yaml"),
                    "--threads", "1")
    wait_until(addr.exists, 60, "the coordinator to listen")
    address, epochs = f"127.0.0.1:{port}", 6
    job = split_job("u-shaped", "synchronous", rounds=epochs, min_sites=2, seed=3)
    with AdminClient(address, admin_kit) as client:
        wait_until(lambda: {s.site for s in client.sites() if s.online} == {"a", "b"}, 60, "both sites online")
        job_id = client.submit(job).job_id
        wait_until(lambda: client.job(job_id).summary.current_round >= 2, scaled(90), "epoch 2 to close")
    coordinator.send_signal(signal.SIGKILL)
    coordinator.wait(timeout=10)
    with sqlite3.connect(root / "coordinator" / "state" / "plexus.db") as db:
        open_ = db.execute("SELECT round FROM rounds WHERE job_id = ? AND status = 'open'", (job_id,)).fetchall()
    assert open_ and open_[0][0] < epochs, "no epoch was in progress at the kill; the test did not test resuming"
    addr.unlink()
    procs.start("coordinator-2", "coordinator", "run", "--config", str(coord_cfg))
    wait_until(addr.exists, 60, "the restarted coordinator to listen")
    with AdminClient(address, admin_kit) as client:
        wait_until(lambda: client.job(job_id).summary.status in ("completed", "failed"), scaled(180), "the job")
        detail = client.job(job_id)
        assert detail.summary.status == "completed", detail.summary.message
        assert detail.summary.current_round == epochs
        assert "job_resumed" in [e.kind for e in client.watch(job_id)]
        again = client.submit(job).job_id
        wait_until(lambda: client.job(again).summary.status == "completed", scaled(180), "the reference job")
        models = {}
        for which in (job_id, again):
            path = tmp_path / f"{which}.safetensors"
            assert cli(["job", "download", which, "-o", str(path), "--kit", str(admin_kit),
                        "--coordinator", address]) == 0
            models[which] = {k: v.tobytes() for k, v in load_file(str(path)).items()}
    assert models[job_id] == models[again]
