"""The model registry: model names a round config may use, and state <-> numpy conversion."""

from __future__ import annotations

import functools
import hashlib
import importlib.machinery
import inspect
import math
import numbers
import os
import sys
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from plexus.config import ensemble_members
from plexus.errors import ConfigError, IntegrityError

ENTRY_POINT_GROUP = "plexus.models"

# torch's default generator is one per process, and fork_rng puts back on exit the state it found on entry: another
# thread's seeded block that starts or ends inside this one changes what this one draws. Seeded blocks take turns.
_GLOBAL_RNG = threading.RLock()


@contextmanager
def seeded(seed: int, *, devices: Sequence[int] = ()) -> Iterator[None]:
    """torch's global RNG (and `devices`' CUDA ones) seeded with `seed` for the block and restored after, with no
    other thread's seeded block in between: what the block draws depends on `seed` alone, in any thread."""
    with _GLOBAL_RNG, torch.random.fork_rng(devices=list(devices)):
        torch.manual_seed(seed)
        yield


def _int_arg(model: str, name: str, value: Any, *, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ConfigError(f"model {model!r}: argument {name!r} must be an integer, got {value!r}")
    if value < minimum:
        raise ConfigError(f"model {model!r}: argument {name!r} must be >= {minimum}, got {value}")
    return int(value)


# The float types a model's `dtype` argument names. float64 is for the exact strategies (lbfgs, newton), whose
# iterate must travel without float32's rounding.
DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "float64": torch.float64}


def _dtype_arg(model: str, value: Any) -> torch.dtype:
    if not isinstance(value, str) or value not in DTYPES:
        raise ConfigError(f"model {model!r}: argument 'dtype' must be one of {sorted(DTYPES)}, got {value!r}")
    return DTYPES[value]


class Logistic(nn.Module):
    """Multinomial logistic regression: one linear layer producing logits."""

    def __init__(self, in_features: int, num_classes: int = 2, dtype: str = "float32") -> None:
        super().__init__()
        self.linear = nn.Linear(
            _int_arg("logistic", "in_features", in_features, minimum=1),
            _int_arg("logistic", "num_classes", num_classes, minimum=2),
        )
        self.to(_dtype_arg("logistic", dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)


class Linear(nn.Module):
    """Linear regression: ŷ = xwᵀ + b, one output, fitted to float labels with the squared error ½(ŷ − y)²."""

    loss = "squared_error"   # plexus.objectives.ROW_LOSSES; the classifiers' is cross-entropy

    def __init__(self, in_features: int, outputs: int = 1, dtype: str = "float32") -> None:
        super().__init__()
        if _int_arg("linear", "outputs", outputs, minimum=1) != 1:
            raise ConfigError(f"model 'linear': argument 'outputs' must be 1 (one regression target per row), "
                              f"got {outputs}")
        self.linear = nn.Linear(_int_arg("linear", "in_features", in_features, minimum=1), 1)
        self.to(_dtype_arg("linear", dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)


class MLP(nn.Module):
    """Fully connected Linear/ReLU(/Dropout) stack producing logits."""

    def __init__(
        self,
        in_features: int,
        hidden: Sequence[int] = (32,),
        num_classes: int = 2,
        dropout: float = 0.0,
        dtype: str = "float32",
    ) -> None:
        super().__init__()
        width = _int_arg("mlp", "in_features", in_features, minimum=1)
        if isinstance(hidden, (str, bytes)) or not isinstance(hidden, Sequence):
            raise ConfigError(f"model 'mlp': argument 'hidden' must be a list of layer widths, got {hidden!r}")
        if isinstance(dropout, bool) or not isinstance(dropout, numbers.Real) or not 0.0 <= dropout < 1.0:
            raise ConfigError(f"model 'mlp': argument 'dropout' must be a number in [0, 1), got {dropout!r}")
        layers: list[nn.Module] = []
        for size in hidden:
            size = _int_arg("mlp", "hidden", size, minimum=1)
            layers += [nn.Linear(width, size), nn.ReLU()]
            if dropout > 0:
                layers.append(nn.Dropout(float(dropout)))
            width = size
        layers.append(nn.Linear(width, _int_arg("mlp", "num_classes", num_classes, minimum=2)))
        self.layers = nn.Sequential(*layers)
        self.to(_dtype_arg("mlp", dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)

    def split_stages(self) -> list[nn.Module]:
        """Split learning (plexus.split): the forward pass as a sequence of stages."""
        return list(self.layers)

    def input_shape(self) -> tuple[int, ...]:
        """Split learning: one row's shape, from which the shape at each cut follows."""
        return (self.layers[0].in_features,)

    def cut_points(self) -> dict[str, int]:
        """Split learning: each hidden layer's output ("hidden1", ...) as a cut, by stage index."""
        cuts, hidden = {}, 0
        for i, layer in enumerate(self.layers):
            if isinstance(layer, (nn.ReLU, nn.Dropout)) and not isinstance(self.layers[i + 1], nn.Dropout):
                hidden += 1
                cuts[f"hidden{hidden}"] = i + 1
        return cuts


class CNN(nn.Module):
    """Two conv/ReLU/max-pool blocks and a linear head, for (N, C, H, W) images like Fashion-MNIST."""

    def __init__(self, in_channels: int = 1, image_size: int = 28, num_classes: int = 10, width: int = 16) -> None:
        super().__init__()
        channels = _int_arg("cnn", "in_channels", in_channels, minimum=1)
        # Two 2x2 poolings must leave at least one pixel.
        size = _int_arg("cnn", "image_size", image_size, minimum=4)
        width = _int_arg("cnn", "width", width, minimum=1)
        self.features = nn.Sequential(
            nn.Conv2d(channels, width, kernel_size=3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(width, 2 * width, kernel_size=3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
        )
        self.head = nn.Linear(2 * width * (size // 4) ** 2, _int_arg("cnn", "num_classes", num_classes, minimum=2))
        self._input = (channels, size, size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.flatten(self.features(x), 1))

    def split_stages(self) -> list[nn.Module]:
        """Split learning (plexus.split): the forward pass as a sequence of stages."""
        return [*self.features, nn.Flatten(1), self.head]

    def input_shape(self) -> tuple[int, ...]:
        """Split learning: one image's shape (channels, size, size)."""
        return self._input

    def cut_points(self) -> dict[str, int]:
        """Split learning: after each conv block ("block1", "block2"), and at the flattened features ("features")."""
        return {"block1": 3, "block2": 6, "features": 7}


class Vector(nn.Module):
    """A bare float32 parameter vector of `size` elements: for benchmarks of the wire, not for learning."""

    def __init__(self, size: int, chunks: int = 1) -> None:
        super().__init__()
        size = _int_arg("vector", "size", size, minimum=1)
        chunks = _int_arg("vector", "chunks", chunks, minimum=1)
        if chunks > size:
            raise ConfigError(f"model 'vector': chunks ({chunks}) cannot exceed size ({size})")
        bounds = [size * i // chunks for i in range(chunks + 1)]
        self.parts = nn.ParameterList(nn.Parameter(torch.zeros(b - a)) for a, b in zip(bounds, bounds[1:]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("the 'vector' model is a parameter container for benchmarks; it has no forward pass")


class Statistics(nn.Module):
    """A statistics job's "model": one zero float64 buffer per sum plexus.statistics.layout lists, so that the
    sums travel as any model does (served, summed, checkpointed, downloaded). It has no forward pass.

    The arguments are the job's statistics block as plain data (plexus.config.statistics_args).
    """

    def __init__(self, **statistics: Any) -> None:
        super().__init__()
        from plexus import statistics as stats
        from plexus.config import statistics_spec_from_args
        from plexus.wire import DTYPES

        spec = statistics_spec_from_args(statistics)
        for name, dtype, shape in stats.layout(spec):
            if "." in name:   # state names are dotted paths of submodules; a buffer's own name cannot hold one
                raise ConfigError(f"model 'statistics': sum {name!r} has a '.' in its name; plexus.statistics.layout "
                                  "must name its sums without one")
            self.register_buffer(name, torch.from_numpy(np.zeros(shape, dtype=DTYPES[dtype])))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("the 'statistics' model holds a statistics job's sums and has no forward pass; nothing "
                           "evaluates or trains it (plexus.statistics.figures reads its sums)")


class Ensemble(nn.Module):
    """K member models whose softmaxes are mixed with the normalised buffer `weights` (uniform while it sums to 0).

    The forward pass returns log(Σ_i w_i softmax(member_i(x))), so code that takes logits
    (cross-entropy, argmax, AUC on the margin) works on it unchanged. It is computed in the
    log domain and clamped at log(smallest normal float), so it is never -inf. State names
    are `members.<i>.<name>` and `weights` (float32, shape [K], zeros when built).
    """

    def __init__(self, members: Sequence[nn.Module]) -> None:
        super().__init__()
        if len(members) < 2:
            raise ConfigError(f"an ensemble needs at least 2 members, got {len(members)}")
        self.members = nn.ModuleList(members)
        self.register_buffer("weights", torch.zeros(len(members), dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        log_probs = torch.stack([torch.log_softmax(member(x), dim=-1) for member in self.members])  # [K, N, C]
        w = self.weights.to(log_probs.dtype)
        total = w.sum()
        w = torch.where(total != 0, w / total, torch.full_like(w, 1.0 / len(w)))
        mixed = torch.logsumexp(log_probs + torch.log(w).view(-1, *([1] * (log_probs.dim() - 1))), dim=0)
        return mixed.clamp_min(math.log(torch.finfo(mixed.dtype).tiny))


def member_seed(seed: int, index: int) -> int:
    """The init seed of ensemble member ``index``: SHA-256("plexus/v1/ensemble-member" ‖ seed ‖ index), 63 bits."""
    digest = hashlib.sha256(b"plexus/v1/ensemble-member" + int(seed).to_bytes(8, "big", signed=True)
                            + int(index).to_bytes(8, "big")).digest()
    return int.from_bytes(digest[:8], "big") >> 1


REGISTRY: dict[str, Callable[..., nn.Module]] = {
    "logistic": Logistic, "linear": Linear, "mlp": MLP, "cnn": CNN, "vector": Vector, "statistics": Statistics}


def installed_models() -> set[str]:
    """Names of the built-in models and of the installed plug-ins, read from metadata: no plug-in code runs.

    A site lists and checks models with this; it imports a plug-in only after its
    policy allowed it and its pin matched (site_agent.policy.refusal).
    """
    return set(REGISTRY) | _plugin_names(entry_points, _paths_fingerprint())


@functools.lru_cache(maxsize=4)
def _plugin_names(reader, fingerprint: tuple) -> frozenset[str]:
    """The plug-in names `reader` (importlib.metadata.entry_points) finds, read again whenever `fingerprint`
    changes: a scan of every distribution's metadata takes milliseconds, and a site checks each task."""
    return frozenset(ep.name for ep in reader(group=ENTRY_POINT_GROUP))


def _paths_fingerprint() -> tuple:
    """sys.path with each folder's modification time: installing or removing a distribution adds or removes its
    metadata folder in one of them, which changes that folder's time."""
    found = []
    for entry in sys.path:
        try:
            found.append((entry, os.stat(entry or ".").st_mtime_ns))
        except OSError:
            found.append((entry, None))
    return tuple(found)


def available_models() -> dict[str, Callable[..., nn.Module]]:
    """Built-in models plus those installed under the ``plexus.models`` entry-point group (imports every plug-in)."""
    models = {ep.name: ep for ep in entry_points(group=ENTRY_POINT_GROUP) if ep.name not in REGISTRY}
    return {**{name: _load_plugin(ep) for name, ep in models.items()}, **REGISTRY}


def build_model(name: str, args: Mapping[str, Any], *, seed: int, members: int = 0) -> nn.Module:
    """Construct model ``name`` with ``args``, its weights initialised from ``seed`` alone.

    ``members`` >= 2 builds an Ensemble of that many copies, member i initialised from
    ``member_seed(seed, i)``; 0 builds the plain model.
    """
    if isinstance(members, bool) or not isinstance(members, numbers.Integral):
        raise TypeError(f"members must be an integer, got {members!r}")
    if members:
        if members < 2:
            raise ConfigError(f"an ensemble needs at least 2 members, got {members}; use members=0 for one model")
        return Ensemble([build_model(name, args, seed=member_seed(seed, i)) for i in range(members)])
    factory = _lookup(name)
    if not isinstance(args, Mapping):
        raise ConfigError(f"model {name!r}: args must be a mapping of argument names to values, got {args!r}")
    _check_args(name, factory, args)
    with seeded(seed):   # from the seed alone, whatever other threads draw; the caller's global RNG untouched
        try:
            model = factory(**args)
        except ConfigError as e:
            accepted = _accepted(factory)   # none listed: the factory checks its own (e.g. statistics)
            raise ConfigError(f"{e}; accepted arguments: {accepted}" if accepted else str(e)) from None
    if not isinstance(model, nn.Module):
        raise TypeError(f"model {name!r} factory returned {type(model).__name__}, not a torch.nn.Module")
    return model


def state_bytes(name: str, args: Mapping[str, Any], *, members: int = 0) -> int:
    """The bytes of model `name`'s state (parameters and buffers) built with `args`, counted on torch's meta device:
    nothing is allocated and no weights are drawn, so a model far larger than this machine's memory is sized in
    milliseconds. Raises what building it raises (ConfigError for bad arguments; a plug-in that cannot be built on
    the meta device raises its own error)."""
    with torch.device("meta"):
        model = build_model(name, args, seed=0, members=members)
    return sum(t.numel() * t.element_size() for t in model.state_dict().values())


def build_job_model(job: Any) -> nn.Module:
    """The model a job (RoundConfig) trains: an Ensemble of one member per listed site for strategy `ensemble`."""
    return build_model(job.model.name, job.model.args, seed=job.seed, members=ensemble_members(job))


def state_to_numpy(model: nn.Module) -> dict[str, np.ndarray]:
    """The model's state as detached, contiguous CPU numpy copies, sorted by name."""
    return {name: array.copy() for name, array in state_views(model).items()}


def state_views(model: nn.Module) -> dict[str, np.ndarray]:
    """The model's state as contiguous numpy arrays that share a CPU model's memory, sorted by name:
    no copy of the model, and they change as the model does (load_numpy_state copies in place)."""
    return {
        name: np.ascontiguousarray(tensor.detach().cpu().numpy())
        for name, tensor in sorted(model.state_dict().items())
    }


def load_numpy_state(model: nn.Module, state: Mapping[str, np.ndarray]) -> None:
    """Copy ``state`` into ``model``; names and shapes must match exactly (nothing is copied otherwise)."""
    current = model.state_dict()
    missing = sorted(set(current) - set(state))
    if missing:
        raise IntegrityError(f"state is missing tensor {missing[0]!r} (missing: {missing})")
    unexpected = sorted(set(state) - set(current))
    if unexpected:
        raise IntegrityError(f"state has unexpected tensor {unexpected[0]!r} (unexpected: {unexpected})")
    for name, target in current.items():
        value = state[name]
        if not isinstance(value, np.ndarray):
            raise TypeError(f"state tensor {name!r} is a {type(value).__name__}, not a numpy array")
        if value.shape != tuple(target.shape):
            raise IntegrityError(
                f"state tensor {name!r} has shape {value.shape}, the model expects {tuple(target.shape)}"
            )
    with torch.no_grad():
        for name, target in current.items():
            target.copy_(torch.tensor(state[name]))


def plugin_source_sha256(name: str) -> str:
    """SHA-256 (hex) of a plug-in model's source, read from disk without importing the plug-in.

    The hash covers the whole top-level module or package its entry point names:
    a single file hashes as its bytes (what `sha256sum` prints); a package hashes
    as the sorted "<sha256>  <relative path>" lines of every .py file in it.
    """
    if name in REGISTRY:
        raise ConfigError(f"model {name!r} is built in, not a plug-in; only plug-ins are pinned by hash")
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if ep.name == name:
            break
    else:
        raise ConfigError(f"no plug-in model {name!r} is installed (entry-point group {ENTRY_POINT_GROUP!r}); "
                          f"available models: {sorted(installed_models())}")
    top = ep.module.partition(".")[0]
    # PathFinder searches sys.path for the files now on disk, runs nothing and ignores sys.modules.
    spec = importlib.machinery.PathFinder.find_spec(top)
    if spec is None or spec.origin is None or not spec.has_location:
        raise ConfigError(f"model plugin {name!r} ({ep.value}): cannot locate the source of module {top!r}")
    if spec.submodule_search_locations:
        root = Path(spec.submodule_search_locations[0])
        lines = [f"{hashlib.sha256(p.read_bytes()).hexdigest()}  {p.relative_to(root).as_posix()}\n"
                 for p in sorted(root.rglob("*.py"))]
        return hashlib.sha256("".join(lines).encode()).hexdigest()
    return hashlib.sha256(Path(spec.origin).read_bytes()).hexdigest()


def _lookup(name: str) -> Callable[..., nn.Module]:
    if name in REGISTRY:
        return REGISTRY[name]
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if ep.name == name:
            return _load_plugin(ep)
    raise ConfigError(f"unknown model {name!r}; available models: {sorted(installed_models())}")


def _load_plugin(ep: Any) -> Callable[..., nn.Module]:
    try:
        factory = ep.load()
    except Exception as e:  # a broken plugin must name itself, not surface as a bare ImportError
        raise ConfigError(f"model plugin {ep.name!r} ({ep.value}) failed to load: {e}") from e
    if not callable(factory):
        raise ConfigError(f"model plugin {ep.name!r} ({ep.value}) is not callable")
    return factory


def _check_args(name: str, factory: Callable[..., nn.Module], args: Mapping[str, Any]) -> None:
    params = inspect.signature(factory).parameters.values()
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return
    accepted = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    for arg in args:
        if arg not in accepted:
            raise ConfigError(
                f"model {name!r} has no argument {arg!r}; accepted arguments: {_accepted(factory)}"
            )
    for p in params:
        if p.name in accepted and p.default is p.empty and p.name not in args:
            raise ConfigError(
                f"model {name!r} needs argument {p.name!r}; accepted arguments: {_accepted(factory)}"
            )


def _accepted(factory: Callable[..., nn.Module]) -> str:
    params = inspect.signature(factory).parameters.values()
    return ", ".join(
        p.name if p.default is p.empty else f"{p.name}={p.default!r}"
        for p in params
        if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
    )
