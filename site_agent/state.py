"""What a site keeps per job under its state_dir, at paths it builds itself.

Job ids come from the coordinator, which a site does not have to trust: an id
like `../../x` or `/etc/x` must never name a file. Every per-job path goes
through `job_path`, which takes only ids of the coordinator's own form and
checks that the resolved path stays inside state_dir.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from safetensors import SafetensorError, safe_open
from safetensors.numpy import load_file, save

from plexus.accounting import PrivacyLedger
from plexus.errors import IntegrityError
from plexus.files import write_atomically
from plexus.wire import Layout, decode, encode

log = logging.getLogger("plexus.site")

# The coordinator names jobs `<round config name>-<8 hex digits>`; the name is 1-64 of these characters.
JOB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
JOB_ID_RULE = "1-128 letters, digits, '.', '_' or '-', starting with a letter or digit"


def job_id_refusal(job_id: str) -> str | None:
    """Why this site refuses a task's job id, or None when it is a plain name."""
    if JOB_ID.fullmatch(job_id):
        return None
    return (f"job id {job_id[:80]!r} is not a valid job id: it must be {JOB_ID_RULE}, with no path "
            "separators; this site builds file names from it, so it refuses the task")


def job_path(state_dir: Path, kind: str, job_id: str, suffix: str) -> Path:
    """`<state_dir>/<kind>/<job_id><suffix>`, refused unless the id is plain and the path stays inside."""
    reason = job_id_refusal(job_id)
    if reason:
        raise IntegrityError(reason)
    root = Path(state_dir).resolve()
    path = (root / kind / f"{job_id}{suffix}").resolve()
    if not path.is_relative_to(root):
        raise IntegrityError(f"job {job_id!r}: its {kind} file would lie outside this site's state_dir")
    return path


class JobState:
    """This site's own record of one job: the rounds it trained, the DP-SGD privacy it spent, and the
    error-feedback residual of its compressed updates.

    The site's policy checks the first two, never the round number a task claims, so a
    coordinator replaying tasks cannot walk the site past max_rounds or max_epsilon.
    """

    def __init__(self, state_dir: Path, job_id: str) -> None:
        self.job_id = job_id
        self._rounds = job_path(state_dir, "rounds", job_id, ".json")
        self._ledger = job_path(state_dir, "dp_sgd", job_id, ".json")
        self._residual = job_path(state_dir, "residual", job_id, ".safetensors")

    def rounds_trained(self) -> int:
        """Training tasks this site has started for the job (0 for a new job)."""
        if not self._rounds.exists():
            return 0
        try:
            count = json.loads(self._rounds.read_text())["trained"]
        except (ValueError, KeyError, TypeError):
            count = None
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            # Named relative to state_dir: this reason goes to the coordinator, local paths do not.
            raise IntegrityError(f"this site's round count for job {self.job_id!r} (rounds/{self.job_id}.json in its "
                                 "state_dir) is damaged, so its policy.max_rounds cannot be checked; restore the file "
                                 "from a backup")
        return count

    def count_round(self) -> None:
        """Record one more training task, before it touches the data (a crash mid-round still counts)."""
        self._write(self._rounds, json.dumps({"trained": self.rounds_trained() + 1}))

    def ledger(self) -> PrivacyLedger:
        """The DP-SGD privacy this site has spent on the job (empty for a new job)."""
        return PrivacyLedger.from_json(self._ledger.read_text()) if self._ledger.exists() else PrivacyLedger()

    def keep_ledger(self, ledger: PrivacyLedger) -> None:
        self._write(self._ledger, ledger.to_json())

    def residual(self, like: Layout) -> dict[str, np.ndarray] | None:
        """The error-feedback residual kept with the last accepted update; None (a zero residual) before any.

        `like` is the layout it must have (the job's float tensors, float32). A file that cannot be read, does
        not have that layout or holds NaN/Inf is an IntegrityError: dropping it silently would lose what the
        site owes the model, and using it would send garbage.
        """
        if not self._residual.exists():
            return None
        # Named relative to state_dir: this reason goes to the coordinator, local paths do not.
        where = (f"this site's update residual for job {self.job_id!r} (residual/{self.job_id}.safetensors in its "
                 "state_dir)")
        fix = "delete the file to restart the residual from zero (the part of earlier updates not yet sent is lost)"
        try:
            stored = load_file(self._residual)   # safetensors: a header and raw bytes, never pickle
            layout = Layout.of(stored)
        except Exception as exc:   # safetensors raises its own SafetensorError for a torn or foreign file
            raise IntegrityError(f"{where} cannot be read ({type(exc).__name__}); {fix}") from None
        if layout != like:
            want = {t.name: (t.dtype, t.shape) for t in like.tensors}
            found = {t.name: (t.dtype, t.shape) for t in layout.tensors}
            differs = sorted(set(want) ^ set(found)) or sorted(n for n in want if want[n] != found[n])
            raise IntegrityError(f"{where} does not match the job's model (differs at {differs[:5]}); it belongs to "
                                 f"another model or is damaged; {fix}")
        if not all(np.isfinite(a).all() for a in stored.values()):
            raise IntegrityError(f"{where} holds NaN or infinite values, so it is damaged; {fix}")
        return stored

    def keep_residual(self, arrays: Mapping[str, np.ndarray]) -> None:
        """Replace the residual (atomically, mode 0600); call only once the coordinator accepted the update."""
        self._residual.parent.mkdir(parents=True, exist_ok=True)
        write_atomically(self._residual, save({n: np.ascontiguousarray(arrays[n]) for n in sorted(arrays)}),
                         mode=0o600)

    def drop_residual(self) -> None:
        """Forget the residual (a zero residual from now on)."""
        self._residual.unlink(missing_ok=True)

    @staticmethod
    def _write(path: Path, text: str) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomically(path, text.encode(), mode=0o600)


@dataclass(frozen=True)
class HeldModel:
    """A model this site holds for a job, as the coordinator's next delta (delta8, delta4) would apply to it."""

    round: int
    state: dict[str, np.ndarray]
    sha256: bytes        # of its wire blob: how the site names it in FetchModel


class ServedChain:
    """The model this site last decoded for a job under compression.downlink delta8 or delta4, kept between fetches (and
    restarts) so the next one can come as an 8-bit delta against it. A copy that is missing, unreadable or laid
    out otherwise is no copy: the site then asks for the model in full."""

    def __init__(self, state_dir: Path, job_id: str) -> None:
        self.job_id = job_id
        self.path = job_path(state_dir, "downlink", job_id, ".safetensors")

    def load(self, layout: Layout) -> HeldModel | None:
        """The kept model if it has exactly `layout` (the job's served layout), else None."""
        if not self.path.exists():
            return None
        try:
            with safe_open(str(self.path), framework="numpy") as fh:
                round_ = int((fh.metadata() or {})["round"])
                state = {name: fh.get_tensor(name) for name in fh.keys()}
            if round_ < 0 or Layout.of(state) != layout:
                raise ValueError(f"it is not a model of round >= 0 laid out as job {self.job_id}'s")
        except (SafetensorError, OSError, ValueError, KeyError, TypeError) as exc:
            log.warning("job %s: the model kept for delta downloads (downlink/%s.safetensors) cannot be used, so "
                        "the next one comes in full: %s", self.job_id, self.job_id, exc)
            return None
        blob = encode(state)[1]
        return HeldModel(round_, decode(layout, blob), hashlib.sha256(blob).digest())

    def keep(self, round_: int, state: dict[str, np.ndarray]) -> None:
        """Keep the model just decoded (round `round_`), replacing the one before it."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        write_atomically(self.path, save({k: np.ascontiguousarray(v) for k, v in state.items()},
                                         metadata={"round": str(round_)}), mode=0o600)
