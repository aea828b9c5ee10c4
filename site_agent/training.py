"""Local training and evaluation of a model on a site's own data."""

from __future__ import annotations

import hashlib
import itertools
import math
import secrets
import warnings
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from plexus.accounting import PrivacyLedger, dp_sgd_schedule
from plexus.config import MAX_STEPS
from plexus.errors import ConfigError
from plexus.models import seeded
from plexus.objectives import loss_name

_EVAL_BATCH = 4096
# The training team (site_agent/team.py) a task's train_local runs in, when the site spreads training over workers.
TEAM: ContextVar = ContextVar("plexus_training_team", default=None)


@dataclass(frozen=True)
class TrainResult:
    """What one local training run reports back (never the data itself)."""

    num_samples: int
    steps: int
    metrics: dict[str, float]  # "train_loss": sample-weighted mean over the last epoch (every step in steps mode)


def _sgd(params: Any, opt: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=opt.lr, momentum=opt.momentum, weight_decay=opt.weight_decay)


def _adam(params: Any, opt: Any) -> torch.optim.Optimizer:
    if opt.momentum:
        raise ConfigError("optimizer 'adam' takes no momentum (it uses betas); set momentum to 0 or use sgd")
    return torch.optim.Adam(params, lr=opt.lr, weight_decay=opt.weight_decay)


OPTIMIZERS: dict[str, Callable[[Any, Any], torch.optim.Optimizer]] = {"sgd": _sgd, "adam": _adam}


def _prepare(model: nn.Module, x: np.ndarray, y: np.ndarray, train: Any):
    """Validate the train spec and data; (optimizer factory, x tensor, y tensor, row count)."""
    _check_train(train)
    try:
        make_optimizer = OPTIMIZERS[train.optimizer.name]
    except KeyError:
        raise ConfigError(
            f"unknown optimizer {train.optimizer.name!r}; expected one of {sorted(OPTIMIZERS)}"
        ) from None
    if loss_name(model) != "cross_entropy":
        raise ConfigError(f"model {type(model).__name__} is a regression model (loss {loss_name(model)}): it is "
                          "fitted by strategy lbfgs or newton over all rows; minibatch training needs a classifier")
    xt, yt = _tensors(x, y, model)
    if len(yt) == 0:
        raise ValueError("no training samples: x and y are empty, so there is nothing to train on")
    return make_optimizer, xt, yt, len(yt)


def train_local(model: nn.Module, x: np.ndarray, y: np.ndarray, train: Any, *, seed: int,
                steps: int | None = None, loss_term: Callable[[], torch.Tensor] | None = None,
                grad_hook: Callable[[], None] | None = None) -> TrainResult:
    """Train ``model`` in place with cross-entropy; the same seed and inputs give the same bits.

    Length: exactly `steps` minibatch steps if given (else ``train.steps`` if set), drawing a
    fresh seeded permutation each time a pass over the data runs out; otherwise
    ``train.epochs`` passes. metrics["train_loss"] is the sample-weighted mean cross-entropy
    (without any loss_term) over the last pass, or over every step taken in steps mode.

    A strategy's site half (site_agent.local) changes the step through two callables:
    ``loss_term()`` returns an extra loss tensor added to the cross-entropy before backward
    (FedProx's proximal term); ``grad_hook()`` runs after backward and before the optimizer
    step (SCAFFOLD's gradient correction).

    Within a training team's session (site.yaml `training.workers`, site_agent/team.py) the same batches are
    spread over the team's workers.
    """
    team = TEAM.get()
    if team is not None:
        return team.train(model, x, y, train, seed=seed, steps=_step_budget(train, steps), loss_term=loss_term,
                          grad_hook=grad_hook)
    make_optimizer, xt, yt, n = _prepare(model, x, y, train)
    optimizer = make_optimizer(model.parameters(), train.optimizer)
    taken, loss_sum, seen = minibatch_steps(model, model, xt, yt, train, optimizer, seed=seed,
                                            steps=_step_budget(train, steps), loss_term=loss_term, grad_hook=grad_hook)
    train_loss = loss_sum / seen
    if not math.isfinite(train_loss):
        raise ValueError(f"training diverged (train_loss={train_loss}); lower the learning rate")
    return TrainResult(num_samples=n, steps=taken, metrics={"train_loss": train_loss})


def minibatch_steps(forward: Callable, model: nn.Module, xt: torch.Tensor, yt: torch.Tensor, train: Any,
                    optimizer: torch.optim.Optimizer, *, seed: int, steps: int | None,
                    loss_term: Callable | None = None, grad_hook: Callable | None = None, rank: int = 0,
                    world: int = 1) -> tuple[int, float, int]:
    """train_local's loop: (steps taken, loss sum, rows) over the last pass (every step in steps mode).

    `forward` is the model, or its DistributedDataParallel wrapper in a training team (site_agent/team.py):
    there rank `rank` of `world` takes every world-th row of each batch and weighs its loss sum by
    world / batch rows, so the gradients DDP averages are those of the whole batch's mean loss.
    """
    n = len(yt)
    per_pass = math.ceil(n / train.batch_size)
    total = steps if steps is not None else train.epochs * per_pass
    device = xt.device
    was_training = model.training
    model.train()
    taken, loss_sum, seen = 0, 0.0, 0
    # Dropout draws from the global RNG: seed a fork of it so the caller's stream is untouched.
    forked = [device.index or 0] if device.type == "cuda" else []
    try:
        with seeded(seed + rank, devices=forked):
            order_rng = torch.Generator().manual_seed(seed)
            for batch in itertools.islice(_batches(n, train.batch_size, order_rng, device), total):
                if steps is None and taken % per_pass == 0:  # epochs mode reports the last pass only
                    loss_sum, seen = 0.0, 0
                rows = batch if world == 1 else batch[rank::world]
                logits = forward(xt[rows])
                if taken == 0:
                    _check_labels(yt, logits)
                if world == 1:
                    loss = F.cross_entropy(logits, yt[rows])
                    objective, rows_loss = loss, loss.item() * len(rows)
                else:
                    loss = F.cross_entropy(logits, yt[rows], reduction="sum")
                    objective, rows_loss = loss * (world / len(batch)), loss.item()
                if loss_term is not None:
                    objective = objective + loss_term()
                optimizer.zero_grad(set_to_none=True)
                objective.backward()
                if grad_hook is not None:
                    grad_hook()
                optimizer.step()
                taken += 1
                loss_sum += rows_loss
                seen += len(rows)
    finally:
        model.train(was_training)
    return taken, loss_sum, seen


def _batches(n: int, batch_size: int, rng: torch.Generator, device: torch.device) -> Iterator[torch.Tensor]:
    """Endless minibatch indices: one seeded permutation per pass, the last batch of a pass may be short."""
    while True:
        order = torch.randperm(n, generator=rng).to(device)
        for start in range(0, n, batch_size):
            yield order[start:start + batch_size]


def _step_budget(train: Any, steps: int | None) -> int | None:
    """The exact number of steps to take, or None for ``train.epochs`` passes."""
    if steps is None:
        return getattr(train, "steps", None)  # already checked by _check_train
    if isinstance(steps, bool) or not isinstance(steps, int):
        raise TypeError(f"steps must be an integer or None, got {steps!r}")
    if steps < 1:
        raise ValueError(f"steps must be >= 1 (or None to use train.steps/epochs), got {steps}")
    if steps > MAX_STEPS:   # the coordinator's number (a task's local_steps): a site takes no more than train.steps may
        raise ValueError(f"{steps} local steps were asked for; a site takes at most {MAX_STEPS} in a round")
    return steps


def train_local_dp_sgd(model: nn.Module, x: np.ndarray, y: np.ndarray, train: Any, dp_sgd: Any, *, seed: int,
                       ledger: PrivacyLedger | None = None, dp_seed: int | None = None) -> TrainResult:
    """Train ``model`` in place with Opacus DP-SGD (per-example clipping, Poisson batches, noise σC).

    Privacy across rounds: pass the site's `ledger` for this job (persist it with
    ``ledger.to_json()`` between rounds); Opacus's optimizer hook steps it in place,
    and metrics["epsilon"] is the ε accumulated over every round it has seen.
    Randomness: `seed` drives dropout, as in train_local. Batch sampling and noise
    come from `dp_seed`, drawn from the OS when None: the coordinator knows `seed`,
    and DP-SGD's guarantee assumes nobody can predict the noise or the batches.
    A fixed dp_seed (tests, reproducible runs) gives the same bits every time.
    """
    from opacus import PrivacyEngine  # heavy import, only on sites that run DP-SGD
    from opacus.validators.errors import UnsupportedError

    make_optimizer, xt, yt, n = _prepare(model, x, y, train)
    device = xt.device
    ledger = PrivacyLedger() if ledger is None else ledger
    dp_seed = secrets.randbits(63) if dp_seed is None else dp_seed
    if isinstance(dp_seed, bool) or not isinstance(dp_seed, int) or not 0 <= dp_seed < 1 << 63:
        raise ValueError(f"dp_seed must be an integer in [0, 2**63) or None, got {dp_seed!r}")
    sampling = torch.Generator().manual_seed(dp_seed)
    noise_seed = int.from_bytes(hashlib.sha256(b"plexus/v1/dp-sgd-noise" + dp_seed.to_bytes(8, "big")).digest()[:8],
                                "big") >> 1
    noise = torch.Generator(device=device).manual_seed(noise_seed)
    sample_rate, planned_steps = dp_sgd_schedule(n, train.batch_size, train.epochs)

    with warnings.catch_warnings():  # Opacus warns that secure_mode is off; the docstring says why
        warnings.simplefilter("ignore", UserWarning)
        engine = PrivacyEngine(accountant="rdp")
    engine.accountant = ledger.accountant  # Opacus's step hook records straight into the site's ledger
    engine.secure_rng = sampling  # Opacus hands it to its Poisson DPDataLoader
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(xt, yt), batch_size=train.batch_size)
    try:
        hooks, optimizer, loader = engine.make_private(
            module=model, optimizer=make_optimizer(model.parameters(), train.optimizer), data_loader=loader,
            noise_multiplier=dp_sgd.noise_multiplier, max_grad_norm=dp_sgd.max_grad_norm,
            poisson_sampling=True, noise_generator=noise, wrap_model=False)
    except UnsupportedError as exc:  # e.g. BatchNorm mixes samples, so per-sample gradients do not exist
        raise ConfigError(f"model {type(model).__name__} cannot be trained with DP-SGD: {exc}") from None
    if 1 / len(loader) != sample_rate or train.epochs * len(loader) != planned_steps:
        raise RuntimeError("Opacus's batch schedule differs from plexus.accounting.dp_sgd_schedule; "
                           "the site policy's ε would be wrong")

    was_training = model.training
    model.train()
    steps, loss_sum, seen = 0, 0.0, 0
    forked = [device.index or 0] if device.type == "cuda" else []
    try:
        with seeded(seed, devices=forked), warnings.catch_warnings():
            # Opacus's per-sample hooks make torch warn on every backward pass when the inputs
            # need no gradient (they never do here); it is not actionable, so keep site logs clean.
            warnings.filterwarnings("ignore", message="Full backward hook is firing", category=UserWarning)
            for _ in range(train.epochs):
                loss_sum, seen = 0.0, 0
                for xb, yb in loader:
                    logits = model(xb)
                    if steps == 0:
                        _check_labels(yt, logits)
                    # An empty Poisson batch still takes a (pure-noise) step: the accountant counts every step.
                    loss = F.cross_entropy(logits, yb) if len(yb) else logits.sum() * 0.0
                    optimizer.zero_grad(set_to_none=True)
                    loss.backward()
                    optimizer.step()
                    steps += 1
                    loss_sum += loss.item() * len(yb)
                    seen += len(yb)
    finally:
        model.train(was_training)
        hooks.cleanup()
        for param in model.parameters():
            for attr in ("grad_sample", "summed_grad", "_forward_counter"):
                if hasattr(param, attr):
                    delattr(param, attr)
    train_loss = loss_sum / max(seen, 1)
    if not math.isfinite(train_loss):
        raise ValueError(f"training diverged (train_loss={train_loss}); lower the learning rate")
    return TrainResult(num_samples=n, steps=steps,
                       metrics={"train_loss": train_loss, "epsilon": ledger.epsilon(dp_sgd.delta)})


@torch.no_grad()
def evaluate(model: nn.Module, x: np.ndarray, y: np.ndarray) -> dict[str, float]:
    """Loss, accuracy and sample count of ``model`` on (x, y); "auc" too for two classes when both occur.

    A regression model (plexus.objectives' squared error) reports loss = mean ½(ŷ − y)², mse and the count.
    """
    xt, yt = _tensors(x, y, model)
    n = len(yt)
    if n == 0:
        raise ValueError("no evaluation samples: x and y are empty")
    was_training = model.training
    model.eval()
    try:
        logits = torch.cat([model(xt[i:i + _EVAL_BATCH]) for i in range(0, n, _EVAL_BATCH)])
    finally:
        model.train(was_training)
    if loss_name(model) == "squared_error":
        error = (logits.reshape(-1) - yt).double()
        return {"loss": 0.5 * (error ** 2).mean().item(), "mse": (error ** 2).mean().item(), "num_samples": float(n)}
    _check_labels(yt, logits)
    metrics = {
        "loss": F.cross_entropy(logits, yt).item(),
        "accuracy": (logits.argmax(dim=1) == yt).double().mean().item(),
        "num_samples": float(n),
    }
    labels = yt.cpu().numpy()
    if logits.shape[1] == 2 and 0 < labels.sum() < n:
        # The logit margin ranks samples exactly as the softmax probability, without saturating.
        metrics["auc"] = roc_auc(labels, (logits[:, 1] - logits[:, 0]).double().cpu().numpy())
    return metrics


def roc_auc(y_true: np.ndarray, scores: np.ndarray) -> float:
    """Area under the ROC curve via the Mann-Whitney U statistic, ties given average ranks."""
    y_true = np.asarray(y_true)
    scores = np.asarray(scores, dtype=np.float64)
    if y_true.ndim != 1 or y_true.shape != scores.shape:
        raise ValueError(f"y_true and scores must be 1-D of equal length, got {y_true.shape} and {scores.shape}")
    if not np.isin(y_true, (0, 1)).all():
        raise ValueError("y_true must contain only 0 and 1")
    if np.isnan(scores).any():
        raise ValueError("scores contain NaN")
    positive = y_true == 1
    n_pos = int(positive.sum())
    n_neg = len(y_true) - n_pos
    if n_pos == 0 or n_neg == 0:
        raise ValueError("ROC AUC is undefined when y_true holds only one class")
    order = np.argsort(scores, kind="mergesort")
    sorted_scores = scores[order]
    # Tied scores share the mean of the 1-based ranks they span.
    starts = np.flatnonzero(np.r_[True, sorted_scores[1:] != sorted_scores[:-1]])
    ends = np.r_[starts[1:], len(scores)]
    ranks = np.empty(len(scores), dtype=np.float64)
    ranks[order] = np.repeat((starts + ends + 1) / 2.0, ends - starts)
    u = ranks[positive].sum() - n_pos * (n_pos + 1) / 2.0
    return float(u / (n_pos * n_neg))


def _check_train(train: Any) -> None:
    for name in ("epochs", "batch_size"):
        value = getattr(train, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"train.{name} must be a positive integer, got {value!r}")
    steps = getattr(train, "steps", None)
    if steps is not None and (isinstance(steps, bool) or not isinstance(steps, int) or steps < 1):
        raise ConfigError(f"train.steps must be a positive integer or null, got {steps!r}")
    opt = train.optimizer
    if not (isinstance(opt.lr, (int, float)) and math.isfinite(opt.lr) and opt.lr > 0):
        raise ConfigError(f"train.optimizer.lr must be a positive number, got {opt.lr!r}")
    if not 0.0 <= opt.momentum < 1.0:
        raise ConfigError(f"train.optimizer.momentum must be in [0, 1), got {opt.momentum!r}")
    if not 0.0 <= opt.weight_decay:
        raise ConfigError(f"train.optimizer.weight_decay must be >= 0, got {opt.weight_decay!r}")


def _tensors(x: np.ndarray, y: np.ndarray, model: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """x in the model's float dtype (float64 models take float64 rows) on its device; y as class labels, or as
    targets in that dtype for a regression model."""
    param = next(model.parameters(), None)
    device = param.device if param is not None else torch.device("cpu")
    dtype = param.dtype if param is not None and param.is_floating_point() else torch.float32
    regression = loss_name(model) == "squared_error"
    x = np.asarray(x)
    y = np.asarray(y)
    if x.dtype.kind not in "biuf":
        raise TypeError(f"x must be numeric, got dtype {x.dtype}")
    if y.dtype.kind not in ("biuf" if regression else "iu"):
        raise TypeError(f"y must hold {'numeric targets' if regression else 'integer class labels'}, "
                        f"got dtype {y.dtype}")
    if y.ndim != 1 or x.ndim < 1 or len(x) != len(y):
        raise ValueError(f"x and y must have the same number of rows, got shapes {x.shape} and {y.shape}")
    return (torch.tensor(x, dtype=dtype, device=device),
            torch.tensor(y, dtype=dtype if regression else torch.int64, device=device))


def _check_labels(y: torch.Tensor, logits: torch.Tensor) -> None:
    if len(y) and (int(y.min()) < 0 or int(y.max()) >= logits.shape[1]):
        raise ValueError(
            f"labels must be in 0..{logits.shape[1] - 1} for a model with {logits.shape[1]} outputs, "
            f"got labels from {int(y.min())} to {int(y.max())}"
        )
