"""Split learning (Gupta & Raskar 2018; Vepakomma et al. 2018): one network cut into parts held apart.

A model that can be split lists its forward pass as stages (`split_stages()`) and names the places it may be cut
(`cut_points()`: name -> stage index). Built-in `mlp` and `cnn` do; a plug-in model declares its own.

- **vanilla** (one cut): the site runs the stages before the cut on its rows and sends the cut activations and the
  labels; the server runs the rest, the loss included, and sends back the gradient at the cut.
- **u-shaped** (two cuts): the site also keeps the stages after the second cut and the labels. The server runs the
  middle and returns its output; the site computes the loss and sends the gradient of the loss back through the
  server's part. Neither raw rows nor labels leave the site.

The parts share the model's own modules, so the joined model is the model itself, and one batch through the
parts gives the unsplit model's gradients (tests/plexus/test_split.py). Everything here is pure computation on
tensors; the wire, the server's compute worker and the schedules across sites build on it.

Privacy options at the site: NoPeek (Vepakomma et al. 2019), λ · distance correlation between a batch's inputs and
its cut activations added to the site's loss; and Gaussian noise on the activations it sends. Neither is covered by
a DP accountant.

Label skew (u-shaped, where the site computes the loss): logit adjustment (Menon et al. 2021; in federated learning,
FedLC, Zhang et al. 2022) trains the site's head on logits + τ · log(the site's own label frequencies), so that each
site's head learns the class-balanced rule rather than its own label mix; evaluation uses the plain logits.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from plexus.errors import ConfigError

VARIANTS = ("vanilla", "u-shaped")


@dataclass
class SplitParts:
    """A model's parts: `bottom` at the site, `middle` at the server, `head` at the site (u-shaped) or None."""

    bottom: nn.Sequential
    middle: nn.Sequential
    head: nn.Sequential | None
    names: dict[int, str] = field(default_factory=dict, repr=False)   # id(parameter) -> the model's name for it

    @property
    def site_modules(self) -> list[nn.Module]:
        return [self.bottom] + ([self.head] if self.head is not None else [])


def cut_points(model: nn.Module) -> dict[str, int]:
    """The named cuts a model declares; ConfigError if it cannot be split. A plug-in model for split learning
    defines split_stages(), cut_points() and input_shape(), as the built-in mlp and cnn do."""
    if not (hasattr(model, "split_stages") and hasattr(model, "cut_points")):
        raise ConfigError(f"model {type(model).__name__} does not declare how it splits: a model for split learning "
                          "defines split_stages() (its forward pass as a list of modules) and cut_points() (name -> "
                          "stage index)")
    return dict(model.cut_points())


def split(model: nn.Module, variant: str, cuts: list[str]) -> SplitParts:
    """The model's parts for `variant` at the named `cuts` (one for vanilla, two in order for u-shaped)."""
    if variant not in VARIANTS:
        raise ConfigError(f"split variant {variant!r} is unknown; use one of {', '.join(VARIANTS)}")
    points = cut_points(model)
    want = 1 if variant == "vanilla" else 2
    if len(cuts) != want:
        raise ConfigError(f"a {variant} split takes {want} cut(s); got {len(cuts)}: {cuts}")
    unknown = [c for c in cuts if c not in points]
    if unknown:
        raise ConfigError(f"cut(s) {unknown} are not among this model's: {', '.join(points)}")
    stages = list(model.split_stages())
    names = {id(p): n for n, p in model.named_parameters()}
    at = [points[c] for c in cuts]
    if not all(0 < a < len(stages) for a in at) or at != sorted(set(at)):
        raise ConfigError(f"cuts {cuts} must lie strictly inside the model and in order (stages {at} of "
                          f"{len(stages)})")
    if variant == "vanilla":
        return SplitParts(nn.Sequential(*stages[:at[0]]), nn.Sequential(*stages[at[0]:]), None, names)
    return SplitParts(nn.Sequential(*stages[:at[0]]), nn.Sequential(*stages[at[0]:at[1]]),
                      nn.Sequential(*stages[at[1]:]), names)


def part_names(model: nn.Module, parts: SplitParts) -> tuple[list[str], list[str]]:
    """The model's state names held by the site (bottom and head) and by the server (middle), each sorted: the
    parts share the model's tensors, so the joined model is the union of the two, under the model's own names."""
    server = {id(t) for t in parts.middle.state_dict(keep_vars=True).values()}
    site, middle = [], []
    for name, tensor in model.state_dict(keep_vars=True).items():
        (middle if id(tensor) in server else site).append(name)
    return sorted(site), sorted(middle)


def cut_shapes(model: nn.Module, parts: SplitParts) -> tuple[tuple[int, ...], tuple[int, ...] | None]:
    """One row's shape at the first cut, and (u-shaped) at the server part's output, from the model's
    input_shape()."""
    if not hasattr(model, "input_shape"):
        raise ConfigError(f"model {type(model).__name__} does not declare input_shape() (one row's shape), which "
                          "split learning needs to check the activations at the cut")
    was = [m.training for m in (parts.bottom, parts.middle)]
    parts.bottom.eval(), parts.middle.eval()
    try:
        with torch.no_grad():
            probe = torch.zeros((2, *model.input_shape()), dtype=next(model.parameters()).dtype)
            cut = parts.bottom(probe)
            out = parts.middle(cut) if parts.head is not None else None
    finally:
        parts.bottom.train(was[0]), parts.middle.train(was[1])
    return tuple(cut.shape[1:]), (tuple(out.shape[1:]) if out is not None else None)


def distance_correlation(x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """Sample distance correlation between the rows of x and of z (Székely et al. 2007), differentiable: NoPeek's
    leakage term. 0 for independent rows, 1 when one is a similarity transform of the other."""
    a = _centred_distances(x.reshape(len(x), -1))
    b = _centred_distances(z.reshape(len(z), -1))
    dcov_xy = (a * b).mean()
    dcov_xx, dcov_yy = (a * a).mean(), (b * b).mean()
    return torch.sqrt(dcov_xy.clamp_min(0) / torch.sqrt(dcov_xx * dcov_yy).clamp_min(1e-12))


def _centred_distances(x: torch.Tensor) -> torch.Tensor:
    d = torch.cdist(x, x)
    return d - d.mean(dim=0, keepdim=True) - d.mean(dim=1, keepdim=True) + d.mean()


@dataclass
class SiteOptions:
    """The site's options: NoPeek weight λ (0: off), the std of Gaussian noise on sent activations, and (u-shaped)
    the logit adjustment τ (0: off), which needs the site's label_log_prior."""

    nopeek: float = 0.0
    noise_std: float = 0.0
    logit_adjustment: float = 0.0


def num_classes(model: nn.Module) -> int:
    """The width of a splittable model's output (one probe row of its input_shape())."""
    was = model.training
    model.eval()
    try:
        with torch.no_grad():
            return int(model(torch.zeros((1, *model.input_shape()), dtype=next(model.parameters()).dtype)).shape[1])
    finally:
        model.train(was)


def label_log_prior(y: torch.Tensor, classes: int) -> torch.Tensor:
    """log of a site's label frequencies, add-one smoothed (a class the site lacks gets a finite, low prior)."""
    counts = torch.bincount(torch.as_tensor(y, dtype=torch.int64), minlength=classes)[:classes].double() + 1.0
    return torch.log(counts / counts.sum()).float()


def site_log_prior(options: SiteOptions, y: torch.Tensor, classes: int) -> torch.Tensor | None:
    """What SiteStep's `log_prior` takes for a site with labels `y`: its label_log_prior under logit adjustment,
    else None."""
    return label_log_prior(y, classes) if options.logit_adjustment else None


class SiteStep:
    """One batch at the site, in the order the messages flow. Vanilla: `forward` (send activations and labels),
    then `backward(grad at the cut)`. U-shaped: `forward`, then `loss(server output)` (send its gradient), then
    `backward(grad at the cut)`. The site's optimizer steps once, at `backward`."""

    def __init__(self, parts: SplitParts, optimizer: torch.optim.Optimizer, options: SiteOptions = SiteOptions(),
                 *, generator: torch.Generator | None = None, log_prior: torch.Tensor | None = None):
        if options.logit_adjustment and (parts.head is None or log_prior is None):
            raise ValueError("logit adjustment needs a u-shaped split (the site's head computes the loss) and the "
                             "site's label_log_prior")
        self.parts, self.optimizer, self.options, self.generator = parts, optimizer, options, generator
        self._shift = options.logit_adjustment * log_prior if options.logit_adjustment else None
        self._cut: torch.Tensor | None = None
        self._nopeek: torch.Tensor | None = None
        self._rows = 0
        self._named: list[tuple[str, nn.Parameter]] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The activations to send (detached; noised if asked)."""
        self.optimizer.zero_grad(set_to_none=True)
        cut = self.parts.bottom(x)
        self._cut, self._rows = cut, len(x)
        self._nopeek = self.options.nopeek * distance_correlation(x, cut) if self.options.nopeek else None
        sent = cut.detach()
        if self.options.noise_std:
            sent = sent + self.options.noise_std * torch.randn(sent.shape, generator=self.generator,
                                                               dtype=sent.dtype)
        return sent

    def loss(self, server_out: torch.Tensor, y: torch.Tensor, weight: float = 1.0) -> tuple[torch.Tensor, float]:
        """U-shaped: the head's loss on the server's output, times `weight` (synchronous SplitFed: this site's share
        of the turn's rows); (the weighted loss's gradient to send back, the unweighted loss)."""
        h = server_out.detach().requires_grad_(True)
        logits = self.parts.head(h)
        loss = F.cross_entropy(logits if self._shift is None else logits + self._shift, y)
        (loss * weight if weight != 1.0 else loss).backward()
        return h.grad, float(loss.detach())

    def backward(self, grad_at_cut: torch.Tensor, *, step: bool = True) -> None:
        """Finish the batch: the gradient at the cut (and NoPeek's own) through the bottom part; one step, or with
        `step=False` the gradients left in place (synchronous SplitFed sums them over the sites first: `apply`)."""
        if grad_at_cut.shape != self._cut.shape:
            raise ValueError(f"the gradient at the cut has shape {tuple(grad_at_cut.shape)}; the activations had "
                             f"{tuple(self._cut.shape)}")
        if self._nopeek is not None:
            torch.autograd.backward([self._cut, self._nopeek], [grad_at_cut, torch.ones_like(self._nopeek)])
        else:
            self._cut.backward(grad_at_cut)
        if step:
            self.optimizer.step()
        self._cut = self._nopeek = None

    def gradients(self) -> dict[str, torch.Tensor]:
        """The site parts' gradients by the model's parameter names (a parameter the batch did not reach: zeros)."""
        return {name: p.grad if p.grad is not None else torch.zeros_like(p) for name, p in self.named_parameters()}

    def apply(self, summed: dict[str, torch.Tensor] | None) -> None:
        """Synchronous SplitFed: step on the sum of every site's gradients of its parts (None: no site had rows this
        turn, and nothing steps)."""
        if summed is None:
            return
        for name, p in self.named_parameters():
            p.grad = summed[name].clone()
        self.optimizer.step()

    def named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """The site parts' parameters under the model's names, in a fixed order."""
        if self._named is None:
            self._named = [(self.parts.names[id(p)], p) for m in self.parts.site_modules for p in m.parameters()]
        return self._named


class ServerStep:
    """One batch at the server. Vanilla: `vanilla(activations, labels)` returns the gradient at the cut (and the
    loss). U-shaped: `forward(activations)` returns the middle's output, `backward(its gradient)` the gradient at
    the cut. The server's optimizer steps once per batch."""

    def __init__(self, parts: SplitParts, optimizer: torch.optim.Optimizer):
        self.parts, self.optimizer = parts, optimizer
        self._a: torch.Tensor | None = None
        self._out: torch.Tensor | None = None

    def vanilla(self, activations: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, float]:
        self.optimizer.zero_grad(set_to_none=True)
        a = activations.detach().requires_grad_(True)
        loss = F.cross_entropy(self.parts.middle(a), y)
        loss.backward()
        self.optimizer.step()
        return a.grad, float(loss.detach())

    def forward(self, activations: torch.Tensor) -> torch.Tensor:
        self.optimizer.zero_grad(set_to_none=True)
        self._a = activations.detach().requires_grad_(True)
        self._out = self.parts.middle(self._a)
        return self._out.detach()

    @property
    def waiting(self) -> tuple[int, ...] | None:
        """U-shaped: the shape of the output whose gradient `backward` awaits (None: no forward is pending)."""
        return tuple(self._out.shape) if self._out is not None else None

    def forget(self) -> None:
        """Drop a pending forward whose gradient will not come (its site dropped)."""
        self._a = self._out = None

    def backward(self, grad_out: torch.Tensor) -> torch.Tensor:
        if grad_out.shape != self._out.shape:
            raise ValueError(f"the gradient of the server's output has shape {tuple(grad_out.shape)}; the output "
                             f"had {tuple(self._out.shape)}")
        self._out.backward(grad_out)
        self.optimizer.step()
        grad, self._a, self._out = self._a.grad, None, None
        return grad


def train_batch(site: SiteStep, server: ServerStep, x: torch.Tensor, y: torch.Tensor) -> float:
    """One batch through both sides in process (what the messages carry, in order); the batch's loss."""
    a = site.forward(x)
    if site.parts.head is None:
        grad, loss = server.vanilla(a, y)
    else:
        out = server.forward(a)
        grad_out, loss = site.loss(out, y)
        grad = server.backward(grad_out)
    site.backward(grad)
    return loss


def message_bytes(parts: SplitParts, x: torch.Tensor) -> dict[str, int]:
    """Bytes one batch puts on the wire each way (float32 activations and gradients, int64 labels for vanilla):
    {'up': site → server, 'down': server → site}."""
    with torch.no_grad():
        a = parts.bottom(x)
        up, down = a.numel() * 4, a.numel() * 4
        if parts.head is None:
            up += len(x) * 8
        else:
            out = parts.middle(a)
            down += out.numel() * 4
            up += out.numel() * 4
    return {"up": up, "down": down}


# Schedules across sites, in process: the reference the federated schedules follow ---------------------------------
def epoch_batches(n: int, batch_size: int, generator: torch.Generator) -> list[torch.Tensor]:
    """One epoch's batches over n rows: row indices in the generator's order, batch_size at a time."""
    order = torch.randperm(n, generator=generator)
    return [order[k:k + batch_size] for k in range(0, n, batch_size)]


def site_generator(seed: int, k: int) -> torch.Generator:
    """Site k's generator for an epoch seeded `seed` (its batch order, and its activation noise)."""
    return torch.Generator().manual_seed(seed * 1_000_003 + k)


def sequential_epoch(model: nn.Module, parts: SplitParts, server: ServerStep, sites: list[tuple], make_optimizer,
                     *, batch_size: int, seed: int, options: SiteOptions = SiteOptions()) -> float:
    """Gupta & Raskar's schedule: the sites take turns, each training on all its rows (x, y) from the site-side
    weights the previous one left; the server's part carries on throughout. `model` holds those weights (the
    parts share its modules); each turn's site optimizer is new (its state never leaves a site). Mean loss."""
    losses = []
    classes = num_classes(model)
    for k, (x, y) in enumerate(sites):
        generator = site_generator(seed, k)
        site = SiteStep(parts, make_optimizer([p for m in parts.site_modules for p in m.parameters()]), options,
                        generator=generator, log_prior=site_log_prior(options, y, classes))
        for rows in epoch_batches(len(x), batch_size, generator):
            losses.append(train_batch(site, server, x[rows], y[rows]))
    return sum(losses) / max(1, len(losses))


def splitfed_epoch(model: nn.Module, variant: str, cuts: list[str], server: ServerStep, sites: list[tuple],
                   make_optimizer, *, batch_size: int, seed: int, options: SiteOptions = SiteOptions(),
                   plan: Callable[[int, torch.Generator], list[torch.Tensor]] | None = None) -> float:
    """SplitFed (Thapa et al. 2022): every site starts the epoch from the same site-side weights (the model's) and
    trains its own copy against the one server part, the sites' batches taking turns; at the epoch's end the
    site-side parts are averaged, weighted by rows, into the model. `plan(rows, generator)` cuts a site's rows
    into its batches (default: `epoch_batches` of batch_size; an empty batch is skipped). Mean loss."""
    import copy

    copies, steps, plans = [], [], []
    classes = num_classes(model)
    for k, (x, y) in enumerate(sites):
        mine = copy.deepcopy(model)
        parts = split(mine, variant, cuts)
        parts.middle = server.parts.middle   # one server part for all
        generator = site_generator(seed, k)
        copies.append(mine)
        steps.append(SiteStep(parts, make_optimizer([p for m in parts.site_modules for p in m.parameters()]),
                              options, generator=generator, log_prior=site_log_prior(options, y, classes)))
        plans.append(plan(len(x), generator) if plan else epoch_batches(len(x), batch_size, generator))
    losses = []
    for turn in range(max(len(p) for p in plans)):
        for k, (x, y) in enumerate(sites):
            if turn < len(plans[k]) and len(plans[k][turn]):
                rows = plans[k][turn]
                losses.append(train_batch(steps[k], server, x[rows], y[rows]))
    average_site_parts(model, variant, cuts, copies, [len(x) for x, _ in sites])
    return sum(losses) / max(1, len(losses))


def turn_shares(n: int, turns: int, generator: torch.Generator) -> list[torch.Tensor]:
    """A site's n rows, in the generator's order, cut into `turns` consecutive shares as even as rows allow (so
    every site's rows last the same number of turns, each share proportional to the site's rows)."""
    order = torch.randperm(n, generator=generator)
    return [order[t * n // turns:(t + 1) * n // turns] for t in range(turns)]


def synchronous_epoch(model: nn.Module, variant: str, cuts: list[str], server: ServerStep, sites: list[tuple],
                      make_optimizer, *, batch_size: int, seed: int, options: SiteOptions = SiteOptions(),
                      generators: list[torch.Generator] | None = None) -> float:
    """Synchronous SplitFed (`split.schedule: synchronous`, coordinator/drivers/split_sync.py runs it federated):
    each of ⌈rows / batch_size⌉ turns takes every site's share of batch_size rows (`turn_shares`), the server steps
    once on the turn's activations from all sites, and every site applies the sum of the sites' gradients of their
    parts (each site's loss weighted by its share of the turn's rows), so the site parts stay equal. That is the
    step one unsplit model takes on the turn's rows, up to the order of float sums (tests/plexus/test_split.py).
    Each site's copy has its own optimizer for the epoch; `model` gets their (equal) site parts at its end. Site k
    draws its shares (and its activation noise) from generators[k] (default: site_generator(seed, k)). Mean loss
    over turns."""
    import copy

    total = sum(len(x) for x, _ in sites)
    turns = -(-total // batch_size)
    classes = num_classes(model)
    steps, plans = [], []
    for k, (x, y) in enumerate(sites):
        mine = split(copy.deepcopy(model), variant, cuts)
        mine.middle = server.parts.middle
        generator = generators[k] if generators is not None else site_generator(seed, k)
        steps.append(SiteStep(mine, make_optimizer([p for m in mine.site_modules for p in m.parameters()]), options,
                              generator=generator, log_prior=site_log_prior(options, y, classes)))
        plans.append(turn_shares(len(x), turns, generator))
    losses = []
    for turn in range(turns):
        here = [k for k in range(len(sites)) if len(plans[k][turn])]
        if not here:   # shares are whole rows: with very small sites a turn can have none
            continue
        xs = [sites[k][0][plans[k][turn]] for k in here]
        ys = [sites[k][1][plans[k][turn]] for k in here]
        sizes, rows = [len(y) for y in ys], sum(len(y) for y in ys)
        a = torch.cat([steps[k].forward(x) for k, x in zip(here, xs)])
        if variant == "vanilla":
            grad, loss = server.vanilla(a, torch.cat(ys))
        else:
            out, grads, loss = server.forward(a), [], 0.0
            for k, o, y in zip(here, out.split(sizes), ys):
                g, share_loss = steps[k].loss(o, y, len(y) / rows)
                grads.append(g)
                loss += share_loss * len(y) / rows
            grad = server.backward(torch.cat(grads))
        losses.append(loss)
        for k, g in zip(here, grad.split(sizes)):
            steps[k].backward(g, step=False)
        # every site, with rows this turn or not, applies the same sum: the copies and their momentum stay equal
        gradients = [steps[k].gradients() for k in here]
        summed = {name: sum(g[name] for g in gradients) for name in gradients[0]}
        for step in steps:
            step.apply(summed)
    with torch.no_grad():   # every copy's site parts are the same: take the first's
        target = split(model, variant, cuts)
        for which in ("bottom", "head"):
            if getattr(target, which) is not None:
                getattr(target, which).load_state_dict(getattr(steps[0].parts, which).state_dict())
    return sum(losses) / max(1, len(losses))


def average_site_parts(model: nn.Module, variant: str, cuts: list[str], copies: list[nn.Module],
                       weights: list[int]) -> None:
    """Set `model`'s site-side parts to the copies' weighted mean (in float64, then the parameter's dtype)."""
    target = split(model, variant, cuts)
    total = float(sum(weights))
    sources = [split(c, variant, cuts) for c in copies]
    with torch.no_grad():
        for which in ("bottom", "head"):
            mine = getattr(target, which)
            if mine is None:
                continue
            theirs = [dict(getattr(s, which).named_parameters()) for s in sources]
            for name, p in mine.named_parameters():
                p.copy_(sum(w / total * t[name].double() for w, t in zip(weights, theirs)).to(p.dtype))
