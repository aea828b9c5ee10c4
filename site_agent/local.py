"""A site's half of each strategy: what it fetches, how it trains, what its update carries, what it keeps.

`LOCAL` maps each strategy name to its local training; nothing on the site switches on a
strategy's name beyond that one lookup. A strategy whose site half is plain minibatch
training maps to `PLAIN`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.numpy import load_file, save
from torch import nn

from plexus import objectives, statistics as stats
from plexus.config import strategy_args
from plexus.datasets import DataError
from plexus.dp import add_noise, distributed_std, noise_key
from plexus.errors import ConfigError
from plexus.files import write_atomically
from plexus.models import Ensemble, load_numpy_state, state_views
from plexus.wire import (
    EXACT_GRAD,
    EXACT_HESSIAN,
    EXACT_LOSS,
    EXACT_ROWS,
    SCAFFOLD_C as C_PREFIX,
    SCAFFOLD_DC as DC_PREFIX,
    Layout,
    dtype_name,
)
from site_agent.state import job_path
from site_agent.training import TrainResult, train_local

Spec = tuple[str, str, tuple[int, ...]]   # (tensor name, wire dtype, shape)


@dataclass
class LocalResult:
    """One round's local work: the training report, the update to send, and how to keep site state."""

    result: TrainResult              # num_samples, steps, metrics
    update: dict[str, np.ndarray]    # every tensor the update carries (model + extras)
    commit: Callable[[], None]       # call once the coordinator accepted the update


@dataclass(frozen=True)
class Run:
    """One round's local training as the agent asks for it."""

    job: Any                          # the job's RoundConfig
    model: nn.Module                  # already holding the served global weights
    served: Mapping[str, np.ndarray]  # everything FetchModel delivered (see served_layout)
    data: Any                         # the site's Split; a statistics job's raw table (raw_table)
    site: str
    job_id: str
    seed: int
    steps: int | None                 # None: train.steps/epochs
    state_dir: Path
    round: int = 0
    min_cell_count: int | None = None   # the site's policy.min_cell_count (statistics jobs)


class Plain:
    """Plain minibatch training: the update is the trained model; nothing extra served, sent or kept."""

    reads_served = False   # whether train() reads the served tensors (else the site may free them once loaded)
    raw_table = False      # whether train() reads the dataset's raw table (raw_table), not a training Split
    evaluates = True       # whether the site evaluates the served model (on its held-out rows)

    def served_extras(self, state: Mapping[str, np.ndarray]) -> list[Spec]:
        """The tensors besides the model that FetchModel must deliver."""
        return []

    def train(self, run: Run) -> LocalResult:
        """Train run.model in place; the update and how to keep site state once it is accepted."""
        result = train_local(run.model, run.data.x_train, run.data.y_train, run.job.train, seed=run.seed,
                             steps=run.steps)
        return LocalResult(result=result, update=state_views(run.model), commit=lambda: None)


class FedProx(Plain):
    """Li et al. 2020: (mu/2)‖w − x‖² over the trainable parameters (x: the served model) added to the loss."""

    reads_served = True

    def train(self, run: Run) -> LocalResult:
        anchor = {n: torch.as_tensor(_served(run.served, n)).reshape(p.shape)
                  for n, p in _trainable(run.model).items()}
        term = proximal_term(run.model, anchor, strategy_args(run.job.strategy).mu)
        result = train_local(run.model, run.data.x_train, run.data.y_train, run.job.train, seed=run.seed,
                             steps=run.steps, loss_term=term)
        return LocalResult(result=result, update=state_views(run.model), commit=lambda: None)


class Scaffold(Plain):
    """SCAFFOLD option II: step along g − c_k + c, then c_k⁺ = c_k − c + (x − y)/(Kη); the update adds Δc."""

    reads_served = True

    def served_extras(self, state: Mapping[str, np.ndarray]) -> list[Spec]:
        return [(C_PREFIX + name, "F32", shape) for name, shape in _float_shapes(state).items()]

    def train(self, run: Run) -> LocalResult:
        model, served = run.model, run.served
        path = scaffold_path(Path(run.state_dir), run.job_id)
        shapes = _float_shapes(state_views(model))
        params = {n: p.shape for n, p in model.named_parameters() if p.requires_grad}
        c = {n: np.asarray(_served(served, C_PREFIX + n), dtype=np.float64) for n in shapes}
        c_k = _load_control_variate(path, shapes)
        x = {n: np.asarray(_served(served, n), dtype=np.float64) for n in shapes}

        correction = {n: torch.from_numpy(c[n] - c_k[n]).reshape(shape) for n, shape in params.items()}
        result = train_local(model, run.data.x_train, run.data.y_train, run.job.train, seed=run.seed,
                             steps=run.steps, grad_hook=gradient_correction(model, correction))
        trained = state_views(model)

        scale = 1.0 / (result.steps * run.job.train.optimizer.lr)
        c_new, update = {}, dict(trained)
        for n in shapes:
            if n in params:
                value = c_k[n] - c[n] + (x[n] - trained[n].astype(np.float64)) * scale
            else:  # buffers (e.g. BatchNorm running stats) are not optimised: their c_k stays as it was
                value = c_k[n]
            c_new[n] = value.astype(np.float32)
            update[DC_PREFIX + n] = (c_new[n].astype(np.float64) - c_k[n]).astype(np.float32)
        return LocalResult(result=result, update=update, commit=lambda: _keep(path, save(c_new)))


class EnsembleMember(Plain):
    """Ensembling: the site trains only its own member of the ensemble; the update is the whole ensemble."""

    def train(self, run: Run) -> LocalResult:
        member = _ensemble_member(run.job, run.model, run.site)
        result = train_local(member, run.data.x_train, run.data.y_train, run.job.train, seed=run.seed,
                             steps=run.steps)
        return LocalResult(result=result, update=state_views(run.model), commit=lambda: None)


class Gradient(Plain):
    """lbfgs: no training. The update is the served model unchanged plus float64 sums over every training row
    at its weights (plexus.objectives): exact/grad Σ∇ℓ_i, exact/loss Σℓ_i, exact/rows n.

    Under privacy.dp each row's gradient is clipped to dp.clip_norm before the sum, and in distributed mode
    this site adds its share of the noise, N(0, (zS)²/sites.min), to it; exact/loss is 0 (the loss is not
    clipped, so it would leak outside ε).
    """

    def train(self, run: Run) -> LocalResult:
        x, y, dp = run.data.x_train, run.data.y_train, run.job.privacy.dp
        extras = self.curvature(run)
        rows = len(y)
        if dp is None:
            loss = objectives.loss_sum(run.model, x, y)
            grad = objectives.gradient_sum(run.model, x, y)
            metrics = {"train_loss": loss / rows}
        else:
            loss, metrics = 0.0, {}
            grad = objectives.gradient_sum(run.model, x, y, clip_norm=dp.clip_norm)
            if dp.mode == "distributed":   # unpredictable to the coordinator, as agent._clip_and_noise's share
                std = distributed_std(dp.noise_multiplier, dp.clip_norm, run.job.sites.min)
                grad = add_noise({EXACT_GRAD: grad}, std, noise_key(None, run.job_id, run.round, "site"))[EXACT_GRAD]
        extras |= {EXACT_GRAD: grad, EXACT_LOSS: np.array([loss]), EXACT_ROWS: np.array([float(rows)])}
        return LocalResult(result=TrainResult(num_samples=rows, steps=0, metrics=metrics),
                           update={**state_views(run.model), **extras}, commit=lambda: None)

    def curvature(self, run: Run) -> dict[str, np.ndarray]:
        """The second-order extras: none for lbfgs."""
        return {}


class Hessian(Gradient):
    """newton: lbfgs' sums plus exact/hessian Σ∇²ℓ_i [d, d]; refused under privacy.dp (the Hessian has no clip)."""

    def curvature(self, run: Run) -> dict[str, np.ndarray]:
        if run.job.privacy.dp is not None:
            raise ConfigError("strategy newton cannot run under privacy.dp: the Hessian sum is not clipped, so it "
                              "would reveal the rows outside ε; use strategy lbfgs with privacy.dp")
        return {EXACT_HESSIAN: objectives.hessian_sum(run.model, run.data.x_train, run.data.y_train)}


class Statistics(Plain):
    """A statistics job (plexus.statistics): nothing is trained or evaluated. The update is this site's sums over
    its raw table, loaded into the model (zero buffers of the sums' layout), so they travel as any update does:
    in the clear, or masked under secure aggregation. DataError (the site declines) for a cell of 1..k-1 rows
    under policy.min_cell_count: k."""

    raw_table = True
    evaluates = False

    def train(self, run: Run) -> LocalResult:
        sums = statistics_sums(run.job, run.data, min_cell_count=run.min_cell_count)
        load_numpy_state(run.model, {name: np.asarray(value) for name, value in sums.items()})
        # Every site counts once (num_samples 1): its sums are added, never weighed by its rows.
        return LocalResult(result=TrainResult(num_samples=1, steps=0, metrics={}), update=state_views(run.model),
                           commit=lambda: None)


PLAIN = Plain()
LOCAL: dict[str, Plain] = {
    "fedavg": PLAIN, "fedprox": FedProx(), "fedavgm": PLAIN, "fedadam": PLAIN, "fedyogi": PLAIN,
    "fedadagrad": PLAIN, "scaffold": Scaffold(), "median": PLAIN, "trimmed_mean": PLAIN, "krum": PLAIN,
    "multi_krum": PLAIN, "cwt": PLAIN, "swt": PLAIN, "ensemble": EnsembleMember(), "lbfgs": Gradient(),
    "newton": Hessian(), "statistics": Statistics()}


def local_training(job: Any) -> Plain:
    """The job's strategy's site half; ValueError for a strategy this site does not know."""
    try:
        return LOCAL[job.strategy.name]
    except KeyError:
        raise ValueError(f"strategy {job.strategy.name!r} is unknown to this site (known: {sorted(LOCAL)}); "
                         "upgrade the site agent to the coordinator's version") from None


def needs_served(job: Any) -> bool:
    """Whether local_update reads the served tensors (else the site may free them once loaded)."""
    return local_training(job).reads_served


def reads_raw_table(job: Any) -> bool:
    """Whether the job's local work reads the dataset's raw table (raw_table) rather than a training Split."""
    return local_training(job).raw_table


def evaluates(job: Any) -> bool:
    """Whether the site evaluates the job's served model: not a statistics job's sums."""
    return local_training(job).evaluates


def served_layout(job: Any, model: nn.Module) -> Layout:
    """What FetchModel must deliver for this job: the model's tensors plus the strategy's served extras."""
    state = state_views(model)  # the shapes exactly as the wire carries them (0-d tensors travel as [1])
    specs = [(name, dtype_name(a.dtype), a.shape) for name, a in state.items()]
    return Layout.build(specs + local_training(job).served_extras(state))


def offered_columns(dataset: Any) -> set[str] | None:
    """The columns of a dataset entry a job may read: a csv entry that lists `features` offers those and its
    label only (the hospital chose them); None: every column."""
    if dataset.kind == "csv" and dataset.features is not None:
        return {*dataset.features, dataset.label}
    return None


def raw_table(dataset: Any, name: str) -> dict[str, np.ndarray]:
    """The raw table (column -> values) of the site's dataset entry `dataset`, configured as `name`, holding only
    the columns the entry offers (offered_columns): DataError, whose `remote` says what may leave the site, when
    it cannot be read as one."""
    try:
        table = stats.read_table(dataset)
        offered = offered_columns(dataset)
        return table if offered is None else {c: v for c, v in table.items() if c in offered}
    except DataError as exc:
        raise DataError(str(exc), f"dataset {name!r}: {exc.remote}") from None
    except (ValueError, OSError) as exc:
        if dataset.kind not in ("csv", "heart-disease"):   # refused for its kind: nothing of the data in that
            raise DataError(str(exc), f"dataset {name!r}: {exc}") from None
        # Their text may name the file: it stays in this site's log.
        raise DataError(str(exc), f"dataset {name!r} cannot be read as a table at this site "
                                  f"({type(exc).__name__}); the site's log says why") from None


def check_statistics_columns(job: Any, dataset: Any, table: Mapping[str, np.ndarray]) -> None:
    """DataError, whose `remote` names every difference, unless the table (raw_table of the site's entry
    `dataset`) has the columns the statistics job describes, of their declared kinds, and the entry offers them."""
    spec, offered = job.statistics, offered_columns(dataset)
    asked = [c.name for c in spec.columns] + ([spec.group_by.column] if spec.group_by is not None else [])
    if offered is not None and (withheld := [c for c in dict.fromkeys(asked) if c not in offered]):
        raise DataError(f"dataset {job.data.dataset!r}: the job asks for columns {withheld}, which its entry's "
                        "features and label do not list",
                        f"dataset {job.data.dataset!r} offers only the columns this site lists for it, and the job "
                        f"asks for {len(withheld)} more: {withheld}; describe only offered columns")
    problems = stats.schema_problems(spec, table)
    if problems:
        text = "; ".join(problems)
        raise DataError(f"dataset {job.data.dataset!r}: {text}",
                        f"dataset {job.data.dataset!r} does not match the job's statistics columns: {text}")


def statistics_sums(job: Any, table: Mapping[str, np.ndarray], *, min_cell_count: int | None) -> dict[str, np.ndarray]:
    """A statistics job's sums over this site's raw table; DataError (the site declines) for a cell of 1..k-1 rows
    under policy.min_cell_count: k."""
    try:
        return stats.site_sums(job.statistics, table, min_cell_count=min_cell_count)
    except stats.SmallCells as exc:   # names cells of the job's spec (group, column, bin), not their counts
        raise DataError(str(exc), f"dataset {job.data.dataset!r}: {exc}") from None


def local_update(job: Any, model: nn.Module, served: Mapping[str, np.ndarray], data: Any, *, site: str,
                 job_id: str, seed: int, local_steps: int, state_dir: Path, round_: int = 0,
                 min_cell_count: int | None = None) -> LocalResult:
    """Train ``model`` (already holding the served global weights) the way the job's strategy asks.

    ``served`` is everything FetchModel delivered (see served_layout); ``local_steps`` 0 means
    train.steps/epochs. Nothing is written to ``state_dir`` until ``commit`` is called.
    ``min_cell_count`` is the site's policy.min_cell_count (statistics jobs).
    """
    run = Run(job=job, model=model, served=served, data=data, site=site, job_id=job_id, seed=seed,
              steps=local_steps or None, state_dir=Path(state_dir), round=round_, min_cell_count=min_cell_count)
    return local_training(job).train(run)


class ProximalTerm:
    """A train_local loss_term: (mu/2)·Σ‖w − anchor[name]‖² over the trainable parameters (any optimizer). Its
    data (mu, anchor) is kept, so that training spread over workers (site_agent/team.py) can rebuild it there."""

    def __init__(self, model: nn.Module, anchor: Mapping[str, torch.Tensor | np.ndarray] | None, mu: float):
        if isinstance(mu, bool) or not isinstance(mu, (int, float)) or not np.isfinite(mu) or mu <= 0:
            raise ValueError(f"mu must be a finite number > 0, got {mu!r}")
        if anchor is None:
            raise ValueError("the proximal term needs an anchor: pass the global model's parameters")
        self.mu = float(mu)
        self.params = _trainable(model)
        self.anchor = _per_parameter(anchor, self.params, "anchor")

    def __call__(self) -> torch.Tensor:
        return self.mu / 2 * sum(((p - self.anchor[name]) ** 2).sum() for name, p in self.params.items())


class GradientCorrection:
    """A train_local grad_hook: add correction[name] to each trainable parameter's gradient (SCAFFOLD's c − c_k)."""

    def __init__(self, model: nn.Module, correction: Mapping[str, torch.Tensor | np.ndarray]):
        self.params = _trainable(model)
        self.correction = _per_parameter(correction, self.params, "correction")

    def __call__(self) -> None:
        for name, c in self.correction.items():
            p = self.params[name]
            if p.grad is None:  # unused in this forward pass: its gradient is zero
                p.grad = c.clone()
            else:
                p.grad.add_(c)


proximal_term = ProximalTerm
gradient_correction = GradientCorrection


def _trainable(model: nn.Module) -> dict[str, nn.Parameter]:
    return {name: p for name, p in model.named_parameters() if p.requires_grad}


def _per_parameter(values: Mapping[str, Any], params: dict[str, nn.Parameter], what: str) -> dict[str, torch.Tensor]:
    """One tensor per trainable parameter, on its device and in its dtype."""
    if missing := sorted(set(params) - set(values)):
        raise ValueError(f"{what} lacks parameter(s) {missing[:5]}; give one tensor per trainable parameter")
    out = {}
    for name, p in params.items():
        value = torch.as_tensor(values[name]).detach().to(device=p.device, dtype=p.dtype)
        if value.shape != p.shape:
            raise ValueError(f"{what}[{name!r}] has shape {tuple(value.shape)}, the parameter has {tuple(p.shape)}")
        out[name] = value
    return out


def scaffold_path(state_dir: Path, job_id: str) -> Path:
    """Where a site keeps its SCAFFOLD control variate c_k for one job."""
    return job_path(state_dir, "scaffold", job_id, ".safetensors")


def _load_control_variate(path: Path, shapes: Mapping[str, tuple[int, ...]]) -> dict[str, np.ndarray]:
    """c_k as stored by the last committed round (float64 for the arithmetic), or zeros for a new job."""
    if not path.exists():
        return {n: np.zeros(shape) for n, shape in shapes.items()}
    fix = "Delete the file to restart this site's c_k from zero"
    try:
        stored = load_file(path)  # safetensors: a header and raw bytes, never pickle
    except Exception as e:  # safetensors raises its own SafetensorError for a torn or foreign file
        raise ValueError(f"the stored SCAFFOLD control variate {path} cannot be read ({e}). {fix}") from e
    found = {n: tuple(a.shape) for n, a in stored.items()}
    if found != dict(shapes) or any(a.dtype.kind != "f" for a in stored.values()):
        differs = sorted(set(found) ^ set(shapes)) or sorted(n for n in shapes if found[n] != shapes[n])
        raise ValueError(f"the stored SCAFFOLD control variate {path} does not match this job's model "
                         f"(differs at {differs[:5]}); it belongs to another model or is damaged. {fix}")
    return {n: a.astype(np.float64) for n, a in stored.items()}


def _keep(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomically(path, data, mode=0o600)


def _ensemble_member(job: Any, model: nn.Module, site: str) -> nn.Module:
    members = list(strategy_args(job.strategy).members)
    if site not in members:
        raise ValueError(f"site {site!r} is not a member of this ensemble job (members: {members}); "
                         "only member sites train in an ensemble job")
    if not isinstance(model, Ensemble) or len(model.members) != len(members):
        raise TypeError(f"an ensemble job of {len(members)} members needs an Ensemble of {len(members)} members; "
                        "build it with plexus.models.build_job_model(job)")
    return model.members[members.index(site)]


def _float_shapes(state: Mapping[str, np.ndarray]) -> dict[str, tuple[int, ...]]:
    return {n: a.shape for n, a in state.items() if a.dtype.kind == "f"}


def _served(served: Mapping[str, np.ndarray], name: str) -> np.ndarray:
    try:
        return served[name]
    except KeyError:
        raise ValueError(f"the served state lacks tensor {name!r}; fetch the layout served_layout(job, model) "
                         "describes") from None
