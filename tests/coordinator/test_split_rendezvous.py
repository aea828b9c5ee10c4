"""Synchronous SplitFed's turns (coordinator/drivers/split_sync.Rendezvous): each stage runs once, when every site
it expects has sent its part; a site with an empty share takes part only in the sum; a site that leaves is not
waited for, and a gradient it owed counts as zero; a stage that fails fails every site waiting on it; a message
for the wrong turn or stage is refused."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from coordinator.drivers.split_sync import Rendezvous, share
from plexus.errors import IntegrityError, RoundClosed


class Recorder:
    """A stage runner that records what each stage got and answers each site with (stage, turn, its input)."""

    def __init__(self):
        self.calls: list[tuple[str, tuple[str, ...], tuple]] = []

    def __call__(self, stage: str, inputs: dict, fed: list) -> tuple[dict, list]:
        self.calls.append((stage, tuple(sorted(inputs)), tuple(fed)))
        fed = [(s, 1) for s in sorted(inputs)] if stage == "forward" else []   # as run_stage: the forward's rows
        return {s: (stage, inputs[s]) for s in inputs}, fed


def run_site(rv: Rendezvous, site: str, out: dict, *, stop_after: tuple[int, str] | None = None) -> None:
    """A site following the u-shaped protocol over every turn; with `stop_after`, it leaves after that turn's stage."""
    try:
        for t in range(rv.turns):
            stages = ("forward", "backward", "sum") if rv.share(site, t) else ("sum",)
            for stage in stages:
                out.setdefault(site, []).append(rv.put(site, t, stage, f"{site}{t}{stage[0]}", lambda: None))
                if stop_after == (t, stage):
                    rv.leave(site)
                    return
    except Exception as exc:   # noqa: BLE001 - the test reads it
        out.setdefault(site, []).append(exc)


def run_sites(rv: Rendezvous, sites: list[str], **stops) -> dict:
    out: dict = {}
    threads = [threading.Thread(target=run_site, args=(rv, s, out), kwargs={"stop_after": stops.get(s)})
               for s in sites]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(20)
    assert not any(thread.is_alive() for thread in threads)
    return out


def test_shares_are_the_site_s_rows_cut_into_the_turns():
    """The coordinator's share sizes (it cannot import torch) are those of the shares a site cuts its rows into."""
    import torch

    from plexus.split import turn_shares

    assert [share(10, 4, t) for t in range(4)] == [2, 3, 2, 3]
    assert [share(2, 4, t) for t in range(4)] == [0, 1, 0, 1]
    assert sum(share(937, 15, t) for t in range(15)) == 937
    for rows, turns in ((10, 4), (2, 4), (937, 15), (5, 12), (0, 3)):
        shares = turn_shares(rows, turns, torch.Generator().manual_seed(1))
        assert [len(s) for s in shares] == [share(rows, turns, t) for t in range(turns)]


def test_each_stage_runs_once_over_the_sites_it_expects():
    recorder = Recorder()
    rv = Rendezvous({"a": 4, "b": 2, "c": 0}, 2, ("forward", "backward", "sum"), recorder)
    out = run_sites(rv, ["a", "b", "c"])
    # b's share is 1 row a turn; c has none, and takes part in the sums only
    assert recorder.calls == [
        ("forward", ("a", "b"), ()), ("backward", ("a", "b"), (("a", 1), ("b", 1))), ("sum", ("a", "b", "c"), ()),
        ("forward", ("a", "b"), ()), ("backward", ("a", "b"), (("a", 1), ("b", 1))), ("sum", ("a", "b", "c"), ())]
    assert out["c"] == [("sum", "c0s"), ("sum", "c1s")]
    assert out["a"][:2] == [("forward", "a0f"), ("backward", "a0b")]


def test_a_site_that_leaves_after_the_forward_is_not_waited_for():
    recorder = Recorder()
    rv = Rendezvous({"a": 2, "b": 2}, 2, ("forward", "backward", "sum"), recorder)
    out = run_sites(rv, ["a", "b"], b=(0, "forward"))
    # the backward still knows b's rows were in the forward (the driver counts its gradient as zero)
    assert recorder.calls[1] == ("backward", ("a",), (("a", 1), ("b", 1)))
    assert [c[:2] for c in recorder.calls[2:]] == [("sum", ("a",)), ("forward", ("a",)), ("backward", ("a",)),
                                                     ("sum", ("a",))]
    assert len(out["a"]) == 6
    with pytest.raises(RoundClosed):
        rv.put("b", 1, "forward", "late", lambda: None)


def test_a_failing_stage_fails_every_site_waiting_on_it():
    def run(stage, inputs, fed):
        raise IntegrityError("the worker refused the batch")

    rv = Rendezvous({"a": 1, "b": 1}, 1, ("forward", "backward", "sum"), run)
    out = run_sites(rv, ["a", "b"])
    assert all(isinstance(out[s][0], RoundClosed) for s in ("a", "b"))
    assert str(out["a"][0]) == "turn 0's forward at the server failed: the worker refused the batch"
    assert out["a"][0] is not out["b"][0]


def test_a_part_for_another_turn_or_stage_is_refused():
    rv = Rendezvous({"a": 2, "b": 2}, 2, ("forward", "backward", "sum"), Recorder())
    with pytest.raises(IntegrityError, match="turn 1 forward from site a is out of order: the turns are at turn 0"):
        rv.put("a", 1, "forward", np.zeros(1), lambda: None)
    with pytest.raises(IntegrityError, match="out of order"):   # no forward has run: a backward has no rows to answer
        rv.put("a", 0, "backward", np.zeros(1), lambda: None)
    with pytest.raises(IntegrityError, match="out of order"):   # a u-shaped turn has no vanilla stage
        rv.put("a", 0, "vanilla", np.zeros(1), lambda: None)
    cut = RoundClosed("the session was cut")
    with pytest.raises(RoundClosed, match="cut"):   # waiting for b, and the session is cut
        rv.put("a", 0, "forward", np.zeros(1), lambda: cut)
    with pytest.raises(IntegrityError, match="out of order"):   # a's forward part is in already
        rv.put("a", 0, "forward", np.zeros(1), lambda: None)


def test_the_turns_end_when_every_site_has_left():
    rv = Rendezvous({"a": 5000, "b": 5000}, 3000, ("forward", "backward", "sum"), Recorder())
    rv.leave("a")
    assert (rv.t, rv.stage) == (0, "forward")
    rv.leave("b")   # thousands of stages with no one left: skipped, none run
    assert rv.stage is None
