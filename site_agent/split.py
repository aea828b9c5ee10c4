"""The site's half of split learning: one Split session per task (plexus.split_wire says what travels).

A training task fetches the site's parts (the bottom, and u-shaped the head) as the coordinator holds them, trains
them over one epoch of this site's rows in seeded batches, the server part answering each batch, and sends the
parts back at the session's end. An evaluation task runs the joined model over the held-out rows. Raw rows never
leave the site; labels leave only in a vanilla split, which the site's policy.split_variants may refuse. Every
reply from the coordinator is checked (dtype, shape, finite) before it touches the model.
"""

from __future__ import annotations

import queue
import threading
import time

import grpc
import numpy as np
import torch
import torch.nn.functional as F

from plexus.config import MAX_TURNS, RoundConfig
from plexus.datasets import Split
from plexus.errors import IntegrityError
from plexus.models import build_job_model, load_numpy_state
from plexus.proto.plexus.v1 import federation_pb2 as fpb
from plexus.split import (
    SiteOptions,
    SiteStep,
    SplitParts,
    cut_shapes,
    num_classes,
    part_names,
    site_log_prior,
    split,
    turn_shares,
)
from plexus.split_wire import array_of, tensor_message, weights_of
from plexus.wire import Layout

EVAL_ROWS = 256   # rows per evaluation batch (the coordinator takes at most 256)
MAX_REPLY_S = 3660.0   # split.batch_timeout_s's largest value, and a minute


class Stream:
    """A Split call in lock-step: `ask` sends one message and returns the coordinator's reply to it. The call has
    no deadline of its own (an epoch takes as long as it takes): the coordinator bounds every message by
    split.batch_timeout_s, and the call ends when either side goes away. A reply that does not come within
    `reply_timeout_s` (the agent sets it from the job's batch_timeout_s) ends the call: a coordinator that stops
    answering, while its connection stays up, does not hold the site for ever."""

    def __init__(self, stub, reply_timeout_s: float = MAX_REPLY_S):
        self._out: queue.Queue = queue.Queue()
        self._replies = stub.Split(iter(self._out.get, None))
        self.bytes_up = self.bytes_down = 0
        self.reply_timeout_s = reply_timeout_s
        self._cv = threading.Condition()
        self._due: float | None = None
        self._closed = self._timed_out = False
        threading.Thread(target=self._watch, name="split-reply-watch", daemon=True).start()

    def _watch(self) -> None:
        with self._cv:
            while not self._closed:
                if self._due is None:
                    self._cv.wait()
                elif self._due <= time.monotonic():
                    self._timed_out = True
                    self._replies.cancel()
                    return
                else:
                    self._cv.wait(self._due - time.monotonic())

    def _next_reply(self) -> fpb.SplitReply:
        with self._cv:
            self._due = time.monotonic() + self.reply_timeout_s
            self._cv.notify()
        try:
            reply = next(self._replies, None)
        except grpc.RpcError:
            if self._timed_out:
                raise IntegrityError(f"the coordinator did not answer within {self.reply_timeout_s:.0f} s; the Split "
                                     "session is given up") from None
            raise
        finally:
            with self._cv:
                self._due = None
        if reply is None:
            raise IntegrityError("the coordinator ended the Split session without answering")
        return reply

    def ask(self, message: fpb.SplitMessage) -> fpb.SplitReply:
        self.bytes_up += message.ByteSize()
        self._out.put(message)
        reply = self._next_reply()
        self.bytes_down += reply.ByteSize()
        return reply

    def close(self) -> None:
        self._out.put(None)
        self._replies.cancel()
        with self._cv:
            self._closed = True
            self._cv.notify()


class SiteSplit:
    """The job's model cut as the job says, the site's parts loaded from what the coordinator served."""

    def __init__(self, job: RoundConfig):
        self.job, spec = job, job.split
        self.model = build_job_model(job)
        self.parts: SplitParts = split(self.model, spec.variant, list(spec.cuts))
        self.site_names, _ = part_names(self.model, self.parts)
        self.row_shape, self.out_shape = cut_shapes(self.model, self.parts)
        self.classes = num_classes(self.model)
        state = self.model.state_dict()
        self.layout = Layout.of({n: state[n].detach().numpy() for n in self.site_names})

    def load(self, served: dict[str, np.ndarray]) -> None:
        state = self.model.state_dict()
        full = {n: t.detach().numpy() for n, t in state.items()}
        full.update({n: served[n] for n in self.site_names})
        load_numpy_state(self.model, full)

    def weights(self) -> list[fpb.TensorData]:
        state = self.model.state_dict()
        return [tensor_message(state[n].detach().numpy(), n) for n in self.site_names]


def train_session(stream: Stream, site: SiteSplit, data: Split, task) -> dict[str, float]:
    """One epoch of this site's rows through the server; the parts go back at the end. Returns the train metrics."""
    if site.job.split.schedule == "synchronous":
        return synchronous_session(stream, site, data, task)
    job = site.job
    x, y = _tensors(data.x_train, data.y_train)
    generator = torch.Generator().manual_seed(task.seed)
    step = _site_step(site, y, generator)
    order = torch.randperm(len(x), generator=generator)
    batches = [order[k:k + job.train.batch_size] for k in range(0, len(x), job.train.batch_size)]
    _open(stream, task, len(batches))
    compute, losses = 0.0, []
    for seq, rows in enumerate(batches):
        grad, loss, spent = _through_server(stream, site, step, x[rows], y[rows], seq)
        started = time.perf_counter()
        step.backward(grad)
        compute += spent + time.perf_counter() - started
        losses.append(float(loss) * len(rows))
    metrics = {"train_loss": sum(losses) / max(1, len(x)), "site_compute_s": compute, "batches": float(len(batches))}
    stream.ask(fpb.SplitMessage(done=fpb.SplitDone(num_samples=len(x), metrics=metrics, weights=site.weights())))
    return metrics


def synchronous_session(stream: Stream, site: SiteSplit, data: Split, task) -> dict[str, float]:
    """Synchronous SplitFed (coordinator/drivers/split_sync.py): the epoch's turns (the task's local_steps), each
    over this site's share of its rows; the site steps on every site's summed gradients of their parts, as
    plexus.split.synchronous_epoch does in process."""
    turns = task.local_steps
    if not 1 <= turns <= MAX_TURNS:
        raise IntegrityError(f"a synchronous split task names its epoch's turns (1 to {MAX_TURNS}) in local_steps; "
                             f"this one names {turns}")
    x, y = _tensors(data.x_train, data.y_train)
    generator = torch.Generator().manual_seed(task.seed)
    step = _site_step(site, y, generator)
    shapes = {name: tuple(p.shape) for name, p in step.named_parameters()}
    _open(stream, task, turns)
    compute, losses, active = 0.0, 0.0, 0
    for seq, rows in enumerate(turn_shares(len(x), turns, generator)):
        sent = fpb.SplitSum(seq=seq)
        if len(rows):
            active += 1
            grad, loss, spent = _through_server(stream, site, step, x[rows], y[rows], seq, synchronous=True)
            started = time.perf_counter()
            step.backward(grad, step=False)
            compute += spent + time.perf_counter() - started
            sent.grads.extend(tensor_message(g.numpy(), name) for name, g in step.gradients().items())
            losses += float(loss) * len(rows)
        reply = _reply(stream.ask(fpb.SplitMessage(sum=sent)), seq)
        summed = weights_of(reply.grads, shapes, what=f"turn {seq}'s summed gradients") if reply.grads else None
        started = time.perf_counter()
        step.apply({n: torch.from_numpy(g.copy()) for n, g in summed.items()} if summed is not None else None)
        compute += time.perf_counter() - started
    metrics = {"train_loss": losses / max(1, len(x)), "site_compute_s": compute, "batches": float(active)}
    stream.ask(fpb.SplitMessage(done=fpb.SplitDone(num_samples=len(x), metrics=metrics, weights=site.weights())))
    return metrics


def _through_server(stream: Stream, site: SiteSplit, step: SiteStep, x: torch.Tensor, y: torch.Tensor, seq: int, *,
                    synchronous: bool = False) -> tuple[torch.Tensor, float, float]:
    """One batch's exchange with the server part: the activations (vanilla: and labels) up, and u-shaped the head's
    loss on the server's output, whose gradient goes up next (synchronous: the loss weighted by this site's share
    of the turn's rows, which the reply says). (The gradient at the cut, the loss, the site's compute seconds.)"""
    started = time.perf_counter()
    a = step.forward(x)
    compute = time.perf_counter() - started
    batch = fpb.SplitBatch(seq=seq, activations=tensor_message(a.numpy()))
    if site.parts.head is None:   # vanilla
        batch.labels.CopyFrom(tensor_message(y.numpy()))
        reply = _reply(stream.ask(fpb.SplitMessage(batch=batch)), seq)
        return _tensor(reply, "the gradient at the cut", tuple(a.shape)), reply.loss, compute
    reply = _reply(stream.ask(fpb.SplitMessage(batch=batch)), seq)
    out = _tensor(reply, "the server part's output", (len(x), *site.out_shape))
    weight = 1.0
    if synchronous:
        if reply.turn_rows < len(x):
            raise IntegrityError(f"the coordinator says turn {seq} holds {reply.turn_rows} rows, fewer than this "
                                 f"site's {len(x)}")
        weight = len(x) / reply.turn_rows
    started = time.perf_counter()
    grad_out, loss = step.loss(out, y, weight)
    compute += time.perf_counter() - started
    reply = _reply(stream.ask(fpb.SplitMessage(grad=fpb.SplitGrad(seq=seq, grad=tensor_message(grad_out.numpy())))),
                   seq)
    return _tensor(reply, "the gradient at the cut", tuple(a.shape)), loss, compute


def _site_step(site: SiteSplit, y: torch.Tensor, generator: torch.Generator) -> SiteStep:
    """This task's SiteStep: a new SGD over the site's parts (its state never leaves the site), the job's privacy
    options, and the generator of its batches and its activation noise."""
    job, parts = site.job, site.parts
    opt, spec = job.train.optimizer, job.split
    params = [p for m in parts.site_modules for p in m.parameters()]
    options = SiteOptions(spec.nopeek, spec.noise_std, spec.logit_adjustment)
    return SiteStep(parts, torch.optim.SGD(params, lr=opt.lr, momentum=opt.momentum, weight_decay=opt.weight_decay),
                    options, generator=generator, log_prior=site_log_prior(options, y, site.classes))


def evaluate_session(stream: Stream, site: SiteSplit, data: Split, task) -> dict[str, float]:
    """The joined model on the held-out rows: the site's parts here, the server's part there."""
    parts, spec = site.parts, site.job.split
    x, y = _tensors(data.x_test, data.y_test)
    if len(x) == 0:
        raise ValueError("no held-out rows to evaluate the joined model on")
    starts = list(range(0, len(x), EVAL_ROWS))
    _open(stream, task, len(starts))
    generator = torch.Generator().manual_seed(task.seed)
    loss_sum, correct = 0.0, 0
    for module in parts.site_modules:
        module.eval()
    with torch.no_grad():
        for seq, k in enumerate(starts):
            xb, yb = x[k:k + EVAL_ROWS], y[k:k + EVAL_ROWS]
            a = parts.bottom(xb)
            if spec.noise_std:   # activations that leave the site are noised in evaluation too
                a = a + spec.noise_std * torch.randn(a.shape, generator=generator, dtype=a.dtype)
            sent = fpb.SplitBatch(seq=seq, activations=tensor_message(a.numpy()))
            if parts.head is None:
                sent.labels.CopyFrom(tensor_message(yb.numpy()))
                reply = _reply(stream.ask(fpb.SplitMessage(batch=sent)), seq)
                loss_sum += reply.loss
                correct += reply.correct
                continue
            out = _tensor(_reply(stream.ask(fpb.SplitMessage(batch=sent)), seq), "the server part's output",
                          (len(xb), *site.out_shape))
            logits = parts.head(out)
            loss_sum += float(F.cross_entropy(logits, yb, reduction="sum"))
            correct += int((logits.argmax(1) == yb).sum())
    metrics = {"loss": loss_sum / len(x), "accuracy": correct / len(x), "num_samples": float(len(x))}
    stream.ask(fpb.SplitMessage(done=fpb.SplitDone(num_samples=len(x), metrics=metrics)))
    return metrics


def _open(stream: Stream, task, batches: int) -> None:
    stream.ask(fpb.SplitMessage(open=fpb.SplitOpen(task_id=task.task_id, job_id=task.job_id, round=task.round,
                                                   nonce=task.nonce, batches=batches)))


def _reply(reply: fpb.SplitReply, seq: int) -> fpb.SplitReply:
    if reply.seq != seq:
        raise IntegrityError(f"the coordinator answered batch {reply.seq}; this site sent batch {seq}")
    return reply


def _tensor(reply: fpb.SplitReply, what: str, shape: tuple[int, ...]) -> torch.Tensor:
    """A reply's tensor, refused unless float32 of exactly `shape` and finite."""
    if not reply.HasField("tensor"):
        raise IntegrityError(f"the coordinator's reply to batch {reply.seq} carries no tensor ({what})")
    return torch.from_numpy(array_of(reply.tensor, dtype="F32", what=f"{what} for batch {reply.seq}",
                                     shape=shape).copy())


def _tensors(x: np.ndarray, y: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows as tensors of their own (the loaded dataset's arrays are read-only, which torch warns about)."""
    return torch.from_numpy(np.array(x, dtype=np.float32)), torch.from_numpy(np.array(y, dtype=np.int64))
