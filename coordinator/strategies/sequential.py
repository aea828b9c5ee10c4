"""Sequential weight transfer (Chang et al. 2018): one site trains per round and hands the model on.

The rule is the plain mean (of one update: that site's model); the schedules say whose turn it is.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

from coordinator.strategies.base import MeanRule, Schedule, refuse_sampling, seeded_rng
from plexus.config import RoundConfig
from plexus.errors import ConfigError

_CLEAR = "one site trains per round, so the 'sum' is that one site's model in the clear anyway"


def _check_one_site(name: str, cfg: RoundConfig) -> None:
    if cfg.sites.min != 1:
        raise ConfigError(f"sites.min: {name} trains exactly one site per round, so a round can never reach "
                          f"{cfg.sites.min} trainers; set sites.min: 1")
    refuse_sampling(cfg, name, "the one site whose turn it is")


def _skipped(name: str, site: str) -> str:
    return f"{name}: skipped {site} (not online when its turn came)"


def _order(purpose: str, shuffle: bool, seed: int, cycle: int, known: list[str]) -> list[str]:
    order = sorted(set(known))
    if shuffle:
        order = [order[i] for i in seeded_rng(purpose, seed, cycle).permutation(len(order))]
    return order


class CWT(MeanRule):
    """Cyclical weight transfer: the plain mean (one site's model) over the Cyclic schedule."""

    name = "cwt"
    clear_reason = _CLEAR

    @classmethod
    def from_config(cls, args, cfg: RoundConfig) -> tuple[CWT, Cyclic]:
        _check_one_site(cls.name, cfg)
        if args.proportional and cfg.train.steps is None:
            raise ConfigError("strategy.args.proportional: needs train.steps, the local steps of a site of mean "
                              "size, which each site's steps are scaled from; set train.steps or "
                              "proportional: false")
        return cls(), Cyclic(shuffle=args.shuffle, proportional=args.proportional, steps=cfg.train.steps,
                             seed=cfg.seed)


class SWT(MeanRule):
    """Single weight transfer: the plain mean (one site's model) over the Single schedule."""

    name = "swt"
    clear_reason = _CLEAR

    @classmethod
    def from_config(cls, args, cfg: RoundConfig) -> tuple[SWT, Single]:
        _check_one_site(cls.name, cfg)
        return cls(), Single(shuffle=args.shuffle, seed=cfg.seed)


class Cyclic(Schedule):
    """CWT's schedule: visit every known site in turn, cycle after cycle; offline sites are skipped."""

    name = "cwt"

    def __init__(self, *, shuffle: bool = False, proportional: bool = False, steps: int | None = None,
                 seed: int = 0) -> None:
        if proportional and steps is None:
            raise ValueError("proportional cwt needs steps (the local steps of a site of mean size)")
        self.shuffle, self.proportional, self.steps, self.seed = shuffle, proportional, steps, seed
        self._cycle, self._order, self._pos = 0, [], 0   # cycle 0 is empty: the first round starts cycle 1

    def _due(self, known: list[str]) -> Iterator[tuple[int, list[str], int]]:
        """(cycle, order, position) from the current position: the rest of this cycle, then all of the next."""
        if self._pos < len(self._order):
            for pos in range(self._pos, len(self._order)):
                yield self._cycle, self._order, pos
        following = _order("cwt-order", self.shuffle, self.seed, self._cycle + 1, known)
        for pos in range(len(following)):
            yield self._cycle + 1, following, pos

    def configure(self, round_: int, available: list[str], known: list[str]) -> list[str]:
        online = set(available)
        return next(([order[pos]] for _, order, pos in self._due(known) if order[pos] in online), [])

    def opened(self, round_: int, participants: list[str], known: list[str]) -> list[str]:
        if not participants:
            return []
        notes = []
        for cycle, order, pos in self._due(known):
            if order[pos] == participants[0]:
                self._cycle, self._order, self._pos = cycle, order, pos + 1
                return notes
            notes.append(_skipped(self.name, order[pos]))
        raise ValueError(f"cwt: {participants[0]!r} is not due within the next cycle; open rounds only with "
                         "the site configure() chose")

    def local_steps(self, site: str, sizes: Mapping[str, int]) -> int:
        total = sum(sizes.values())
        if not self.proportional or site not in sizes or total <= 0:
            return 0
        return max(1, round(self.steps * sizes[site] * len(sizes) / total))

    def state_meta(self) -> dict:
        return {"cycle": self._cycle, "order": list(self._order), "pos": self._pos}

    def load_state(self, meta: Mapping) -> None:
        self._cycle, self._pos = int(meta.get("cycle", 0)), int(meta.get("pos", 0))
        self._order = [str(s) for s in meta.get("order", [])]


class Single(Schedule):
    """SWT's schedule: every known site trains once, in a fixed order, and the job is done."""

    name = "swt"

    def __init__(self, *, shuffle: bool = False, seed: int = 0) -> None:
        self.shuffle, self.seed = shuffle, seed
        self._order: list[str] | None = None   # fixed by the first round that opens
        self._pos = 0
        self._last_round = 0

    def _remaining(self, known: list[str]) -> list[str]:
        if self._order is None:
            return _order("swt-order", self.shuffle, self.seed, 1, known)
        return self._order[self._pos:]

    def configure(self, round_: int, available: list[str], known: list[str]) -> list[str]:
        online = set(available)
        return next(([site] for site in self._remaining(known) if site in online), [])

    def opened(self, round_: int, participants: list[str], known: list[str]) -> list[str]:
        if not participants:
            return []
        if self._order is None:
            self._order, self._pos = _order("swt-order", self.shuffle, self.seed, 1, known), 0
        remaining = self._order[self._pos:]
        if participants[0] not in remaining:
            raise ValueError(f"swt: {participants[0]!r} is not due (already visited or not known at the start); "
                             "open rounds only with the site configure() chose")
        skipped = remaining[:remaining.index(participants[0])]
        self._pos += len(skipped) + 1
        self._last_round = round_
        return [_skipped(self.name, site) for site in skipped]

    def done(self, rounds_closed: int) -> bool:
        return self._order is not None and self._pos >= len(self._order) and rounds_closed >= self._last_round

    def state_meta(self) -> dict:
        return {"order": self._order, "pos": self._pos, "last_round": self._last_round}

    def load_state(self, meta: Mapping) -> None:
        order = meta.get("order")
        self._order = None if order is None else [str(s) for s in order]
        self._pos, self._last_round = int(meta.get("pos", 0)), int(meta.get("last_round", 0))
