"""Per-site model ensembling: each member site trains its own model; the ensemble averages their predictions."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from coordinator.strategies.base import Schedule, State, Update, UpdatesRule, cast, refuse_sampling
from plexus.config import RoundConfig
from plexus.errors import ConfigError, IntegrityError


class Members(Schedule):
    """Every online member site trains every round."""

    def __init__(self, members: list[str]) -> None:
        self.members = list(members)

    def configure(self, round_: int, available: list[str], known: list[str]) -> list[str]:
        return sorted(set(self.members) & set(available))


class Ensemble(UpdatesRule):
    """Member i (site members[i]) trains `members.<i>.*`; `weights` ∝ its latest sample count (or uniform)."""

    name = "ensemble"
    local_training = "trains only the site's own member of the ensemble"
    clear_reason = "each member's model is taken from its own site's update, never from a sum"
    dp_reason = ("each member model is one site's result, not a mean over sites, so noise calibrated to a "
                 "clipped mean would not protect it")

    def __init__(self, *, members: list[str], weighted: bool = True) -> None:
        self.members, self.weighted = list(members), weighted
        self._sizes: dict[str, int] = {}   # latest num_samples per member that has trained

    @classmethod
    def from_config(cls, args, cfg: RoundConfig) -> tuple[Ensemble, Members]:
        k = len(args.members)
        if cfg.sites.min > k:
            raise ConfigError(f"sites.min: is {cfg.sites.min} but only the {k} member sites train; "
                              f"set sites.min to at most {k}")
        refuse_sampling(cfg, cls.name, "every online member site")
        return cls(members=list(args.members), weighted=args.weighted), Members(args.members)

    def combine(self, round_: int, current: State, updates: list[Update]) -> State:
        if "weights" not in current:
            raise IntegrityError("the global model has no 'weights' tensor; strategy ensemble needs the "
                                 "Ensemble model that build_job_model makes")
        out = dict(current)
        for u in updates:
            if u.site not in self.members:
                raise IntegrityError(f"site {u.site!r} is not an ensemble member ({', '.join(self.members)}); "
                                     "only member sites may submit updates")
            prefix = f"members.{self.members.index(u.site)}."
            for name, x in current.items():
                if name.startswith(prefix):
                    out[name] = cast(u.state[name], x.dtype)
            self._sizes[u.site] = int(u.num_samples)
        out["weights"] = self.weights().astype(current["weights"].dtype)
        return out

    def weights(self) -> np.ndarray:
        """Each member's share of the ensemble: its latest sample count (weighted) or 1 once it trained."""
        w = np.array([(self._sizes.get(s, 0) if self.weighted else float(s in self._sizes)) for s in self.members],
                     np.float64)
        return (w / w.sum() if w.sum() > 0 else w).astype(np.float32)

    def state_meta(self) -> dict:
        return {"sizes": dict(self._sizes)}

    def load_state(self, arrays, meta: Mapping) -> None:
        self._sizes = {str(s): int(n) for s, n in meta.get("sizes", {}).items()}
