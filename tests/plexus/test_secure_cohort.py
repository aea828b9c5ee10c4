"""Secure aggregation's minimum cohort and reproducible DP noise: config, site policy and SiteSession (issue 21)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from plexus import errors, identity, pki, secagg
from plexus.config import PolicySpec, load_site_config, parse_round_config
from plexus.errors import ConfigError
from site_agent.policy import refusal

JOB, ROUND = "job-1", 1
NAMES = ["alder", "birch", "cedar", "daisy", "elm"]
MINIMAL = "name: job\nmodel: {name: mlp, args: {in_features: 13}}\ndata: {dataset: heart}\nrounds: 3\n"


@pytest.fixture(scope="module")
def fed(tmp_path_factory):
    base = tmp_path_factory.mktemp("cohort")
    pki.init_federation(base / "fed", "Cohort Fed")
    kits = {name: identity.load_kit(pki.add_site(base / "fed", name)) for name in NAMES}
    return SimpleNamespace(kits=kits, ca_pem=kits["alder"].ca_pem)


def _sessions(fed, names, min_cohort):
    sessions = {n: secagg.SiteSession(JOB, ROUND, n, min_cohort=min_cohort) for n in names}
    adverts = [sessions[n].advertise(10, fed.kits[n].key_pem, fed.kits[n].cert_pem) for n in names]
    return sessions, adverts


def _config_error(text: str) -> str:
    with pytest.raises(ConfigError) as info:
        parse_round_config(MINIMAL + text, source="job.yaml")
    return str(info.value)


# --- the job config ------------------------------------------------------------


@pytest.mark.parametrize("sites", ["{min: 1, count: 1}", "{min: 2}", None])
def test_secure_jobs_below_three_sites_are_refused_with_the_line(sites):
    text = (f"sites: {sites}\n" if sites else "") + "privacy: {secure_aggregation: true}\n"
    message = _config_error(text)
    assert message.startswith("job.yaml:5: sites: min is" if sites else "job.yaml:1: sites: min is"), message
    assert "needs at least 3 sites" in message and "set sites.min to 3 or more" in message
    assert parse_round_config(MINIMAL + "sites: {min: 3}\nprivacy: {secure_aggregation: true}\n").sites.min == 3


def test_a_threshold_of_one_is_refused():
    message = _config_error("sites: {min: 3}\nprivacy: {secure_aggregation: true, secagg: {threshold: 1}}\n")
    assert message.startswith("job.yaml:6: privacy.secagg.threshold: 1 is out of range; use a value >= 2"), message


def test_reproducible_noise_is_central_only_and_off_by_default():
    dp = "dp: {mode: central, noise_multiplier: 1, clip_norm: 1}"
    assert parse_round_config(MINIMAL + f"privacy: {{{dp}}}\n").privacy.dp.reproducible_noise is False
    message = _config_error("sites: {min: 3}\nprivacy:\n  secure_aggregation: true\n"
                            "  dp: {mode: distributed, noise_multiplier: 1, clip_norm: 1, reproducible_noise: true}\n")
    assert message.startswith("job.yaml:8: privacy.dp.reproducible_noise: applies to mode 'central' only"), message


# --- the site's policy -----------------------------------------------------------


@pytest.mark.parametrize(("value", "ok"), [(1, False), (2, True), (3, True)])
def test_policy_min_secure_cohort_is_at_least_two(tmp_path, value, ok):
    path = tmp_path / "site.yaml"
    path.write_text(f"site: alder\ncoordinator: c.example.org:8443\nkit: kit\npolicy: {{min_secure_cohort: {value}}}\n")
    if ok:
        assert load_site_config(path).policy.min_secure_cohort == value
    else:
        with pytest.raises(ConfigError, match=r"site.yaml:4: policy.min_secure_cohort: 1 is out of range; use a "
                                              r"value in \[2, 10000\]"):
            load_site_config(path)
    assert PolicySpec().min_secure_cohort == 3


def test_site_declines_a_secure_job_whose_sites_min_is_below_its_cohort():
    job = parse_round_config(MINIMAL + "sites: {min: 3}\nprivacy: {secure_aggregation: true}\n")
    assert refusal(PolicySpec(allowed_models=("mlp",)), job, {"mlp"}) is None
    assert refusal(PolicySpec(allowed_models=("mlp",), min_secure_cohort=4), job, {"mlp"}) == (
        "the job's sites.min 3 lets a secure sum cover fewer sites than this site's policy.min_secure_cohort 4")


def test_site_with_a_privacy_cap_declines_reproducible_noise():
    job = parse_round_config(MINIMAL + "privacy: {dp: {mode: central, noise_multiplier: 5, clip_norm: 1, "
                                       "reproducible_noise: true}}\n")
    assert refusal(PolicySpec(allowed_models=("mlp",)), job, {"mlp"}) is None
    for policy in (PolicySpec(allowed_models=("mlp",), max_epsilon=100.0),
                   PolicySpec(allowed_models=("mlp",), min_dp_noise=1.0)):
        assert "reproducible_noise" in refusal(policy, job, {"mlp"})


# --- SiteSession: never share, mask or reveal among too few ------------------------


def test_session_refuses_a_cohort_floor_below_two():
    with pytest.raises(ValueError, match="min_cohort must be >= 2"):
        secagg.SiteSession(JOB, ROUND, "alder", min_cohort=1)


@pytest.mark.parametrize("n", [1, 2])
def test_session_will_not_share_among_fewer_than_its_cohort(fed, n):
    sessions, adverts = _sessions(fed, NAMES[:n], min_cohort=3)
    with pytest.raises(errors.IntegrityError, match=f"only {n} sites advertised.*minimum secure cohort of 3.*"
                                                    "will not share its secrets"):
        sessions["alder"].share(adverts, threshold=n // 2 + 1, total_weight=10 * n, ca_pem=fed.ca_pem)


def test_session_will_not_mask_or_reveal_for_too_small_a_cohort(fed):
    # Four advertise and share (t = 3); the coordinator relays only three sites' shares: U2 < 4.
    sessions, adverts = _sessions(fed, NAMES[:4], min_cohort=4)
    outbox = {n: sessions[n].share(adverts, threshold=3, total_weight=40, ca_pem=fed.ca_pem) for n in NAMES[:4]}
    with pytest.raises(errors.IntegrityError, match="only 3 sites shared.*will not mask its update"):
        sessions["alder"].receive_shares({u: outbox[u]["alder"] for u in ("birch", "cedar")})

    # Five share and mask (t = 3, cohort 4); the coordinator claims only three survived: U3 < 4.
    sessions, adverts = _sessions(fed, NAMES, min_cohort=4)
    outbox = {n: sessions[n].share(adverts, threshold=3, total_weight=50, ca_pem=fed.ca_pem) for n in NAMES}
    for v in NAMES:
        sessions[v].receive_shares({u: outbox[u][v] for u in NAMES if u != v})
        list(sessions[v].mask([np.zeros(4)], field=secagg.Field.fixed(1.0, secagg.frac_bits(1.0))))
    with pytest.raises(errors.IntegrityError, match="only 3 sites survived.*will not reveal shares"):
        sessions["alder"].unmask(["alder", "birch", "cedar"])
    assert len(sessions["alder"].unmask(["alder", "birch", "cedar", "daisy"])) == 5   # 4 survivors: fine
