"""The hospital's policy: what this site will run. Enforced here, at the site, never by the coordinator."""

from __future__ import annotations

import functools
import hashlib
import json
import math
from collections.abc import Callable
from dataclasses import asdict

from plexus import statistics as stats
from plexus.accounting import PrivacyLedger, dp_sgd_epsilon, dp_sgd_schedule, epsilon_after
from plexus.config import EXACT_STRATEGIES, PolicySpec, RoundConfig, ensemble_members
from plexus.errors import ConfigError
from plexus.memory import default_model_cap
from plexus.models import REGISTRY, plugin_source_sha256, state_bytes


def policy_digest(policy: PolicySpec) -> str:
    """SHA-256 of the canonical policy: the coordinator may see it, never change it."""
    canonical = json.dumps(asdict(policy), sort_keys=True, separators=(",", ":"), default=list)
    return hashlib.sha256(canonical.encode()).hexdigest()


def refusal(policy: PolicySpec, job: RoundConfig, installed_models: set[str], *,
            train_size: int | Callable[[], int] | None = None, round_: int | None = None,
            ledger: PrivacyLedger | None = None) -> str | None:
    """Why this site declines the job, or None when policy allows it.

    Every rule that needs no data runs first. `train_size` (the site's training
    rows, or a callable that counts them) is only consulted for a DP-SGD job under
    max_epsilon, after every other rule passed, so a declined job never touches the
    data. With `round_`, ε and max_rounds are checked through that round (decide
    whether to take part in it); without, through the whole job (decide whether to
    accept it). A site passes its own count of the rounds it trained, never a
    task's round number, and with `ledger` (the DP-SGD privacy it has spent on the
    job) DP-SGD ε is that ledger plus one more round.
    """
    name = job.model.name
    if name not in policy.allowed_models:
        return f"model {name!r} is not in this site's policy.allowed_models {sorted(policy.allowed_models)}"
    if name not in installed_models:
        return f"model {name!r} is not installed at this site"
    if name not in REGISTRY:
        reason = _plugin_refusal(policy, name)
        if reason:
            return reason
    if policy.allowed_datasets is not None and job.data.dataset not in policy.allowed_datasets:
        return (f"dataset {job.data.dataset!r} is not in this site's policy.allowed_datasets "
                f"{sorted(policy.allowed_datasets)}")
    reason = _size_refusal(policy, job)
    if reason:
        return reason
    if policy.max_rounds is not None and job.rounds > policy.max_rounds:
        return f"the job has {job.rounds} rounds; this site's policy.max_rounds allows at most {policy.max_rounds}"
    if policy.max_rounds is not None and round_ is not None and round_ > policy.max_rounds:
        return (f"this would be round {round_} this site trains for the job; its policy.max_rounds allows at most "
                f"{policy.max_rounds}")
    if job.mode == "split" and job.split.variant not in policy.split_variants:
        return (f"the job is a {job.split.variant} split, which sends this site's labels with its cut activations; "
                f"this site's policy.split_variants allows {', '.join(policy.split_variants) or 'none'}")
    if job.mode == "split" and job.split.schedule not in policy.split_schedules:
        return (f"the job's split schedule is {job.split.schedule}"
                + (", which shows the coordinator this site's gradients of its parts every turn"
                   if job.split.schedule == "synchronous" else "")
                + f"; this site's policy.split_schedules allows {', '.join(policy.split_schedules) or 'none'}")
    if policy.require_secure_aggregation and not job.privacy.secure_aggregation:
        return "this site's policy requires secure aggregation (privacy.secure_aggregation: true)"
    if job.privacy.secure_aggregation and job.sites.min < policy.min_secure_cohort:
        return (f"the job's sites.min {job.sites.min} lets a secure sum cover fewer sites than this site's "
                f"policy.min_secure_cohort {policy.min_secure_cohort}")
    if (policy.max_epsilon is not None or policy.min_dp_noise is not None) and job.privacy.dp is not None \
            and job.privacy.dp.reproducible_noise:
        return ("the job sets privacy.dp.reproducible_noise, so its central noise can be rebuilt from its config "
                "and removed; this site's policy.max_epsilon/min_dp_noise needs noise nobody can predict")
    if policy.min_dp_noise is not None:
        reason = _noise_refusal(policy.min_dp_noise, job)
        if reason:
            return reason
    if policy.max_epsilon is not None:
        return _epsilon_refusal(policy.max_epsilon, job, train_size, job.rounds if round_ is None else round_,
                                whole_job=round_ is None, ledger=None if round_ is None else ledger)
    return None


def _plugin_refusal(policy: PolicySpec, name: str) -> str | None:
    try:
        actual = plugin_source_sha256(name)
    except (ConfigError, OSError) as exc:
        return f"cannot hash the source of plug-in model {name!r} to check its pin: {exc}"
    pinned = policy.plugin_sha256.get(name)
    if pinned is None:
        return (f"plug-in model {name!r} is not pinned; add `plugin_sha256: {{{name}: '{actual}'}}` to this site's "
                "policy after reviewing its source")
    if pinned != actual:
        return (f"plug-in model {name!r} does not match this site's policy.plugin_sha256: its source hashes to "
                f"{actual}, the policy pins {pinned}; its code changed since it was reviewed")
    return None


def max_model_bytes(policy: PolicySpec) -> int:
    """policy.max_model_bytes, or its default: a quarter of the memory this process may use."""
    return policy.max_model_bytes if policy.max_model_bytes is not None else default_model_cap()


@functools.lru_cache(maxsize=64)
def _builtin_bytes(name: str, args_json: str, members: int) -> int:
    return state_bytes(name, json.loads(args_json), members=members)


def _size_refusal(policy: PolicySpec, job: RoundConfig) -> str | None:
    """Decline a model larger than this site builds, sized without building it (torch's meta device): the model
    and its arguments are the coordinator's choice, and one that does not fit would take the machine's memory."""
    limit = max_model_bytes(policy)
    members = ensemble_members(job)
    try:
        if job.model.name in REGISTRY:   # the same job's every task: sized once per process
            size = _builtin_bytes(job.model.name, json.dumps(job.model.args, sort_keys=True, default=list), members)
        else:   # a plug-in's code may change under its name (re-pinned): sized each time
            size = state_bytes(job.model.name, job.model.args, members=members)
    except ConfigError as exc:
        return f"model {job.model.name!r} cannot be built with the job's arguments: {exc}"
    except Exception as exc:   # sizes past torch's (int64) limits; a plug-in whose construction needs real tensors
        if job.model.name in REGISTRY:
            return f"model {job.model.name!r} cannot be built with the job's arguments: {type(exc).__name__}: {exc}"
        return (f"model {job.model.name!r} cannot be sized on torch's meta device before it is built "
                f"({type(exc).__name__}: {exc}), so this site cannot check it against policy.max_model_bytes; the "
                "plug-in must build its layers without reading their values")
    if size <= limit:
        return None
    where = ("this site's policy.max_model_bytes" if policy.max_model_bytes is not None
             else "a quarter of this machine's memory, the default of policy.max_model_bytes")
    return (f"model {job.model.name!r} with the job's arguments holds {size:,} bytes of parameters and buffers, "
            f"over {where} ({limit:,} bytes); raise policy.max_model_bytes if this machine can train it")


def _noise_refusal(min_noise: float, job: RoundConfig) -> str | None:
    noises = {f"privacy.{key}.noise_multiplier": spec.noise_multiplier
              for key, spec in (("dp", job.privacy.dp), ("dp_sgd", job.privacy.dp_sgd)) if spec is not None}
    if job.statistics is not None and job.statistics.dp is not None:
        # A statistics query's noise multiplier, as DP-SGD's σ/C: its noise scale over its sensitivity.
        noises["statistics.dp (noise scale / sensitivity)"] = min(
            q.scale / q.sensitivity for q in stats.dp_ledger(job.statistics).queries)
    if not noises:
        where = "statistics.dp" if job.statistics is not None else "privacy.dp or privacy.dp_sgd"
        return (f"this site's policy.min_dp_noise is {min_noise}, and the job adds no differential-privacy noise "
                f"(set {where})")
    if max(noises.values()) < min_noise:
        have = ", ".join(f"{key} = {value}" for key, value in noises.items())
        return f"the job's DP noise ({have}) is below this site's policy.min_dp_noise {min_noise}"
    return None


def _statistics_epsilon_refusal(max_epsilon: float, job: RoundConfig) -> str | None:
    """A statistics job spends its ε once, on its queries together (basic composition)."""
    if job.statistics.dp is None:
        return (f"this site's policy caps ε at {max_epsilon}, and the statistics job has no statistics.dp "
                "(its ε is unbounded)")
    ledger = stats.dp_ledger(job.statistics)
    if ledger.epsilon <= max_epsilon:
        return None
    return (f"the statistics job's ε is {_fmt(ledger.epsilon)} over its {len(ledger.queries)} queries "
            f"({job.statistics.dp.epsilon:g} each, added up), above this site's policy.max_epsilon {max_epsilon}; "
            f"set statistics.dp.epsilon to at most {max_epsilon / len(ledger.queries):.3g}, or describe fewer columns")


def _epsilon_refusal(max_epsilon: float, job: RoundConfig, train_size, rounds: int, *,
                     whole_job: bool, ledger: PrivacyLedger | None) -> str | None:
    if job.statistics is not None:
        return _statistics_epsilon_refusal(max_epsilon, job)
    dp, dp_sgd = job.privacy.dp, job.privacy.dp_sgd
    if dp is None and dp_sgd is None:
        return (f"this site's policy caps ε at {max_epsilon}, and the job has no differential privacy "
                "(its ε is unbounded)")
    # Client-level DP bounds what is learnt about the whole site, so about any one patient too:
    # a patient's ε is at most the smaller of the two guarantees. Sample rate 1.0 = no sampling credit.
    found = []
    if dp is not None:
        # lbfgs under privacy.dp: row-level (each row's gradient clipped), and its noisy row count is one more
        # release at the same σ (coordinator/strategies/exact.py: dp_releases), as the coordinator counts it.
        exact = job.strategy.name in EXACT_STRATEGIES
        epsilon = epsilon_after(rounds + (1 if exact else 0), dp.noise_multiplier, 1.0, dp.delta)
        if epsilon <= max_epsilon:
            return None
        if whole_job and dp.target_epsilon is not None and dp.target_epsilon <= max_epsilon:
            return None  # the job stops at its target; the site re-checks every round with round_
        found.append(f"{'row' if exact else 'client'}-level ε {_fmt(epsilon)} (δ={dp.delta})")
    if dp_sgd is not None:
        size = train_size() if callable(train_size) else train_size
        if size is None:
            return (f"this site's policy caps ε at {max_epsilon}, and the DP-SGD ε of this job depends on the "
                    "site's training-set size, which was not given")
        if ledger is None:
            epsilon = dp_sgd_epsilon(rounds, train_size=size, batch_size=job.train.batch_size,
                                     epochs=job.train.epochs, noise_multiplier=dp_sgd.noise_multiplier,
                                     delta=dp_sgd.delta)
        else:   # what this site has actually spent, plus this round (whatever noise earlier tasks claimed)
            sample_rate, steps = dp_sgd_schedule(size, job.train.batch_size, job.train.epochs)
            epsilon = ledger.epsilon_if(dp_sgd.noise_multiplier, sample_rate, dp_sgd.delta, steps=steps)
        if epsilon <= max_epsilon:
            return None
        found.append(f"DP-SGD ε {_fmt(epsilon)} on {size} rows (δ={dp_sgd.delta})")
    span = f"its {rounds} rounds" if whole_job else f"round {rounds}"
    return (f"the job's accounted ε after {span} would be {' and '.join(found)}, above this site's "
            f"policy.max_epsilon {max_epsilon}; raise the noise, run fewer rounds or set "
            f"privacy.dp.target_epsilon <= {max_epsilon}")


def _fmt(epsilon: float) -> str:
    return "inf" if math.isinf(epsilon) else f"{epsilon:.3g}"
