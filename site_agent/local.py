"""A site's part of each strategy: what it fetches, how it trains, what its update carries."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.numpy import load_file, save
from torch import nn

from plexus.files import write_atomically
from plexus.models import Ensemble, state_views
from plexus.wire import SCAFFOLD_C as C_PREFIX, SCAFFOLD_DC as DC_PREFIX, Layout, dtype_name
from site_agent.state import job_path
from site_agent.training import TrainResult, train_local



@dataclass
class LocalResult:
    """One round's local work: the training report, the update to send, and how to keep site state."""

    result: TrainResult              # num_samples, steps, metrics
    update: dict[str, np.ndarray]    # every tensor the update carries (model + extras)
    commit: Callable[[], None]       # call once the coordinator accepted the update


def needs_served(job: Any) -> bool:
    """Whether local_update reads the served tensors (else the site may free them once loaded)."""
    return job.strategy.name in ("fedprox", "scaffold")


def served_layout(job: Any, model: nn.Module) -> Layout:
    """What FetchModel must deliver for this job: the model's tensors plus the strategy's served extras."""
    state = state_views(model)  # the shapes exactly as the wire carries them (0-d tensors travel as [1])
    specs = [(name, dtype_name(a.dtype), a.shape) for name, a in state.items()]
    if job.strategy.name == "scaffold":
        specs += [(C_PREFIX + name, "F32", shape) for name, shape in _float_shapes(state).items()]
    return Layout.build(specs)


def local_update(job: Any, model: nn.Module, served: Mapping[str, np.ndarray], data: Any, *, site: str,
                 job_id: str, seed: int, local_steps: int, state_dir: Path) -> LocalResult:
    """Train ``model`` (already holding the served global weights) the way the job's strategy asks.

    ``served`` is everything FetchModel delivered (see served_layout); ``local_steps`` 0 means
    train.steps/epochs. Nothing is written to ``state_dir`` until ``commit`` is called.
    """
    steps = local_steps or None
    name = job.strategy.name
    if name == "fedprox":
        params = {n: p for n, p in model.named_parameters() if p.requires_grad}
        anchor = {n: torch.as_tensor(_served(served, n)).reshape(p.shape) for n, p in params.items()}
        result = train_local(model, data.x_train, data.y_train, job.train, seed=seed, steps=steps,
                             prox_mu=job.strategy.args.get("mu", 0.01), anchor=anchor)
    elif name == "scaffold":
        return _scaffold(job, model, served, data, job_id=job_id, seed=seed, steps=steps, state_dir=Path(state_dir))
    elif name == "ensemble":
        member = _ensemble_member(job, model, site)
        result = train_local(member, data.x_train, data.y_train, job.train, seed=seed, steps=steps)
    else:
        result = train_local(model, data.x_train, data.y_train, job.train, seed=seed, steps=steps)
    return LocalResult(result=result, update=state_views(model), commit=lambda: None)


def scaffold_path(state_dir: Path, job_id: str) -> Path:
    """Where a site keeps its SCAFFOLD control variate c_k for one job."""
    return job_path(state_dir, "scaffold", job_id, ".safetensors")


def _scaffold(job: Any, model: nn.Module, served: Mapping[str, np.ndarray], data: Any, *, job_id: str, seed: int,
              steps: int | None, state_dir: Path) -> LocalResult:
    """SCAFFOLD option II: step along g − c_k + c, then c_k⁺ = c_k − c + (x − y)/(Kη)."""
    path = scaffold_path(state_dir, job_id)
    shapes = _float_shapes(state_views(model))
    params = {n: p.shape for n, p in model.named_parameters() if p.requires_grad}
    c = {n: np.asarray(_served(served, C_PREFIX + n), dtype=np.float64) for n in shapes}
    c_k = _load_control_variate(path, shapes)
    x = {n: np.asarray(_served(served, n), dtype=np.float64) for n in shapes}

    correction = {n: torch.from_numpy(c[n] - c_k[n]).reshape(shape) for n, shape in params.items()}
    result = train_local(model, data.x_train, data.y_train, job.train, seed=seed, steps=steps, correction=correction)
    trained = state_views(model)

    scale = 1.0 / (result.steps * job.train.optimizer.lr)
    c_new, update = {}, dict(trained)
    for n in shapes:
        if n in params:
            value = c_k[n] - c[n] + (x[n] - trained[n].astype(np.float64)) * scale
        else:  # buffers (e.g. BatchNorm running stats) are not optimised: their c_k stays as it was
            value = c_k[n]
        c_new[n] = value.astype(np.float32)
        update[DC_PREFIX + n] = (c_new[n].astype(np.float64) - c_k[n]).astype(np.float32)
    return LocalResult(result=result, update=update, commit=lambda: _keep(path, save(c_new)))


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
    members = list(job.strategy.args["members"])
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
