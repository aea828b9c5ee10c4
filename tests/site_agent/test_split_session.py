"""The site's half of a Split session, against an in-process server (plexus.split's ServerStep) behind a stream
that answers as the coordinator would: one epoch trains the site's parts as train_batch does in process; a reply
that is malformed (shape, NaN, another batch, no tensor) is refused before it touches the site's parts."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from plexus.config import parse_round_config
from plexus.datasets import Split
from plexus.errors import IntegrityError
from plexus.models import state_to_numpy
from plexus.proto.plexus.v1 import federation_pb2 as fpb
from plexus.split import ServerStep, SiteOptions, SiteStep, label_log_prior, split, train_batch
from plexus.split_wire import array_of, tensor_message
from site_agent.split import SiteSplit, evaluate_session, train_session

JOB = """\
name: s
model: {{name: mlp, args: {{in_features: 6, hidden: [8, 4], num_classes: 3}}}}
data: {{dataset: d}}
rounds: 1
mode: split
split: {{variant: {variant}, cuts: {cuts}, nopeek: {nopeek}, noise_std: {noise}, logit_adjustment: {tau}}}
train: {{batch_size: 5, optimizer: {{name: sgd, lr: 0.2}}}}
seed: 4
"""
CUTS = {"vanilla": "[hidden1]", "u-shaped": "[hidden1, hidden2]"}
TASK = SimpleNamespace(task_id="t", job_id="j", round=1, nonce=b"n" * 16, seed=77)


def data(rows=13, seed=0) -> Split:
    g = np.random.default_rng(seed)
    x, y = g.normal(size=(rows, 6)).astype(np.float32), g.integers(0, 3, rows)
    return Split(x_train=x, y_train=y, x_test=x[:7], y_test=y[:7], num_classes=3, feature_names=tuple("abcdef"))


class InProcess:
    """Answers a session's messages with a ServerStep, as the coordinator's Session does; `spoil(reply, n)` may
    damage the n-th reply that carries a tensor."""

    def __init__(self, server: ServerStep, spoil=None):
        self.server, self.spoil, self.sent, self.tensors = server, spoil, [], 0

    def ask(self, message: fpb.SplitMessage) -> fpb.SplitReply:
        self.sent.append(message)
        body = message.WhichOneof("body")
        if body in ("open", "done"):
            return fpb.SplitReply(message=body)
        if body == "batch":
            b = message.batch
            a = torch.from_numpy(array_of(b.activations, dtype="F32", what="a").copy())
            if b.HasField("labels"):
                grad, loss = self.server.vanilla(a, torch.from_numpy(array_of(b.labels, dtype="I64", what="y").copy()))
                reply = fpb.SplitReply(seq=b.seq, tensor=tensor_message(grad.numpy()), loss=loss)
            else:
                reply = fpb.SplitReply(seq=b.seq, tensor=tensor_message(self.server.forward(a).numpy()))
        else:
            g = torch.from_numpy(array_of(message.grad.grad, dtype="F32", what="g").copy())
            reply = fpb.SplitReply(seq=message.grad.seq, tensor=tensor_message(self.server.backward(g).numpy()))
        self.tensors += 1
        return self.spoil(reply, self.tensors) if self.spoil else reply


def server_for(site: SiteSplit) -> ServerStep:
    model = copy.deepcopy(site.model)
    parts = split(model, site.job.split.variant, list(site.job.split.cuts))
    return ServerStep(parts, torch.optim.SGD(parts.middle.parameters(), lr=0.2))


@pytest.mark.parametrize("variant,nopeek,noise,tau", [
    ("vanilla", 0.0, 0.0, 0.0), ("u-shaped", 0.0, 0.0, 0.0), ("vanilla", 0.5, 0.1, 0.0), ("u-shaped", 0.5, 0.1, 0.0),
    ("u-shaped", 0.0, 0.0, 1.0)], ids=["vanilla", "u-shaped", "vanilla-nopeek-noise", "u-shaped-nopeek-noise",
                                       "u-shaped-logit-adjustment"])
def test_one_epoch_through_the_session_trains_as_in_process(variant, nopeek, noise, tau):
    """With NoPeek and noise on, or logit adjustment (from the site's own labels), the session still does what
    plexus.split's SiteStep does with those options."""
    job = parse_round_config(JOB.format(variant=variant, cuts=CUTS[variant], nopeek=nopeek, noise=noise, tau=tau))
    site, d = SiteSplit(job), data()
    reference = SiteSplit(job)
    stream = InProcess(server_for(site))
    metrics = train_session(stream, site, d, TASK)
    assert metrics["batches"] == 3 and metrics["site_compute_s"] > 0

    # The same batches in process: the same seed orders them, one server part answers.
    parts, server = reference.parts, server_for(reference)
    generator = torch.Generator().manual_seed(TASK.seed)
    x, y = torch.from_numpy(d.x_train), torch.from_numpy(d.y_train)
    step = SiteStep(parts, torch.optim.SGD([p for m in parts.site_modules for p in m.parameters()], lr=0.2),
                    SiteOptions(nopeek, noise, tau), generator=generator,
                    log_prior=label_log_prior(y, 3) if tau else None)
    order = torch.randperm(len(x), generator=generator)
    for k in range(0, len(x), 5):
        train_batch(step, server, x[order[k:k + 5]], y[order[k:k + 5]])
    mine, theirs = state_to_numpy(site.model), state_to_numpy(reference.model)
    for name in site.site_names:
        np.testing.assert_allclose(mine[name], theirs[name], rtol=1e-6, atol=1e-7)
    done = stream.sent[-1].done
    assert done.num_samples == 13 and sorted(w.name for w in done.weights) == site.site_names
    labels_sent = any(m.WhichOneof("body") == "batch" and m.batch.HasField("labels") for m in stream.sent)
    assert labels_sent == (variant == "vanilla")   # u-shaped: the labels stay
    if noise:   # what left the site is not the bottom part's output
        first = stream.sent[1].batch
        sent = array_of(first.activations, dtype="F32", what="a")
        with torch.no_grad():
            clean = SiteSplit(job).parts.bottom(x[order[:5]]).numpy()
        assert not np.allclose(sent, clean, atol=1e-3)


def _wrong_shape(reply, n):
    a = array_of(reply.tensor, dtype="F32", what="t")
    reply.tensor.CopyFrom(tensor_message(a[:, :-1]))
    return reply


def _nan(reply, n):
    a = array_of(reply.tensor, dtype="F32", what="t").copy()
    a[0, 0] = np.nan
    reply.tensor.CopyFrom(tensor_message(a))
    return reply


@pytest.mark.parametrize("variant", ["vanilla", "u-shaped"])
@pytest.mark.parametrize("spoil,error", [
    (_wrong_shape, "shape"), (_nan, "NaN or Inf"),
    (lambda r, n: fpb.SplitReply(seq=r.seq + 1, tensor=r.tensor), "answered batch 1; this site sent batch 0"),
    (lambda r, n: fpb.SplitReply(seq=r.seq), "carries no tensor"),
])
def test_a_malformed_reply_is_refused_before_it_touches_the_site_s_parts(variant, spoil, error):
    job = parse_round_config(JOB.format(variant=variant, cuts=CUTS[variant], nopeek=0, noise=0, tau=0))
    site = SiteSplit(job)
    before = state_to_numpy(site.model)
    with pytest.raises(IntegrityError, match=error):
        train_session(InProcess(server_for(site), spoil), site, data(), TASK)
    after = state_to_numpy(site.model)
    assert all(np.array_equal(before[k], after[k]) for k in before)


@pytest.mark.parametrize("variant", ["vanilla", "u-shaped"])
def test_evaluation_runs_the_joined_model(variant):
    job = parse_round_config(JOB.format(variant=variant, cuts=CUTS[variant], nopeek=0, noise=0, tau=0))
    site, d = SiteSplit(job), data()

    class Evaluator(InProcess):   # the coordinator's evaluate/infer: no step
        def ask(self, message):
            if message.WhichOneof("body") != "batch":
                return fpb.SplitReply(message="ok")
            b = message.batch
            a = torch.from_numpy(array_of(b.activations, dtype="F32", what="a").copy())
            with torch.no_grad():
                out = self.server.parts.middle(a)
            if b.HasField("labels"):
                y = torch.from_numpy(array_of(b.labels, dtype="I64", what="y").copy())
                return fpb.SplitReply(seq=b.seq, loss=float(torch.nn.functional.cross_entropy(out, y, reduction="sum")),
                                      correct=int((out.argmax(1) == y).sum()))
            return fpb.SplitReply(seq=b.seq, tensor=tensor_message(out.numpy()))

    metrics = evaluate_session(Evaluator(server_for(site)), site, d, TASK)
    with torch.no_grad():
        logits = site.model(torch.from_numpy(d.x_test))
    expected = float((logits.argmax(1) == torch.from_numpy(d.y_test)).double().mean())
    assert metrics["accuracy"] == pytest.approx(expected) and metrics["num_samples"] == 7
    assert metrics["loss"] == pytest.approx(float(torch.nn.functional.cross_entropy(logits, torch.from_numpy(
        d.y_test))), rel=1e-5)
