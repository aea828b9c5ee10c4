"""The hospital's policy: what this site will run. Enforced here, at the site, never by the coordinator."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict

from plexus.config import PolicySpec, RoundConfig


def policy_digest(policy: PolicySpec) -> str:
    """SHA-256 of the canonical policy: the coordinator may see it, never change it."""
    canonical = json.dumps(asdict(policy), sort_keys=True, separators=(",", ":"), default=list)
    return hashlib.sha256(canonical.encode()).hexdigest()


def refusal(policy: PolicySpec, job: RoundConfig, installed_models: set[str]) -> str | None:
    """Why this site declines the job, or None when policy allows it."""
    if job.model.name not in policy.allowed_models:
        return (f"model {job.model.name!r} is not in this site's policy.allowed_models "
                f"{sorted(policy.allowed_models)}")
    if job.model.name not in installed_models:
        return f"model {job.model.name!r} is not installed at this site"
    if policy.require_secure_aggregation and not job.privacy.secure_aggregation:
        return "this site's policy requires secure aggregation (privacy.secure_aggregation: true)"
    if policy.max_epsilon is not None and job.privacy.dp is None:
        return (f"this site's policy caps ε at {policy.max_epsilon}, and the job has no differential privacy "
                "(its ε is unbounded)")
    return None
