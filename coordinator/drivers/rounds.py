"""The synchronous round cycle's decisions, with no I/O: from a round's state, the clock and the config
to what happens next. SyncRounds acts on them; bench/strategies.py runs its in-process rounds by them."""

from __future__ import annotations

import enum
from collections.abc import Collection, Mapping
from dataclasses import dataclass


class Action(enum.StrEnum):
    WAIT = "wait"          # not every answer is in and the deadline has not passed
    ADVANCE = "advance"    # a secure-aggregation phase is over: open the next, or finish the round
    FINISH = "finish"      # the final evaluation round is over: the job ends
    CLOSE = "close"        # a quorum of updates: aggregate, save, serve the new model
    MISSED = "missed"      # too few updates: retry the round if sites.retries allows, else fail


@dataclass(frozen=True)
class Decision:
    action: Action
    wait_s: float = 0.0        # WAIT: how long until the next look
    by_deadline: bool = False  # the deadline ended the round: answers still missing (or arriving) are late


@dataclass(frozen=True)
class RoundView:
    """What a decision reads of an open round."""

    kind: str                             # "train" | "evaluate"
    participants: Collection[str]
    outcomes: Mapping[str, str]           # participant -> its outcome so far
    evaluators: Collection[str] = ()
    eval_outcomes: Mapping[str, str] = ()
    receiving: bool = False               # an update is still arriving
    deadline: float = float("inf")        # monotonic
    secure: bool = False
    contributors: int = 0
    needed: int = 1                       # the fewest contributors a closing round needs


def decide(view: RoundView, now: float) -> Decision:
    """Wait, or end the round (or its secure-aggregation phase) and how: every answer is in, or the deadline
    has passed. A secure round's phases do not wait for sites that only evaluate."""
    done = all(s in view.outcomes for s in view.participants) and not view.receiving
    if not view.secure:
        done = done and all(s in view.eval_outcomes for s in view.evaluators)
    remaining = view.deadline - now
    if not done and remaining > 0:
        return Decision(Action.WAIT, wait_s=min(remaining, 1.0))
    late = not done
    if view.secure:
        return Decision(Action.ADVANCE, by_deadline=late)
    if view.kind == "evaluate":
        return Decision(Action.FINISH, by_deadline=late)
    if view.contributors >= view.needed:
        return Decision(Action.CLOSE, by_deadline=late)
    return Decision(Action.MISSED, by_deadline=late)


def training_over(*, model_round: int, rounds: int, budget_stop: bool, strategy_done: bool) -> bool:
    """Whether the next round is the final evaluation: the rounds are done, the privacy budget is spent,
    or the strategy says it has finished."""
    return model_round >= rounds or budget_stop or strategy_done


def can_open(participants: Collection[str], *, evaluating: bool, sites_min: int) -> bool:
    """Enough sites for the next round: sites.min trainers, or any one site to evaluate the final model."""
    return len(participants) >= (1 if evaluating else sites_min)


def retry_allowed(retried: int, retries: int) -> bool:
    """A round that missed its quorum may open again while it has retried fewer than sites.retries times."""
    return retried < retries
