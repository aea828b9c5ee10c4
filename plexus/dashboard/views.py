"""The dashboard's JSON, made from the Admin service's replies: pure functions of protos, no I/O.

Every number is finite or None (JSON has no NaN), every text is passed on as it came: the page renders
it with textContent, never as HTML, because job names, reasons and configs are written by others.
"""

from __future__ import annotations

import math
from collections import defaultdict

from plexus.admin_client import async_view, epsilon_by_round, job_config, mean_metrics
from plexus.vocab import TERMINAL

CAN_ABORT = frozenset({"admin", "operator"})   # the roles the coordinator lets abort a job
AUDIT_ENTRIES = 50                             # the most recent entries the audit page shows
CURVE_KINDS = ("eval", "train")                # metric kinds drawn as curves, global and per site
_WEIGHT = "num_samples"                        # a site's weight in a mean, not a metric to draw


def me(name: str, role: str, coordinator: str, csrf: str) -> dict:
    """Who the dashboard acts as, and the CSRF token the page sends back with each POST."""
    return {"name": name, "role": role, "coordinator": coordinator, "can_abort": role in CAN_ABORT, "csrf": csrf}


def job_summary(detail) -> dict:
    """A job's line in the jobs table: its summary, and its mode and privacy read from its config."""
    return _summary(detail, job_config(detail), epsilon_by_round(detail))


def _summary(detail, cfg, spent: dict[int, float]) -> dict:
    s = detail.summary
    return {"job_id": s.job_id, "name": s.name, "status": s.status, "strategy": s.strategy, "mode": _mode(cfg),
            "privacy": {"dp": _dp_text(cfg), "epsilon_target": _finite(_epsilon_target(cfg)),
                        "epsilon_spent": _finite(spent[max(spent)]) if spent else None,
                        "secure_aggregation": bool(cfg is not None and cfg.privacy.secure_aggregation)},
            "round": s.current_round, "rounds": s.rounds, "total_rounds": s.rounds, "submitted_by": s.submitted_by,
            "created": _finite(s.created_unix_s), "updated": _finite(s.updated_unix_s), "message": s.message,
            "terminal": s.status in TERMINAL}


def job_detail(detail) -> dict:
    """Everything the job page shows: the summary, the config, each round with its sites' outcomes, the
    metric curves (the weighted global mean and each site's), the privacy ledger and, for an asynchronous
    job, its versions' view (plexus.admin_client.async_view). Here `rounds` is the list of rounds; how many
    the job runs is `total_rounds`, as in the summary."""
    cfg, eps = job_config(detail), epsilon_by_round(detail)   # once (async_view reads an async job's again)
    view = _summary(detail, cfg, eps)
    return {**view, "config_yaml": detail.config_yaml, "rounds": rounds(detail), "curves": curves(detail),
            "epsilon": [[r, _finite(eps[r])] for r in sorted(eps)],
            "epsilon_target": view["privacy"]["epsilon_target"],
            "async": async_view(detail) if cfg is not None and cfg.asynchronous is not None else None}


def rounds(detail) -> list[dict]:
    """Each round (and each round only a site event names), with what became of each site's task in it;
    declines and failures keep the reason the site or the coordinator gave."""
    sites = defaultdict(list)
    for e in detail.site_events:
        sites[e.round].append({"site": e.site, "status": e.status, "reason": e.reason})
    out = {r.round: {"round": r.round, "status": r.status, "opened": _finite(r.opened_unix_s) or None,
                     "closed": _finite(r.closed_unix_s) or None, "contributors": list(r.contributors),
                     "total_samples": r.total_samples, "message": r.message, "sites": sites.get(r.round, [])}
           for r in detail.rounds}
    for round_ in sites.keys() - out.keys():
        out[round_] = {"round": round_, "status": "", "opened": None, "closed": None, "contributors": [],
                       "total_samples": 0, "message": "", "sites": sites[round_]}
    return [out[r] for r in sorted(out)]


def curves(detail) -> dict:
    """kind -> metric -> {"global": [[round, mean]], "sites": {site: [[round, value]]}}, for the eval metrics
    (of the global model of each round, on the sites' held-out rows) and the train metrics (of the sites'
    local models); the mean is weighted by each site's rows (plexus.admin_client.mean_metrics)."""
    out: dict = {}
    for kind in CURVE_KINDS:
        per_site: dict = defaultdict(lambda: defaultdict(dict))
        for m in detail.metrics:
            if m.kind == kind and m.name != _WEIGHT:
                per_site[m.name][m.site][m.round] = m.value
        means = mean_metrics(detail, kind)
        named = {}
        for name in sorted(per_site):
            named[name] = {
                "global": [[r, _finite(means[r][name])] for r in sorted(means) if name in means[r]],
                "sites": {site: [[r, _finite(v)] for r, v in sorted(values.items())]
                          for site, values in sorted(per_site[name].items()) if site}}
        if named:
            out[kind] = named
    return out


def site(info) -> dict:
    """One row of the sites page (the SiteInfo the coordinator keeps of a site)."""
    return {"site": info.site, "online": info.online, "last_seen": _finite(info.last_seen_unix_s) or None,
            "datasets": list(info.datasets), "dataset_rows": {k: int(v) for k, v in sorted(info.dataset_rows.items())},
            "revoked": info.revoked, "version": info.agent_version, "policy_digest": info.policy_digest,
            "models": list(info.models)}


def audit(reply) -> dict:
    """The audit page: whether the hash chain verified (and what is wrong if not), and the last entries."""
    return {"verified": reply.verified, "problem": reply.problem, "count": reply.count,
            "entries": [{"seq": e.seq, "at": _finite(e.at), "actor": e.actor, "action": e.action,
                         "subject": e.subject} for e in reply.entries]}


def event(e) -> dict:
    """A JobEvent as the live stream names it."""
    return {"kind": e.kind, "round": e.round, "site": e.site, "message": e.message, "unix_s": _finite(e.unix_s)}


def _mode(cfg) -> str:
    if cfg is None:
        return "unknown"   # a config this version cannot read: the job is shown as any job, without it
    if cfg.kind == "statistics":
        return "statistics"
    return "async" if cfg.asynchronous is not None else "sync"


def _dp_text(cfg) -> str | None:
    """The job's differential privacy in a few words ("dp-fedavg central σ=1.1 clip 1.0"), or None."""
    if cfg is None:
        return None
    parts = []
    if (dp := cfg.privacy.dp) is not None:
        parts.append(f"dp-fedavg {dp.mode} σ={dp.noise_multiplier:g} clip {dp.clip_norm:g}")
    if (sgd := cfg.privacy.dp_sgd) is not None:
        parts.append(f"dp-sgd σ={sgd.noise_multiplier:g} clip {sgd.max_grad_norm:g}")
    if cfg.statistics is not None and (sdp := cfg.statistics.dp) is not None:
        parts.append(f"statistics {sdp.mechanism} ε={sdp.epsilon:g} per query")
    return "; ".join(parts) or None


def _epsilon_target(cfg) -> float | None:
    if cfg is None or cfg.privacy.dp is None:
        return None
    return cfg.privacy.dp.target_epsilon


def _finite(value: float | None) -> float | None:
    return value if value is not None and math.isfinite(value) else None
