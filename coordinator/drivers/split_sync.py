"""Synchronous SplitFed (`split.schedule: synchronous`): every site's rows in every server step.

SplitFed as the `splitfed` schedule runs it gives the server part one site's batch at a time, and lets each site's
parts drift on its own labels for a whole epoch; on label-skewed sites that costs 4 to 5 points against pooled
training (bench/split_gap.py). Here each of the epoch's ⌈rows / train.batch_size⌉ turns takes every site's share of
the turn (its rows cut into that many consecutive shares, `plexus.split.turn_shares`, so a share is proportional to
the site's rows), and the turn runs in three exchanges, each a barrier across the sites still in the epoch:

1. activations up: the server part runs forward once on the turn's activations, concatenated in site-name order,
   and each site gets its slice of the output and the turn's rows (vanilla: the server computes the loss over the
   whole turn, steps, and each site gets its slice of the gradient at the cut);
2. u-shaped: the gradient at that output up, each site's loss weighted by its share of the turn's rows; the server
   part runs backward once, steps, and each site gets its slice of the gradient at the cut;
3. the gradients of the site's parts up (`SplitSum`); every site gets their sum and steps on it, so every site's
   parts stay equal: the step one unsplit model takes on the turn's rows (`plexus.split.synchronous_epoch` is the
   in-process reference, and the integration tests check the federation against it).

A site whose share of a turn is empty sends only its (empty) `SplitSum` and steps on the sum. A site that drops is
out of the epoch's remaining turns: a gradient it owed for rows already through the server's forward counts as
zero. The coordinator sees each site's per-turn gradient of its parts, besides what every split schedule shows it
(docs/split-learning.md).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import numpy as np

from coordinator.drivers.split import Session
from plexus.errors import IntegrityError, Reason, RoundClosed
from plexus.proto.plexus.v1 import federation_pb2 as fpb
from plexus.split_wire import array_of, tensor_message, weights_of

log = logging.getLogger("plexus.coordinator")

STAGES = {"u-shaped": ("forward", "backward", "sum"), "vanilla": ("vanilla", "sum")}
MAX_SITES = 4096   # the compute worker takes train.batch_size + this many rows at once (a turn's shares round up)


def share(rows: int, turns: int, t: int) -> int:
    """Rows in turn t of a site with `rows` rows over `turns` turns (plexus.split.turn_shares' sizes)."""
    return (t + 1) * rows // turns - t * rows // turns


class Rendezvous:
    """The turns of one synchronous epoch. Each stage of a turn waits for every site it expects (live sites with
    rows this turn for a forward, those whose rows the forward holds for a backward, every live site for the sum);
    a thread of a site that has sent its own runs the stage once all are in (`run`, outside the lock), and each site
    takes its result. `run(stage, inputs by site, fed)` returns (results by site, fed), `fed` being the (site, rows)
    the pending forward holds, in order."""

    def __init__(self, rows: dict[str, int], turns: int, stages: tuple[str, ...],
                 run: Callable[[str, dict, list], tuple[dict, list]]):
        self.rows, self.turns, self.stages, self._run = dict(rows), turns, stages, run
        self.order = sorted(rows)
        self.gone: set[str] = set()
        self.t, self._s = 0, 0
        self._inbox: dict[str, dict[str, object]] = {stage: {} for stage in stages}
        self._out: dict[str, tuple[int, str, object]] = {}   # site -> (turn, stage, result) until the site takes it
        self._fed: list[tuple[str, int]] = []
        self._running = False
        self._cv = threading.Condition()

    @property
    def stage(self) -> str | None:
        return self.stages[self._s] if self.t < self.turns else None

    def share(self, site: str, t: int) -> int:
        return share(self.rows[site], self.turns, t)

    def put(self, site: str, seq: int, stage: str, payload, cut: Callable[[], BaseException | None]):
        """Send `site`'s part of stage `stage` of turn `seq`, and wait for its result (the stage's error, should
        running it fail). `cut()` returning an error ends the wait with it."""
        with self._cv:
            if site in self.gone:
                raise RoundClosed(f"site {site} is out of this epoch's turns")
            current = self.stage
            if seq != self.t or current is None or stage not in self.stages or self.stages.index(stage) < self._s \
                    or site not in self._eligible(stage) or site in self._inbox[stage]:
                raise IntegrityError(f"turn {seq} {stage} from site {site} is out of order: the turns are at turn "
                                     f"{self.t} {current or '(all done)'}", reason=Reason.LAYOUT)
            self._inbox[stage][site] = payload
            self._cv.notify_all()
            while True:
                mine = self._out.get(site)
                if mine is not None and mine[:2] == (seq, stage):
                    del self._out[site]
                    if isinstance(mine[2], BaseException):
                        raise mine[2]
                    return mine[2]
                if site in self.gone:
                    raise RoundClosed(f"site {site} is out of this epoch's turns")
                if (exc := cut()) is not None:
                    raise exc
                if not self._running and self._ready():
                    self._step()
                    continue
                self._cv.wait(0.5)

    def leave(self, site: str) -> None:
        """The site is out of the epoch: no stage waits for it again, and what it sent to stages not yet run goes."""
        with self._cv:
            self.gone.add(site)
            for inbox in self._inbox.values():
                inbox.pop(site, None)
            self._out.pop(site, None)
            self._skip()
            self._cv.notify_all()

    def wake(self) -> None:
        with self._cv:
            self._cv.notify_all()

    def _eligible(self, stage: str) -> list[str]:
        live = [s for s in self.order if s not in self.gone]
        if stage in ("forward", "vanilla"):
            return [s for s in live if self.share(s, self.t)]
        if stage == "backward":
            fed = {s for s, _ in self._fed}
            return [s for s in live if s in fed]
        return live

    def _ready(self) -> bool:
        stage = self.stage
        expected = self._eligible(stage) if stage is not None else []
        return bool(expected) and all(s in self._inbox[stage] for s in expected)

    def _step(self) -> None:
        """Run the current stage (the lock released meanwhile), hand out its results, move to the next stage."""
        stage, t, inputs = self.stage, self.t, dict(self._inbox[self.stage])
        self._running = True
        self._cv.release()
        try:
            results, fed = self._run(stage, inputs, list(self._fed))
        except Exception as exc:   # every site waiting on the stage gets an error of its own (its session ends)
            log.warning("synchronous split turn %d: the %s at the server failed: %s", t, stage, exc)
            results = {s: RoundClosed(f"turn {t}'s {stage} at the server failed: {exc}") for s in inputs}
            fed = []
        finally:
            self._cv.acquire()
            self._running = False
        for site, result in results.items():
            if site not in self.gone:
                self._out[site] = (t, stage, result)
        self._fed = fed
        self._advance()
        self._skip()
        self._cv.notify_all()

    def _advance(self) -> None:
        self._inbox[self.stage].clear()
        self._s += 1
        if self._s == len(self.stages):
            self.t, self._s, self._fed = self.t + 1, 0, []

    def _skip(self) -> None:
        """Move past stages no site is left to take part in (a turn whose live sites have no rows runs no forward;
        a backward whose sites all dropped runs none, and the server does not step)."""
        if not self._running and all(s in self.gone for s in self.order):
            self.t, self._s, self._fed = self.turns, 0, []   # no one left: the epoch's turns are over, at once
            return
        while not self._running and self.stage is not None and not self._eligible(self.stage):
            self._advance()


class SyncSession(Session):
    """A site's training session under synchronous SplitFed: each turn its share's activations (none when its
    share is empty), u-shaped the gradient at the server part's output, then its gradients of its parts; each is
    checked here (shape, dtype, finite, labels in range), so one site's bad message is that site's alone, and
    answered once the turn's stage has run (Rendezvous)."""

    def __init__(self, driver, site: str, grant, turns: int, cut: Callable[[BaseException], None],
                 rendezvous: Rendezvous):
        super().__init__(driver, site, grant, turns, cut, None)
        self.rendezvous = rendezvous
        self.unit = "turn(s)"
        self.expect = "batch"    # what this turn takes next: "batch", "grad" or "sum"
        self.share = 0           # rows in this turn's share

    def take(self, message: fpb.SplitMessage) -> fpb.SplitReply:
        self.bytes_up += message.ByteSize()
        body = message.WhichOneof("body")
        if body == "done":
            if self.expect != "batch":
                raise IntegrityError(f"the session ended in the middle of turn {self.seq}", reason=Reason.LAYOUT)
            reply = self._done(message.done)
        elif body in ("batch", "grad", "sum"):
            part = getattr(message, body)
            self._check_turn(body, part.seq)
            reply = getattr(self, f"_turn_{body}")(part)
        else:
            raise IntegrityError(f"a synchronous Split session takes batches, gradients, sums and its end; got "
                                 f"{body or 'nothing'}", reason=Reason.LAYOUT)
        self.bytes_down += reply.ByteSize()
        return reply

    def _check_turn(self, body: str, seq: int) -> None:
        if seq != self.seq or self.seq >= self.batches:
            raise IntegrityError(f"a {body} for turn {seq}: this session is at turn {self.seq} of {self.batches}",
                                 reason=Reason.LAYOUT)
        if self.expect == "batch":
            self.share = self.rendezvous.share(self.site, self.seq)
            if self.share == 0:
                self.expect = "sum"   # a share with no rows: only the sum, this turn
        if body != self.expect:
            raise IntegrityError(f"turn {seq} takes {'a' if self.expect != 'grad' else 'the'} {self.expect} from "
                                 f"this site next ({self.share} row(s) its share this turn), not a {body}",
                                 reason=Reason.LAYOUT)

    def _put(self, stage: str, payload):
        return self.rendezvous.put(self.site, self.seq, stage, payload, lambda: self._cut)

    def _turn_batch(self, batch: fpb.SplitBatch) -> fpb.SplitReply:
        driver, n = self.driver, self.share
        activations = array_of(batch.activations, dtype="F32", what=f"turn {batch.seq}'s activations",
                               shape=(n, *driver.row_shape))
        self.rows += n
        if self.vanilla:
            if not batch.HasField("labels"):
                raise IntegrityError(f"turn {batch.seq}: a vanilla split sends the labels with the activations",
                                     reason=Reason.LAYOUT)
            labels = array_of(batch.labels, dtype="I64", what=f"turn {batch.seq}'s labels", shape=(n,))
            if labels.min() < 0 or labels.max() >= driver.classes:
                raise IntegrityError(f"turn {batch.seq}'s labels must be class indices in [0, {driver.classes})",
                                     reason=Reason.LAYOUT)
            grad, loss = self._put("vanilla", (activations, labels))
            self.expect = "sum"
            return fpb.SplitReply(seq=batch.seq, tensor=tensor_message(grad), loss=loss)
        if batch.HasField("labels"):
            raise IntegrityError(f"turn {batch.seq}: a u-shaped split keeps the labels at the site; this session "
                                 "sent some, and they are refused", reason=Reason.LAYOUT)
        out, rows = self._put("forward", activations)
        self.expect = "grad"
        return fpb.SplitReply(seq=batch.seq, tensor=tensor_message(out), turn_rows=rows)

    def _turn_grad(self, message: fpb.SplitGrad) -> fpb.SplitReply:
        grad = array_of(message.grad, dtype="F32", what=f"turn {message.seq}'s gradient",
                        shape=(self.share, *self.driver.out_shape))
        back = self._put("backward", grad)
        self.expect = "sum"
        return fpb.SplitReply(seq=message.seq, tensor=tensor_message(back))

    def _turn_sum(self, message: fpb.SplitSum) -> fpb.SplitReply:
        what = f"turn {message.seq}'s gradients of the site's parts"
        if self.share:
            grads = weights_of(message.grads, self.driver.site_params, what=what)
        elif message.grads:
            raise IntegrityError(f"{what}: this site had no rows this turn, and sends no gradients",
                                 reason=Reason.LAYOUT)
        else:
            grads = None
        summed = self._put("sum", grads)
        self.seq, self.expect = self.seq + 1, "batch"
        return fpb.SplitReply(seq=message.seq, grads=summed or [])


def run_stage(driver, stage: str, inputs: dict, fed: list[tuple[str, int]]) -> tuple[dict, list]:
    """One stage of a turn at the server (Rendezvous's `run`): the sites' parts in site-name order, one worker
    call for all of them."""
    order = sorted(inputs)
    if stage == "sum":
        present = [s for s in order if inputs[s] is not None]
        if not present:
            return {s: None for s in order}, fed
        summed = []
        for name in sorted(driver.site_params):   # as torch's sum(): 0 + g0 + g1 + ..., in float32
            acc = np.zeros(driver.site_params[name], np.float32)
            for s in present:
                acc += inputs[s][name]
            summed.append(tensor_message(acc, name))
        return {s: summed for s in order}, fed
    if stage == "backward":
        grads = [inputs[s] if s in inputs else np.zeros((n, *driver.out_shape), np.float32) for s, n in fed]
        _, (back,) = driver.server_call("backward", [np.concatenate(grads)])
        return {s: g for (s, _), g in zip(fed, _slices(back, [n for _, n in fed])) if s in inputs}, []
    sizes = [len(inputs[s][0] if stage == "vanilla" else inputs[s]) for s in order]
    if stage == "vanilla":
        header, (grad,) = driver.server_call("vanilla", [np.concatenate([inputs[s][0] for s in order]),
                                                         np.concatenate([inputs[s][1] for s in order])])
        return {s: (g, header["loss"]) for s, g in zip(order, _slices(grad, sizes))}, []
    _, (out,) = driver.server_call("forward", [np.concatenate([inputs[s] for s in order])])
    return {s: (o, sum(sizes)) for s, o in zip(order, _slices(out, sizes))}, list(zip(order, sizes))


def _slices(array: np.ndarray, sizes: list[int]) -> list[np.ndarray]:
    return np.split(array, np.cumsum(sizes)[:-1]) if sizes else []
