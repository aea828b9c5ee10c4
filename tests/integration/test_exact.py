"""lbfgs and newton over real gRPC + mTLS: four heart-disease hospitals send loss and gradient (and Hessian) sums,
and the downloaded model is scikit-learn's LogisticRegression on their pooled training rows, plainly and under
secure aggregation (within its fixed-point bound)."""

from __future__ import annotations

import numpy as np
import pytest

from plexus.datasets import heart_disease
from plexus.secagg import frac_bits

from integration.harness import HOSPITAL_OF, scaled

SITES = "abcd"
C = 0.1   # at C = 1 heart disease takes lbfgs over 40 rounds to come within 1e-6 (docs/strategies.md)
CLIP = 1024.0   # above any site's |sum|: ~200 rows in [0, 1], a loss per row of a few nats at the trial points
ROUNDS = {"lbfgs": 30, "newton": 8}


def exact_job(name: str, *, secure: bool) -> str:
    privacy = (f"privacy: {{secure_aggregation: true, secagg: {{clip: {CLIP}, phase_timeout_s: {scaled(10)}}}}}\n"
               if secure else "")
    return (f"name: heart-{name}\n"
            "model: {name: logistic, args: {in_features: 13, num_classes: 2, dtype: float64}}\n"
            "data: {dataset: heart-disease}\n"
            f"rounds: {ROUNDS[name]}\n"
            f"strategy: {{name: {name}, args: {{C: {C}}}}}\n"
            f"sites: {{min: {len(SITES)}, deadline_s: {scaled(30)}}}\n" + privacy)


def pooled_rows() -> tuple[np.ndarray, np.ndarray]:
    """Every site's training rows (its Split.x_train, as it reads them), together."""
    splits = [heart_disease(HOSPITAL_OF[s]) for s in SITES]
    return (np.concatenate([s.x_train for s in splits]).astype(np.float64),
            np.concatenate([s.y_train for s in splits]))


def hessian_of_f(w: np.ndarray, x: np.ndarray) -> np.ndarray:
    """∇²F at w for F = C·Σ logistic loss + ½‖coef‖² (the intercept, last, unpenalised)."""
    xb = np.c_[x, np.ones(len(x))]
    p = 1 / (1 + np.exp(-xb @ w))
    return C * xb.T @ (xb * (p * (1 - p))[:, None]) + np.diag(np.r_[np.ones(x.shape[1]), 0.0])


@pytest.mark.parametrize("secure", [False, True], ids=["plain", "secure"])
@pytest.mark.parametrize("name", ["lbfgs", "newton"])
def test_the_federated_fit_is_the_pooled_fit(federation, name, secure):
    from sklearn.linear_model import LogisticRegression

    for site in SITES:
        federation.start_site(site, allowed_models=("logistic",))
    federation.wait_online(*SITES)
    admin = federation.admin()
    job_id = admin.submit(exact_job(name, secure=secure)).job_id
    assert federation.wait_job(job_id, timeout=scaled(120)) == "completed", federation.store.job(job_id).message
    rounds, model = admin.download(job_id)
    assert rounds <= ROUNDS[name]
    assert model["linear.weight"].dtype == np.float64
    assert not model["linear.weight"][0].any() and model["linear.bias"][0] == 0   # class 0 held at zero
    got = np.r_[model["linear.weight"][1], model["linear.bias"][1]]
    x, y = pooled_rows()
    fit = LogisticRegression(tol=1e-12, C=C, max_iter=10000).fit(x, y)
    want = np.r_[fit.coef_[0], fit.intercept_]
    bound = 1e-6
    if secure:
        # Each pooled sum is off by at most e = K·K·2^-(f+1) per coordinate (docs/privacy.md), so each entry of
        # ∇F by C·e, which moves the optimum by at most ‖(∇²F)⁻¹‖·√d·C·e.
        e = len(SITES) ** 2 * 2.0 ** -(frac_bits(CLIP) + 1)
        bound += np.sqrt(len(got)) * C * e / np.linalg.eigvalsh(hessian_of_f(want, x))[0]
    assert np.abs(got - want).max() <= bound, (np.abs(got - want).max(), bound)


def test_lbfgs_under_central_dp_takes_noisy_steps_and_counts_epsilon(federation):
    """The sites clip each row's gradient and send no loss; the driver leaves clipping and noise to the rule and
    counts ε per round at q = 1, plus one round for the noisy row count."""
    from plexus.accounting import client_epsilon

    for site in SITES:
        federation.start_site(site, allowed_models=("logistic",))
    federation.wait_online(*SITES)
    admin = federation.admin()
    job = exact_job("lbfgs", secure=False).replace(
        "args: {C: 0.1}", "args: {C: 0.1, dp_step: 1.0, max_iterations: 3}") + \
        "privacy: {dp: {mode: central, noise_multiplier: 1.0, clip_norm: 1.0}}\n"
    job_id = admin.submit(job).job_id
    assert federation.wait_job(job_id, timeout=scaled(60)) == "completed", federation.store.job(job_id).message
    rounds, model = admin.download(job_id)
    assert rounds == 3 and np.isfinite(model["linear.weight"]).all() and model["linear.weight"][1].any()
    epsilons = {m.round: m.value for m in federation.store.metrics(job_id) if m.name == "epsilon"}
    assert epsilons == {n: pytest.approx(client_epsilon(1.0, [1.0] * (n + 1), 1e-5)) for n in range(1, 4)}
