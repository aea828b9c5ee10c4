"""A model's data loss over a batch of rows, summed: Σ ℓ_i, Σ ∇ℓ_i and Σ ∇²ℓ_i at the model's weights.

The exact strategies (lbfgs, newton) are built on these sums: each site sends them over all its training
rows and the coordinator adds them up. ℓ_i is the row's loss without any penalty: cross-entropy for a
classifier (the loss site training uses), ½(ŷ − y)² for the regression model `linear` (a model class
names its loss in a `loss` attribute, a key of ROW_LOSSES).

Gradients and Hessians are over the model's parameters in `named_parameters()` order, each flattened,
concatenated (d entries). Everything is computed in float64 on a float64 copy of the model in eval mode
(dropout off), whatever the model's own dtype: logistic and linear regression in closed form, any other
model with torch.func. Rows go through a chunk at a time, so memory stays near CHUNK_BYTES whatever their
number. Pure functions of (model, rows): the model itself is never changed.
"""

from __future__ import annotations

import copy
import math
import numbers
from collections.abc import Callable, Iterator

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad, jacrev, vmap

from plexus.models import Linear, Logistic

CHUNK_BYTES = 64 << 20   # the float64 intermediates of one chunk of rows stay about this size


def _cross_entropy(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out, y, reduction="none")


def _squared_error(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return 0.5 * (out.reshape(y.shape) - y) ** 2


# ℓ_i per row from the model's outputs [n, outputs] and labels [n]: a model class's `loss` attribute picks one.
ROW_LOSSES: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "cross_entropy": _cross_entropy, "squared_error": _squared_error}


def loss_name(model: nn.Module) -> str:
    """The key of the model's row loss in ROW_LOSSES: its class's `loss`, cross-entropy when it names none."""
    name = getattr(model, "loss", "cross_entropy")
    if name not in ROW_LOSSES:
        raise ValueError(f"model {type(model).__name__} names row loss {name!r}; known losses: {sorted(ROW_LOSSES)}")
    return name


def dimension(model: nn.Module) -> int:
    """d: how many numbers the model's parameters hold, the length of its gradient."""
    return sum(p.numel() for _, p in model.named_parameters())


def flat_parameters(model: nn.Module) -> np.ndarray:
    """The model's parameters as one float64 vector, in `named_parameters()` order."""
    return np.concatenate([p.detach().cpu().to(torch.float64).reshape(-1).numpy()
                           for _, p in model.named_parameters()] or [np.zeros(0)])


def row_losses(model: nn.Module, x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """ℓ_i for every row, float64 [n]."""
    work, rows = _prepare(model, x, y)
    loss = ROW_LOSSES[loss_name(work)]
    with torch.no_grad():
        parts = [loss(work(xc), yc) for xc, yc in rows(_width(work, x))]
    return torch.cat(parts).numpy() if parts else np.zeros(0)


def loss_sum(model: nn.Module, x: np.ndarray, y: np.ndarray) -> float:
    """Σ_i ℓ_i over the rows."""
    return float(row_losses(model, x, y).sum())


def gradient_sum(model: nn.Module, x: np.ndarray, y: np.ndarray, *, clip_norm: float | None = None) -> np.ndarray:
    """Σ_i ∇ℓ_i, float64 [d]; with clip_norm, each row's gradient is first scaled to L2 norm <= clip_norm."""
    if clip_norm is not None:
        clip_norm = _positive(clip_norm, "clip_norm")
    work, rows = _prepare(model, x, y)
    closed = _CLOSED_FORM.get(type(model))
    total = torch.zeros(dimension(work), dtype=torch.float64)
    if closed is not None:
        with torch.no_grad():
            for xc, yc in rows(_width(work, x)):
                total += closed.gradient(work.linear, xc, yc, clip_norm)
    elif clip_norm is None:
        for xc, yc in rows(_width(work, x)):
            total += _flat(torch.autograd.grad(ROW_LOSSES[loss_name(work)](work(xc), yc).sum(),
                                               list(work.parameters()), allow_unused=True), work)
    else:
        for xc, yc in rows(_width(work, x) + len(total)):   # a chunk holds a d-vector per row
            total += _clipped_by_autograd(work, xc, yc, clip_norm)
    return total.numpy()


def hessian_sum(model: nn.Module, x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Σ_i ∇²ℓ_i, float64 [d, d] (symmetric)."""
    work, rows = _prepare(model, x, y)
    d = dimension(work)
    total = torch.zeros(d, d, dtype=torch.float64)
    closed = _CLOSED_FORM.get(type(model))
    if closed is not None:
        with torch.no_grad():
            outputs = work.linear.out_features
            for xc, yc in rows(outputs * outputs * (work.linear.in_features + 1)):
                total += closed.hessian_blocks(work.linear, xc, yc)
            return closed.in_parameter_order(work.linear, total).numpy()
    for xc, yc in rows(d * _width(work, x)):   # the outer jacrev carries d cotangents per row
        total += _hessian_by_autograd(work, xc, yc)
    return ((total + total.T) / 2).numpy()


def clip_factors(norms: torch.Tensor, clip_norm: float) -> torch.Tensor:
    """Per-row factors min(1, C/‖g_i‖) that scale row gradients of these L2 norms to norm <= C."""
    # A hair under C, so that rounding in a scaled row's own norm cannot land above it.
    bound = clip_norm * (1.0 - 1e-12)
    return torch.where(norms > bound, bound / torch.clamp(norms, min=bound), torch.ones_like(norms))


# closed forms ------------------------------------------------------------------------------------
def _with_ones(x: torch.Tensor) -> torch.Tensor:
    """[x, 1]: the inputs each weight row sees, the bias's last."""
    return torch.cat([x, torch.ones(len(x), 1, dtype=x.dtype)], dim=1)


class _Softmax:
    """Multinomial logistic regression, z = xWᵀ + b: ∇ℓ = (p − e_y) ⊗ [x, 1], ∇²ℓ = (diag p − ppᵀ) ⊗ [x, 1][x, 1]ᵀ."""

    @staticmethod
    def gradient(layer: nn.Linear, x: torch.Tensor, y: torch.Tensor, clip_norm: float | None) -> torch.Tensor:
        p = torch.softmax(layer(x), dim=1)
        r = p - F.one_hot(y, p.shape[1]).to(p.dtype)                     # [n, K]
        if clip_norm is not None:   # ‖(p − e) ⊗ [x, 1]‖ = ‖p − e‖ · ‖[x, 1]‖
            r = r * clip_factors(r.norm(dim=1) * _with_ones(x).norm(dim=1), clip_norm)[:, None]
        return torch.cat([(r.T @ x).reshape(-1), r.sum(dim=0)])

    @staticmethod
    def hessian_blocks(layer: nn.Linear, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The Hessian as [K·(f+1), K·(f+1)] blocks: row (class k, input a) at k·(f+1) + a."""
        xt = _with_ones(x)
        p = torch.softmax(layer(x), dim=1)                                  # [m, K]
        a = torch.diag_embed(p) - p[:, :, None] * p[:, None, :]             # [m, K, K]
        classes, width = p.shape[1], xt.shape[1]
        weighted = (a[:, :, :, None] * xt[:, None, None, :]).reshape(len(xt), -1)
        blocks = (weighted.T @ xt).reshape(classes, classes, width, width)  # [k, l, a, b]
        return blocks.permute(0, 2, 1, 3).reshape(classes * width, classes * width)

    @staticmethod
    def in_parameter_order(layer: nn.Linear, blocks: torch.Tensor) -> torch.Tensor:
        # Block row (k, a) is weight[k, a] (parameter k·f + a) for a < f, and bias[k] (parameter K·f + k) for a = f.
        classes, inputs = layer.weight.shape
        position = torch.cat([torch.arange(classes * inputs).reshape(classes, inputs),
                              (classes * inputs + torch.arange(classes))[:, None]], dim=1).reshape(-1)
        order = torch.argsort(position)
        return blocks[order][:, order]


class _LeastSquares:
    """Linear regression, ŷ = xwᵀ + b, ℓ = ½(ŷ − y)²: ∇ℓ = (ŷ − y)[x, 1], ∇²ℓ = [x, 1][x, 1]ᵀ."""

    @staticmethod
    def gradient(layer: nn.Linear, x: torch.Tensor, y: torch.Tensor, clip_norm: float | None) -> torch.Tensor:
        r = layer(x).reshape(-1) - y                                     # [n]
        if clip_norm is not None:
            r = r * clip_factors(r.abs() * _with_ones(x).norm(dim=1), clip_norm)
        return r @ _with_ones(x)

    @staticmethod
    def hessian_blocks(layer: nn.Linear, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        xt = _with_ones(x)
        return xt.T @ xt

    @staticmethod
    def in_parameter_order(layer: nn.Linear, blocks: torch.Tensor) -> torch.Tensor:
        return blocks   # the weight's entries, then the bias: the parameters' own order already


_CLOSED_FORM = {Logistic: _Softmax, Linear: _LeastSquares}


# any model: torch.func ---------------------------------------------------------------------------
def _clipped_by_autograd(work: nn.Module, x: torch.Tensor, y: torch.Tensor, clip_norm: float) -> torch.Tensor:
    """Σ_i clip(∇ℓ_i) over one chunk of rows: per-row gradients with vmap(grad)."""
    params = {n: p.detach() for n, p in work.named_parameters()}
    loss = ROW_LOSSES[loss_name(work)]

    def row_loss(theta: dict[str, torch.Tensor], xi: torch.Tensor, yi: torch.Tensor) -> torch.Tensor:
        return loss(functional_call(work, theta, (xi[None],)), yi[None])[0]

    grads = vmap(grad(row_loss), in_dims=(None, 0, 0))(params, x, y)
    rows = torch.cat([grads[n].reshape(len(x), -1) for n in params], dim=1)   # [m, d]
    return (rows * clip_factors(rows.norm(dim=1), clip_norm)[:, None]).sum(dim=0)


def _hessian_by_autograd(work: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Σ_i ∇²ℓ_i over one chunk of rows: reverse-over-reverse (jacrev of jacrev) of their summed loss."""
    named = list(work.named_parameters())
    sizes = [p.numel() for _, p in named]
    loss = ROW_LOSSES[loss_name(work)]

    def chunk_loss(flat: torch.Tensor) -> torch.Tensor:
        parts = {n: piece.reshape(p.shape) for (n, p), piece in zip(named, torch.split(flat, sizes))}
        return loss(functional_call(work, parts, (x,)), y).sum()

    return jacrev(jacrev(chunk_loss))(torch.cat([p.detach().reshape(-1) for _, p in named]))


# shared --------------------------------------------------------------------------------------------
Rows = Callable[[int], Iterator[tuple[torch.Tensor, torch.Tensor]]]


def _prepare(model: nn.Module, x: np.ndarray, y: np.ndarray) -> tuple[nn.Module, Rows]:
    """A float64 copy of the model in eval mode, and rows(per_row) yielding (x, y) chunks as float64 / label
    tensors, as many rows each as keep per_row float64 numbers per row within CHUNK_BYTES."""
    name = loss_name(model)
    x, y = np.asarray(x), np.asarray(y)
    if x.dtype.kind not in "biuf":
        raise TypeError(f"x must be numeric, got dtype {x.dtype}")
    if y.ndim != 1 or x.ndim < 1 or len(x) != len(y):
        raise ValueError(f"x and y must have the same number of rows, got shapes {x.shape} and {y.shape}")
    if name == "cross_entropy" and y.dtype.kind not in "iu":
        raise TypeError(f"y must hold integer class labels for a classifier, got dtype {y.dtype}")
    if y.dtype.kind not in "biuf":
        raise TypeError(f"y must hold numeric targets for a regression model, got dtype {y.dtype}")
    label = torch.int64 if name == "cross_entropy" else torch.float64
    work = copy.deepcopy(model).to(device="cpu", dtype=torch.float64).eval()
    if name == "cross_entropy" and len(y):
        with torch.no_grad():
            classes = work(torch.as_tensor(x[:1], dtype=torch.float64)).shape[1]
        if int(y.min()) < 0 or int(y.max()) >= classes:
            raise ValueError(f"labels must be in 0..{classes - 1} for a model with {classes} outputs, "
                             f"got {int(y.min())}..{int(y.max())}")

    def rows(per_row: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        step = max(1, CHUNK_BYTES // (8 * max(1, per_row)))
        for start in range(0, len(x), step):
            yield (torch.as_tensor(x[start:start + step], dtype=torch.float64),
                   torch.as_tensor(y[start:start + step], dtype=label))

    return work, rows


def _width(work: nn.Module, x: np.ndarray) -> int:
    """Float64 numbers a row holds at once in a forward and backward pass: its inputs and widest layer, a few times."""
    widths = [m.out_features for m in work.modules() if isinstance(m, nn.Linear)]
    return 4 * max([1, math.prod(x.shape[1:]), *widths])


def _flat(grads: tuple[torch.Tensor | None, ...], work: nn.Module) -> torch.Tensor:
    return torch.cat([(torch.zeros_like(p) if g is None else g).reshape(-1) for g, p in zip(grads, work.parameters())])


def _positive(value: float, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
    return float(value)
