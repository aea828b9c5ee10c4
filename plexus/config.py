"""Typed Plexus configuration: YAML validated into frozen dataclasses, loaded once.

Every problem raises ConfigError reading ``<source>:<line>: <key.path>: <problem>; <fix>``.
The schema lives here; plexus.typed_yaml reads any of its dataclasses from their type hints. Per-field
range checks live in field metadata, cross-field checks in ``_CROSS_CHECKS``, strategy arguments in
``STRATEGY_ARGS`` (read after strategy.name, so their errors carry the line too).
"""

from __future__ import annotations

import codecs
import dataclasses
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import yaml
from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode

from plexus import typed_yaml
from plexus.errors import ConfigError
from plexus.typed_yaml import Cell, in_range, matching, non_empty, one_of

__all__ = [
    "AdminConfig", "Cell", "CompressionSpec", "CoordinatorConfig", "DownlinkSpec", "DPSGDSpec", "DPSpec", "DataSpec",
    "DatasetSpec", "EmulationSpec",
    "FeatureSpec", "GroupSpec", "LBFGSArgs", "LabelSpec", "ModelSpec", "NewtonArgs",
    "OptimizerSpec", "PolicySpec", "PrivacySpec", "RelayConfig", "RoundConfig", "SUMMING_STRATEGIES", "SiteConfig",
    "SitesSpec", "StatColumnSpec", "StatDPSpec", "StatisticsSpec", "StrategySpec", "TierSpec", "TrainSpec",
    "UplinkSpec", "dump_round_config", "dump_site_config",
    "load_admin_config", "load_coordinator_config", "load_relay_config", "load_round_config", "load_site_config",
    "parse_round_config", "split_address", "statistics_args", "statistics_spec_from_args",
]

from plexus.datasets import HOSPITALS, cell_number, feature_inputs


def split_address(addr: str) -> tuple[str, int]:
    """Split "host:port" or "[v6]:port" into (host, port); the host comes back unbracketed."""
    host, sep, port = addr.rpartition(":")
    example = "write it like 'coordinator.example.org:8443' or '[::1]:8443'"
    if not sep or not host or not (port.isascii() and port.isdigit()):
        raise ValueError(f"{addr!r} is not host:port; {example}")
    if host.startswith("[") and host.endswith("]") and len(host) > 2:
        host = host[1:-1]
    elif ":" in host or "[" in host or "]" in host:
        raise ValueError(f"{addr!r} has a bare IPv6 host; put it in brackets, e.g. '[::1]:8443'")
    if any(c.isspace() or c == "/" for c in host):
        raise ValueError(f"{addr!r} has an invalid host; {example}")
    if int(port) > 65535:
        raise ValueError(f"port {int(port)} in {addr!r} is out of range; use a port in 0..65535")
    return host, int(port)


# Field checks beyond typed_yaml's: metadata={"check": fn}, fn(value) -> "<problem>; <fix>" or None.
def _window() -> dict:
    def check(value: int) -> str | None:
        if value == 0 or 1 << 14 <= value <= 1 << 30:
            return None
        return f"{value!r} is out of range; use 0 (gRPC's adaptive windows) or a size in [16384, 1073741824]"

    return {"check": check}


def _encoding() -> dict:
    def check(value: str) -> str | None:
        try:
            codecs.lookup(value)
        except LookupError:
            return f"{value!r} is not a text encoding Python knows; use e.g. utf-8, latin-1 or cp1252"
        return None

    return {"check": check}


def _delimiter() -> dict:
    def check(value: str) -> str | None:
        if len(value) == 1 and value not in "\"\r\n":
            return None
        return f"{value!r} is not a one-character delimiter; use e.g. ',' or ';' or a tab (\"\\t\")"

    return {"check": check}


# A site agent retries a lost coordinator with exponential backoff capped here, each wait stretched by up to
# this jitter; a coordinator's rejoin grace must outlast the longest such wait (site_agent.agent uses these).
SITE_BACKOFF_CAP_S = 8.0
SITE_BACKOFF_JITTER = 0.25


def _rejoin_grace() -> dict:
    longest = SITE_BACKOFF_CAP_S * (1 + SITE_BACKOFF_JITTER)

    def check(value: float) -> str | None:
        if value == 0 or longest < value <= 3600:
            return None
        return (f"{value!r} is out of range; use 0 (do not wait) or more than {longest:g} s, the longest a site "
                f"waits between reconnection attempts ({SITE_BACKOFF_CAP_S:g} s backoff + "
                f"{SITE_BACKOFF_JITTER:.0%} jitter), and at most 3600")

    return {"check": check}


def _address(min_port: int) -> dict:
    def check(value: str) -> str | None:
        try:
            _, port = split_address(value)
        except ValueError as e:
            return str(e)
        if port < min_port:
            return f"port {port} is out of range; use a port in {min_port}..65535"
        return None

    return {"check": check}


def _sha256_values() -> dict:
    def check(value: dict) -> str | None:
        for name, digest in value.items():
            if not re.fullmatch(r"[0-9a-f]{64}", digest):
                return (f"{name}: {digest!r} is not a SHA-256 hex digest; use the 64 lowercase hex characters "
                        "that `plexus site pin-model NAME` prints")
        return None

    return {"check": check}


# Secure aggregation over fewer sites than this is refused (job config: sites.min; site: policy.min_secure_cohort).
MIN_SECURE_COHORT = 3
SECAGG_MAX_CLIP = 2 ** 20   # privacy.secagg.clip: at most this (a 32-bit field then keeps 10 fraction bits)


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """A model registry name and the keyword arguments for its constructor."""

    name: str
    args: dict = field(default_factory=dict)


_OMIT_NONE = {"omit_none": True}   # dump_round_config leaves the field out while it is None

# data.target: what a row's label is. A numeric target is fitted only by a regression model (its row loss is
# the squared error, plexus.objectives) and only by the strategies that sum over every row: minibatch training
# is written for classifiers.
TARGETS = ("class", "numeric")
REGRESSION_MODELS = ("linear",)


@dataclass(frozen=True, slots=True)
class LabelSpec:
    """A CSV dataset's label column and, for a class target, its classes in the order that gives indices 0..K-1."""

    column: str
    # Required for data.target class, absent for numeric (the cells are the targets themselves).
    classes: tuple[Cell, ...] | None = field(default=None, metadata={**non_empty(), **_OMIT_NONE})


@dataclass(frozen=True, slots=True)
class FeatureSpec:
    """One CSV column fed to the model, matched by name at every site, with its declared preprocessing."""

    name: str
    # Set: a categorical column, one-hot over exactly these values in this order (one model input each).
    categories: tuple[Cell, ...] | None = field(default=None, metadata=non_empty())
    impute: Cell | None = None     # an empty cell reads as this value (a number, or one of the categories)
    center: float = 0.0            # numeric columns: (value - center) / scale
    scale: float = field(default=1.0, metadata=in_range(0, lo_open=True))


@dataclass(frozen=True, slots=True)
class DataSpec:
    """The dataset name each site maps to its own local data; for CSV datasets also its schema."""

    dataset: str
    # Left out of the dumped config when unset, so that agents older than the CSV schema still read it.
    label: LabelSpec | None = field(default=None, metadata=_OMIT_NONE)
    features: tuple[FeatureSpec, ...] | None = field(default=None, metadata={**non_empty(), **_OMIT_NONE})
    # What a row's label is: a class index 0..K-1 (classifiers), or a number (regression: model linear, fitted
    # by lbfgs or newton). Left out of the dumped config at "class", so that older agents still read it.
    target: str = field(default="class", metadata={**one_of(*TARGETS), "omit_default": True})


@dataclass(frozen=True, slots=True)
class StrategySpec:
    """An aggregation strategy registry name and its arguments, as written (`strategy_args` types them)."""

    name: str = "fedavg"
    args: dict = field(default_factory=dict)   # dumped as written, so a job's canonical config never changes
    # The args read into the strategy's dataclass (STRATEGY_ARGS) when parsed from YAML, so their errors
    # carry the line; not a YAML key, never dumped. None when built in code: strategy_args() reads them then.
    typed: Any = field(default=None, compare=False, repr=False, metadata={"derived": True})


# A round waits for its sites at most a day (as a relay's tier does): longer waits are a stalled job (use
# sites.retries), and gRPC takes a call timeout of ~1e10 s as already expired.
MAX_WAIT_S = 86400.0
MAX_SITES = 100_000
MAX_STEPS = 10_000_000   # local steps a round may ask of a site (train.steps, or a task's local_steps)
MAX_TURNS = 1_000_000    # batches one Split session may have (a synchronous epoch's turns)


@dataclass(frozen=True, slots=True)
class SitesSpec:
    """How many sites a round needs and how long it waits for them."""

    min: int = field(default=1, metadata=in_range(1, MAX_SITES))
    deadline_s: float = field(default=300.0, metadata=in_range(0, MAX_WAIT_S, lo_open=True))
    # Client sampling (seeded by the job seed and round): train on ceil(fraction × online) sites,
    # at most `count`, never fewer than `min`. Neither set: every online site trains.
    fraction: float | None = field(default=None, metadata=in_range(0, 1, lo_open=True))
    count: int | None = field(default=None, metadata=in_range(1, MAX_SITES))
    # Who evaluates the incoming global model each round: every online site ("all"), or only
    # the sites that train this round ("participants").
    evaluate: str = field(default="all", metadata=one_of("all", "participants"))
    # The most of a round's total weight any one site may carry, should every other site weigh in with the
    # rows it reported at Join: a site reporting more samples than that counts with that cap, so no one site
    # (however many rows it claims) can take the global model over. 1: no cap.
    max_weight_share: float = field(default=0.75, metadata=in_range(0, 1, lo_open=True))
    # How many times a training round that misses its quorum (fewer than `min` updates by deadline_s) is
    # opened again, from the same global model, before the job fails. Left out of the dumped config at 0,
    # so that agents older than this key still read it.
    retries: int = field(default=0, metadata={**in_range(0, 1000), "omit_default": True})


@dataclass(frozen=True, slots=True)
class OptimizerSpec:
    """The local optimizer each site trains with."""

    name: str = field(default="sgd", metadata=one_of("sgd", "adam"))
    lr: float = field(default=0.01, metadata=in_range(0, lo_open=True))
    momentum: float = field(default=0.0, metadata=in_range(0, 1, hi_open=True))
    weight_decay: float = field(default=0.0, metadata=in_range(0))


@dataclass(frozen=True, slots=True)
class TrainSpec:
    """Local training per round."""

    epochs: int = field(default=1, metadata=in_range(1, 10_000))
    steps: int | None = field(default=None, metadata=in_range(1, MAX_STEPS))   # set: this many minibatch steps
    batch_size: int = field(default=32, metadata=in_range(1, 1_000_000))
    optimizer: OptimizerSpec = field(default_factory=OptimizerSpec)


MIN_NOISE, MAX_NOISE = 1e-6, 1e6


def _noise_multiplier() -> dict:
    """0 (clipping only), or a noise multiplier the privacy accountants can compute ε for: a positive value
    below 1e-6 divides by zero in them (ε is past 10**27 there anyway) and one above 1e6 gains nothing."""
    def check(value: float) -> str | None:
        if value == 0 or MIN_NOISE <= value <= MAX_NOISE:
            return None
        return f"{value!r} is out of range; use 0 (no noise) or a value in [{MIN_NOISE:g}, {MAX_NOISE:g}]"

    return {"check": check}


@dataclass(frozen=True, slots=True)
class DPSpec:
    """Differential privacy: where noise is added and how much."""

    mode: str = field(metadata=one_of("central", "distributed"))
    noise_multiplier: float = field(metadata=_noise_multiplier())
    clip_norm: float = field(metadata=in_range(0, lo_open=True))
    delta: float = field(default=1e-5, metadata=in_range(0, 1, lo_open=True, hi_open=True))
    target_epsilon: float | None = field(default=None, metadata=in_range(0, lo_open=True))
    # Central mode: derive the coordinator's noise from the job seed, so a rerun is bit-for-bit the same.
    # NOT private: anyone who can read the job's config can regenerate the noise and remove it. Tests only.
    reproducible_noise: bool = False


@dataclass(frozen=True, slots=True)
class DPSGDSpec:
    """Sample-level DP-SGD at each site (Opacus): per-example clipping and noise σ·C."""

    noise_multiplier: float = field(metadata=_noise_multiplier())
    max_grad_norm: float = field(metadata=in_range(0, lo_open=True))
    delta: float = field(default=1e-5, metadata=in_range(0, 1, lo_open=True, hi_open=True))


@dataclass(frozen=True, slots=True)
class SecAggSpec:
    """Secure aggregation tuning: threshold t, the per-coordinate clip of Δ, and each phase's deadline."""

    # None: a majority of the sites. Never 1: one share would rebuild a site's secret on its own.
    threshold: int | None = field(default=None, metadata=in_range(2))
    # Summing strategies (SUMMING_STRATEGIES) send sums: clip must cover each site's largest |sum| (a site refuses
    # to send one it would clip), and the pooled sums come back to within |U|²·2**-frac_bits(clip) / 2.
    clip: float = field(default=4.0, metadata=in_range(0, SECAGG_MAX_CLIP, lo_open=True))
    phase_timeout_s: float = field(default=30.0, metadata=in_range(0, 3600, lo_open=True))


@dataclass(frozen=True, slots=True)
class PrivacySpec:
    """Secure aggregation and differential privacy settings of a job."""

    secure_aggregation: bool = False
    dp: DPSpec | None = None
    dp_sgd: DPSGDSpec | None = None
    secagg: SecAggSpec = field(default_factory=SecAggSpec)


@dataclass(frozen=True, slots=True)
class StalenessSpec:
    """s(τ), the weight of an update computed from a model τ versions old (plexus.staleness)."""

    fn: str = field(default="polynomial", metadata=one_of("constant", "polynomial", "hinge"))
    a: float = field(default=0.5, metadata=in_range(0, 100))   # polynomial: (1+τ)^-a; hinge: 1/(a(τ-b)+1) past b
    b: float = field(default=4.0, metadata=in_range(0, 1_000_000))   # hinge: full weight up to τ = b


@dataclass(frozen=True, slots=True)
class TargetSpec:
    """Stop once an evaluation of the global model reaches this value of an eval metric."""

    metric: str = field(metadata=matching(r"[A-Za-z0-9_.-]{1,64}", "1-64 letters, digits, '_', '.' or '-'"))
    value: float
    higher_is_better: bool = True


@dataclass(frozen=True, slots=True)
class AsyncSpec:
    """Asynchronous, staleness-aware training (FedBuff / FedAsync): every idle site trains on the newest model
    version; updates are buffered, each weighted by s(τ)·n, and every `buffer` of them make the next version.
    The job's `rounds` is the number of versions."""

    buffer: int = field(default=2, metadata=in_range(1, 10_000))           # K updates per version
    max_staleness: int = field(default=8, metadata=in_range(0, 10_000))    # S: τ > S is refused
    staleness: StalenessSpec = field(default_factory=StalenessSpec)
    # FedAsync (Xie et al. 2019), buffer 1 only: x ← x + α·s(τ)·(x_new − x), mixing against the current model.
    mixing: float | None = field(default=None, metadata={**in_range(0, 1, lo_open=True), "omit_none": True})
    max_per_buffer: int | None = field(default=None, metadata={**in_range(1), "omit_none": True})
    evaluate_every: int | None = field(default=None, metadata={**in_range(1), "omit_none": True})   # M versions
    time_budget_s: float | None = field(default=None, metadata={**in_range(0, lo_open=True), "omit_none": True})
    target: TargetSpec | None = field(default=None, metadata={"omit_none": True})
    idle_timeout_s: float = field(default=600.0, metadata=in_range(0, MAX_WAIT_S, lo_open=True))   # no answer: fail
    # Secure aggregation: how long the first sites to finish training wait for a cohort of `buffer` to fill.
    cohort_timeout_s: float = field(default=60.0, metadata=in_range(0, MAX_WAIT_S, lo_open=True))


UPLINK_CODECS = ("none", "fp16", "int8", "int4", "topk", "adacomp", "randk")
DOWNLINK_CODECS = ("none", "fp16", "delta8", "delta4")
# Which codec takes which optional key (plexus.compression reads them; None there means its default).
UPLINK_KEYS = {"block": ("int8", "int4"), "fraction": ("topk", "randk"), "k": ("topk", "randk"),
               "error_feedback": ("topk", "randk"), "bin_conv": ("adacomp",), "bin_dense": ("adacomp",)}
DOWNLINK_KEYS = {"block": ("delta8", "delta4")}
# Rules over the weighted mean of plain model tensors: a compressed update is a Δ they can fold. Robust rules
# and ensembles judge each whole update in the clear, and SCAFFOLD's Δc travels beside the update.
COMPRESSIBLE_STRATEGIES = ("fedavg", "fedprox", "fedavgm", "fedadam", "fedyogi", "fedadagrad", "cwt", "swt")
# Under privacy.secure_aggregation: the field each uplink codec masks in (masked values and their sum are
# integers mod 2**bits), and the coarsest public grid clip / L an 8- or 16-bit field is used with. Summing n
# sites in an m-bit field takes L = 2**(m-1) - 1 - n (plexus.secagg.fixed_point.Field), so an int8 round
# takes at most 2**7 - 1 - 16 = 111 sites. int4 has no field: 2**3 - 1 - n is below 16 for every n.
SECURE_FIELD_BITS = {"none": 32, "randk": 32, "fp16": 16, "int8": 8}
MIN_GRID_LEVELS = 16


def max_secure_sites(codec: str) -> int | None:
    """The most sites one secure round may sum with this uplink codec; None: no limit (32-bit fields)."""
    bits = SECURE_FIELD_BITS[codec]
    return None if bits == 32 else 2 ** (bits - 1) - 1 - MIN_GRID_LEVELS


@dataclass(frozen=True, slots=True)
class UplinkSpec:
    """How a site's update travels (plexus.compression): as a compressed Δ from the model it was served."""

    codec: str = field(default="none", metadata=one_of(*UPLINK_CODECS))
    block: int | None = field(default=None, metadata={**in_range(16, 65536), "omit_none": True})   # int8, int4: 256
    fraction: float | None = field(default=None, metadata={**in_range(0, 1, lo_open=True), "omit_none": True})
    k: int | None = field(default=None, metadata={**in_range(1, 2 ** 31), "omit_none": True})
    error_feedback: bool | None = field(default=None, metadata={"omit_none": True})   # topk, randk: true
    bin_conv: int | None = field(default=None, metadata={**in_range(1, 1 << 20), "omit_none": True})    # adacomp: 50
    bin_dense: int | None = field(default=None, metadata={**in_range(1, 1 << 20), "omit_none": True})   # adacomp: 500


@dataclass(frozen=True, slots=True)
class DownlinkSpec:
    """How the global model travels to the sites: exact, fp16, or an 8- or 4-bit delta against the site's last
    model."""

    codec: str = field(default="none", metadata=one_of(*DOWNLINK_CODECS))
    block: int | None = field(default=None, metadata={**in_range(16, 65536), "omit_none": True})   # delta8, delta4: 256


@dataclass(frozen=True, slots=True)
class CompressionSpec:
    """Update compression, each direction separately (docs/compression.md)."""

    uplink: UplinkSpec = field(default_factory=UplinkSpec)
    downlink: DownlinkSpec = field(default_factory=DownlinkSpec)


SPLIT_VARIANTS = ("vanilla", "u-shaped")
SPLIT_SCHEDULES = ("sequential", "splitfed", "synchronous")


def _listed(choices: tuple[str, ...], what: str) -> dict:
    """A list whose every item is one of `choices`."""
    def check(value: tuple[str, ...]) -> str | None:
        bad = [v for v in value if v not in choices]
        return f"{bad[0]!r} is not a {what}; list any of {', '.join(choices)}" if bad else None

    return {"check": check}


def _split_cuts() -> dict:
    def check(value: tuple[str, ...]) -> str | None:
        if not 1 <= len(value) <= 2 or any(not isinstance(c, str) or not c for c in value):
            return f"{list(value)!r} is not one or two cut names; e.g. [hidden1] (vanilla) or [block1, features]"
        return None

    return {"check": check}


@dataclass(frozen=True, slots=True)
class SplitSpec:
    """Split learning (mode: split, docs/split-learning.md): where the model is cut and how the sites take turns.
    Each of the job's `rounds` is one epoch over every site's rows; train.batch_size and train.optimizer set both
    sides' batches and SGD."""

    variant: str = field(metadata=one_of(*SPLIT_VARIANTS))
    # The model's named cuts (its cut_points()): one for vanilla; two, in order, for u-shaped (the site keeps the
    # stages after the second, and the labels).
    cuts: tuple[str, ...] = field(metadata=_split_cuts())
    schedule: str = field(default="splitfed", metadata=one_of(*SPLIT_SCHEDULES))
    nopeek: float = field(default=0.0, metadata=in_range(0, 100))        # λ of NoPeek's distance correlation
    noise_std: float = field(default=0.0, metadata=in_range(0, 100))     # Gaussian noise on sent activations
    # u-shaped: τ of logit adjustment for label skew (plexus.split; 0: off): each site trains its head on logits +
    # τ · log(its own label frequencies), which never leave it.
    logit_adjustment: float = field(default=0.0, metadata=in_range(0, 10))
    # The longest the coordinator waits for a site's next message in a session (and for a site whose turn it is
    # at the server): past it the site is recorded as dropped and the schedule goes on without it.
    batch_timeout_s: float = field(default=60.0, metadata=in_range(0, 3600, lo_open=True))
    device: str = field(default="cpu", metadata=one_of("cpu", "cuda"))   # where the server part computes


# Statistics jobs (plexus.statistics): which columns, how they are binned and grouped, optional DP. ------------


def _stat_range() -> dict:
    def check(value: tuple[float, ...]) -> str | None:
        if len(value) != 2 or not value[0] < value[1]:
            return f"{list(value)!r} is not a range; write [lo, hi] with lo < hi, e.g. [0, 100]"
        return None

    return {"check": check}


def _quantiles() -> dict:
    def check(value: tuple[float, ...]) -> str | None:
        bad = [q for q in value if not 0 <= q <= 1]
        if bad:
            return f"{bad[0]!r} is not a quantile; use values in [0, 1], e.g. [0.25, 0.5, 0.75]"
        if len(set(value)) != len(value):
            return "lists a quantile twice; list each once"
        return None

    return {"check": check}


@dataclass(frozen=True, slots=True)
class StatColumnSpec:
    """One raw table column a statistics job describes: numeric (optionally binned) or categorical."""

    name: str
    # Numeric: [lo, hi], the histogram's span and, under DP, the clamp that bounds one row's effect on a sum.
    range: tuple[float, ...] | None = field(default=None, metadata={**_stat_range(), **_OMIT_NONE})
    bins: int | None = field(default=None, metadata={**in_range(1, 10_000), **_OMIT_NONE})   # equal-width bins
    # Set: categorical, counted per category; cells are compared as text ("0" is not "0.0").
    categories: tuple[Cell, ...] | None = field(default=None, metadata={**non_empty(), **_OMIT_NONE})


@dataclass(frozen=True, slots=True)
class GroupSpec:
    """Every statistic is computed over all rows and again per category of this column."""

    column: str
    categories: tuple[Cell, ...] = field(metadata=non_empty())


@dataclass(frozen=True, slots=True)
class StatDPSpec:
    """Differential privacy for a statistics job: noise on every query's pooled sums, epsilon per query."""

    mechanism: str = field(metadata=one_of("laplace", "gaussian"))
    epsilon: float = field(metadata=in_range(0, lo_open=True))
    delta: float = field(default=1e-5, metadata=in_range(0, 1, lo_open=True, hi_open=True))   # gaussian only


# Covariance sums one tensor per pair of numeric columns: this many columns make ~20,000 pairs.
MAX_COVARIANCE_COLUMNS = 200


@dataclass(frozen=True, slots=True)
class StatisticsSpec:
    """A statistics job's `statistics:` block: the columns, grouping, quantiles, covariance, min/max and DP."""

    columns: tuple[StatColumnSpec, ...] = field(metadata=non_empty())
    group_by: GroupSpec | None = field(default=None, metadata=_OMIT_NONE)
    quantiles: tuple[float, ...] = field(default=(), metadata=_quantiles())   # from the histograms
    covariance: bool = False
    min_max: bool = True
    dp: StatDPSpec | None = field(default=None, metadata=_OMIT_NONE)


def statistics_spec_from_args(args: dict) -> StatisticsSpec:
    """The StatisticsSpec whose plain data `statistics_args` gave (a statistics job's model args), checked."""
    source = "<statistics args>"
    node = typed_yaml.compose(yaml.safe_dump(args), source)
    reader = typed_yaml.Reader(source, checks=_CROSS_CHECKS)
    return reader.read(StatisticsSpec, node if node is not None else typed_yaml.empty_mapping(), "model.args")


def statistics_args(spec: StatisticsSpec) -> dict:
    """The block as plain data (lists, strings, numbers), unset keys left out; `statistics_spec_from_args`
    reads it back to an equal spec."""
    return _to_plain(spec)


# Exact federated optimisation (coordinator/strategies/exact.py): the models whose loss the sites know
# (plexus.objectives); logistic and linear are convex, mlp is allowed with a warning.
EXACT_STRATEGIES = ("lbfgs", "newton")
EXACT_MODELS = ("logistic", "linear", "mlp")

# Server rules that take a staleness-weighted mean of deltas, so they run asynchronously.
ASYNC_STRATEGIES = ("fedavg", "fedprox", "fedavgm", "fedadam", "fedyogi", "fedadagrad")
# Rules that sum what the sites send (MeanRule weighting "uniform"): every update weighs 1 whatever its rows,
# so the round's mean times its contributors is the pooled sum. Read by both halves: in a secure round the site
# advertises weight 1 and the coordinator refuses any other (a signed advert cannot be re-weighted).
SUMMING_STRATEGIES = frozenset({"lbfgs", "newton", "statistics"})
JOB_KINDS = ("train", "statistics")
JOB_MODES = ("federated", "split")


@dataclass(frozen=True, slots=True)
class RoundConfig:
    """One training job, as submitted with `plexus job submit`."""

    name: str = field(metadata=matching(
        r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}",
        "1-64 letters, digits, '.', '_' or '-', starting with a letter or digit"))
    model: ModelSpec
    data: DataSpec
    rounds: int = field(metadata=in_range(1, 100_000))
    strategy: StrategySpec = field(default_factory=StrategySpec)
    sites: SitesSpec = field(default_factory=SitesSpec)
    train: TrainSpec = field(default_factory=TrainSpec)
    privacy: PrivacySpec = field(default_factory=PrivacySpec)
    seed: int = field(default=0, metadata=in_range(0, 2**63 - 1))
    # Set: asynchronous training (coordinator/drivers/async_.py) with `rounds` versions; absent: synchronous rounds.
    asynchronous: AsyncSpec | None = field(default=None, metadata={"omit_none": True})
    # Set: updates (and models) travel compressed (plexus.compression); absent: dense float32 both ways.
    compression: CompressionSpec | None = field(default=None, metadata={"omit_none": True})
    # "statistics": one round of sums over the sites' raw tables (plexus.statistics, docs/statistics.md); its
    # model, rounds and strategy derive from the `statistics` block (_derive_statistics_job). Left out of the
    # dumped config at "train", so that agents older than this key still read a training job.
    kind: str = field(default="train", metadata={**one_of(*JOB_KINDS), "omit_default": True})
    statistics: StatisticsSpec | None = field(default=None, metadata={"omit_none": True})
    # "split": split learning (coordinator/drivers/split.py) as the `split` block says; left out at "federated".
    mode: str = field(default="federated", metadata={**one_of(*JOB_MODES), "omit_default": True})
    split: SplitSpec | None = field(default=None, metadata={"omit_none": True})


@dataclass(frozen=True, slots=True)
class DatasetSpec:
    """Where a site finds one named dataset; which keys it needs depends on `kind`."""

    kind: str = field(metadata=one_of("csv", "npz", "heart-disease", "fashion-mnist"))
    path: Path | None = None
    label: str | None = None   # csv: the label column; without one the file serves statistics jobs only
    hospital: str | None = field(default=None, metadata=one_of(*HOSPITALS))
    features: tuple[str, ...] | None = field(default=None, metadata=non_empty())
    test_fraction: float = field(default=0.34, metadata=in_range(0, 1, lo_open=True, hi_open=True))
    split_seed: int = 43
    # fashion-mnist: this site is share `index` of a Dirichlet(alpha) label-skew split over `sites` sites.
    sites: int | None = field(default=None, metadata=in_range(1, 10_000))
    index: int | None = field(default=None, metadata=in_range(0, 9_999))
    alpha: float | None = field(default=None, metadata=in_range(0, lo_open=True))
    limit: int | None = field(default=None, metadata=in_range(1))  # first N training rows, before splitting
    # csv: how the file is written (default UTF-8, with or without a byte-order mark, and commas).
    encoding: str | None = field(default=None, metadata=_encoding())
    delimiter: str | None = field(default=None, metadata=_delimiter())


@dataclass(frozen=True, slots=True)
class PolicySpec:
    """What a site agrees to run."""

    allowed_models: tuple[str, ...] = ()
    require_secure_aggregation: bool = False
    max_epsilon: float | None = field(default=None, metadata=in_range(0, lo_open=True))
    min_dp_noise: float | None = field(default=None, metadata=in_range(0))
    max_rounds: int | None = field(default=None, metadata=in_range(1))
    allowed_datasets: tuple[str, ...] | None = None
    # Plug-in model name -> SHA-256 (hex) of its source, as `plexus.models.plugin_source_sha256` computes it.
    plugin_sha256: dict[str, str] = field(default_factory=dict, metadata=_sha256_values())
    # Secure aggregation: the fewest sites this site masks its update with, shares secrets among and reveals
    # shares for. A sum over fewer sites tells the coordinator too much (over one site: that site's update).
    min_secure_cohort: int = field(default=MIN_SECURE_COHORT, metadata=in_range(2, 10_000))
    # Statistics jobs: decline to contribute any cell (a group, histogram bin or category) counting 1..k-1 of this
    # site's rows, naming the cells. None: every cell is sent.
    min_cell_count: int | None = field(default=None, metadata=in_range(1, 1_000_000))
    # Split learning: the variants this site takes part in. A vanilla split sends the labels with the cut
    # activations; a site whose labels must stay lists only u-shaped.
    split_variants: tuple[str, ...] = field(default=SPLIT_VARIANTS, metadata=_listed(SPLIT_VARIANTS, "split variant"))
    # ... and the schedules. `synchronous` shows the coordinator this site's gradients of its parts every turn,
    # over a share of a few rows (docs/split-learning.md); a site that must not show them leaves it out.
    split_schedules: tuple[str, ...] = field(default=SPLIT_SCHEDULES,
                                             metadata=_listed(SPLIT_SCHEDULES, "split schedule"))
    # The largest model (its parameters and buffers, in bytes) this site builds; training takes a few times that.
    # None: a quarter of this machine's memory (or of the agent's cgroup limit, where lower). A job whose model is
    # larger is declined before anything is built.
    max_model_bytes: int | None = field(default=None, metadata=in_range(1 << 20, 1 << 50))


SITE_NAME = r"[a-z0-9][a-z0-9_-]{0,62}"
SITE_NAME_RULE = "1-63 lowercase letters, digits, '_' or '-', starting with a letter or digit"


# Strategy arguments (strategy.args), one frozen dataclass per strategy: the coordinator's rule and the
# site's local training read the same ones. ----------------------------------------------------------


def _members() -> dict:
    site = re.compile(SITE_NAME)

    def check(value: tuple[str, ...]) -> str | None:
        bad = next((s for s in value if not site.fullmatch(s)), None)
        if bad is not None:
            return f"{bad!r} is not a site name ({SITE_NAME_RULE})"
        if len(value) < 2:
            return f"lists {len(value)} site(s); list at least 2 member sites, one per ensemble model"
        if len(set(value)) != len(value):
            twice = sorted({s for s in value if value.count(s) > 1})
            return f"lists {', '.join(twice)} more than once; list each member site once"
        return None

    return {"check": check}


_RATE = in_range(0, lo_open=True)
_DECAY = in_range(0, 1, hi_open=True)


@dataclass(frozen=True, slots=True)
class NoArgs:
    """fedavg, median: no arguments."""


@dataclass(frozen=True, slots=True)
class FedProxArgs:
    mu: float = field(default=0.01, metadata=_RATE)   # weight of the proximal term (mu/2)‖w − x‖²


@dataclass(frozen=True, slots=True)
class FedAvgMArgs:
    eta: float = field(default=1.0, metadata=_RATE)
    momentum: float = field(default=0.9, metadata=_DECAY)


@dataclass(frozen=True, slots=True)
class FedAdamArgs:
    """fedadam, fedyogi."""

    eta: float = field(default=0.01, metadata=_RATE)
    beta1: float = field(default=0.9, metadata=_DECAY)
    beta2: float = field(default=0.99, metadata=_DECAY)
    tau: float = field(default=1e-3, metadata=_RATE)


@dataclass(frozen=True, slots=True)
class FedAdagradArgs:
    eta: float = field(default=0.01, metadata=_RATE)
    beta1: float = field(default=0.9, metadata=_DECAY)
    tau: float = field(default=1e-3, metadata=_RATE)


@dataclass(frozen=True, slots=True)
class ScaffoldArgs:
    eta_g: float = field(default=1.0, metadata=_RATE)   # the server's step along the mean model change


@dataclass(frozen=True, slots=True)
class TrimmedMeanArgs:
    beta: float = field(default=0.1, metadata=in_range(0, 0.5, hi_open=True))   # share trimmed at each end


@dataclass(frozen=True, slots=True)
class KrumArgs:
    f: int = field(default=1, metadata=in_range(0))   # Byzantine sites tolerated


@dataclass(frozen=True, slots=True)
class MultiKrumArgs:
    f: int = field(default=1, metadata=in_range(0))
    m: int | None = field(default=None, metadata=in_range(1))   # updates averaged; None: n − f


@dataclass(frozen=True, slots=True)
class CWTArgs:
    shuffle: bool = False        # a seeded new order every cycle, not sorted site names
    proportional: bool = False   # each site's steps ∝ its sample count (train.steps for a site of mean size)


@dataclass(frozen=True, slots=True)
class SWTArgs:
    shuffle: bool = False


@dataclass(frozen=True, slots=True)
class EnsembleArgs:
    members: tuple[str, ...] = field(metadata=_members())   # member i is trained by site members[i]
    weighted: bool = True                                   # weights ∝ each member's sample count, else uniform


_TOLERANCE = in_range(0)
_WOLFE = in_range(0, 1, lo_open=True, hi_open=True)


@dataclass(frozen=True, slots=True)
class LBFGSArgs:
    """lbfgs: minimise scikit-learn's C·Σℓ + ½‖w‖² over the pooled rows, one line-search trial per round."""

    C: float | None = field(default=1.0, metadata=_RATE)   # None: no penalty, F = Σℓ
    memory: int = field(default=30, metadata=in_range(1, 1000))          # (s, y) pairs kept: 2·memory·d floats
    gtol: float = field(default=1e-10, metadata=_TOLERANCE)              # stop at ‖∇F‖∞ <= gtol
    ftol: float = field(default=1e-14, metadata=_TOLERANCE)              # stop at relative change of F <= ftol
    max_iterations: int = field(default=100, metadata=in_range(1, 100_000))
    c1: float = field(default=1e-4, metadata=_WOLFE)                     # sufficient decrease
    c2: float = field(default=0.9, metadata=_WOLFE)                      # curvature (strong Wolfe)
    # Under privacy.dp only: the noisy gradient cannot steer a line search, so each round is one gradient-descent
    # step of this size on F/N (N: the pooled rows).
    dp_step: float = field(default=0.1, metadata=_RATE)


@dataclass(frozen=True, slots=True)
class NewtonArgs:
    """newton: damped Newton on scikit-learn's C·Σℓ + ½‖w‖², the sites also summing the d×d Hessian."""

    C: float | None = field(default=1.0, metadata=_RATE)
    gtol: float = field(default=1e-10, metadata=_TOLERANCE)
    ftol: float = field(default=1e-14, metadata=_TOLERANCE)
    max_iterations: int = field(default=50, metadata=in_range(1, 100_000))
    # d² float64 entries travel from every site each round (1000: 8 MB); larger models are refused.
    max_hessian_dim: int = field(default=1000, metadata=in_range(1, 100_000))


STRATEGY_ARGS: dict[str, type] = {
    "fedavg": NoArgs, "fedprox": FedProxArgs, "fedavgm": FedAvgMArgs, "fedadam": FedAdamArgs,
    "fedyogi": FedAdamArgs, "fedadagrad": FedAdagradArgs, "scaffold": ScaffoldArgs, "median": NoArgs,
    "trimmed_mean": TrimmedMeanArgs, "krum": KrumArgs, "multi_krum": MultiKrumArgs, "cwt": CWTArgs,
    "swt": SWTArgs, "ensemble": EnsembleArgs, "lbfgs": LBFGSArgs, "newton": NewtonArgs, "statistics": NoArgs}


def weighs_sites_equally(cfg: RoundConfig) -> bool:
    """Whether every site's update weighs 1 whatever its rows: under DP-FedAvg, and for SUMMING_STRATEGIES."""
    return cfg.privacy.dp is not None or cfg.strategy.name in SUMMING_STRATEGIES


def strategy_args(spec: StrategySpec) -> Any:
    """The strategy's arguments as its STRATEGY_ARGS dataclass, checked; ConfigError naming the key otherwise."""
    if spec.typed is not None:
        return spec.typed
    return typed_yaml.parse_value(spec.args, _args_class(spec.name, "<strategy config>:1: strategy.name: "),
                                  source="<strategy config>", path="strategy.args",
                                  arguments_of=f"strategy {spec.name!r}")


def _args_class(name: str, where: str) -> type:
    if name not in STRATEGY_ARGS:
        raise ConfigError(f"{where}unknown strategy {name!r}; known strategies: {sorted(STRATEGY_ARGS)}")
    return STRATEGY_ARGS[name]


def _read_strategy_args(reader: typed_yaml.Reader, spec: StrategySpec, entries: dict, path: str) -> StrategySpec:
    """After reading strategy.name: read strategy.args (with its lines) as that strategy's dataclass."""
    if spec.name not in STRATEGY_ARGS:
        reader.fail(entries["name"][1], f"{path}.name",
                    f"unknown strategy {spec.name!r}; known strategies: {sorted(STRATEGY_ARGS)}")
    node = entries["args"][1] if "args" in entries else typed_yaml.empty_mapping(entries.get("name", (None,))[0])
    args_reader = typed_yaml.Reader(reader.source, arguments_of=f"strategy {spec.name!r}")   # its own alias marks
    return dataclasses.replace(spec, typed=args_reader.read(STRATEGY_ARGS[spec.name], node, f"{path}.args"))


MAX_SLOWDOWN = 1000.0


def _slowdown() -> dict:
    def check(value: float) -> str | None:
        if 1 <= value <= MAX_SLOWDOWN:
            return None
        return (f"{value!r} is out of range; use a factor >= 1 (at most {MAX_SLOWDOWN:g}) on this site's training "
                "time: 1 adds no wait, 5 makes each training task take five times as long")

    return {"check": check}


@dataclass(frozen=True, slots=True)
class EmulationSpec:
    """EMULATION ONLY, never in production: make this site behave like a slower hospital, for experiments that
    reproduce a federation's heterogeneity on one machine (docs/install-site.md)."""

    # After each training task, wait (slowdown − 1) × that task's own training time before answering it, so the
    # task takes `slowdown` times as long as this machine needs. 1: no wait.
    slowdown: float = field(metadata=_slowdown())


@dataclass(frozen=True, slots=True)
class NodesSpec:
    """Training spread over several machines of one hospital (site_agent/team.py): node 0 runs the site agent and
    listens at `address` for the others, which run `plexus site node --config` with their own `rank`."""

    count: int = field(metadata=in_range(2, 1024))
    rank: int = field(metadata=in_range(0, 1023))   # this machine's node; 0 runs the site agent
    address: str = field(metadata=_address(1))      # HOST:PORT where node 0's rendezvous listens (hospital network)


@dataclass(frozen=True, slots=True)
class TrainingSpec:
    """How the site trains: `workers` processes per node with torch.distributed (DDP) over `backend`. The job's
    train.batch_size is the batch of one step at the site as a whole; each worker takes its share of it."""

    workers: int = field(default=1, metadata=in_range(1, 256))
    backend: str = field(default="gloo", metadata=one_of("gloo", "nccl"))
    device: str = field(default="cpu", metadata=one_of("cpu", "cuda"))
    nodes: NodesSpec | None = field(default=None, metadata=_OMIT_NONE)
    # The network interface the workers' collectives use (gloo/NCCL_SOCKET_IFNAME); default: loopback on one node,
    # the interface of the machine's host name across nodes.
    interface: str | None = field(default=None, metadata=_OMIT_NONE)
    # Torch threads in each worker; default: the machine's cores shared out between its workers.
    threads: int | None = field(default=None, metadata={**in_range(1, 1024), **_OMIT_NONE})
    # A worker that does not answer a collective (or join a task) within this fails the task.
    timeout_s: float = field(default=300.0, metadata=in_range(0, 86400, lo_open=True))

    @property
    def world(self) -> int:
        """The team's workers on all its nodes."""
        return self.workers * (self.nodes.count if self.nodes is not None else 1)


@dataclass(frozen=True, slots=True)
class SiteConfig:
    """A hospital's site agent; relative paths are relative to the config file."""

    site: str = field(metadata=matching(SITE_NAME, SITE_NAME_RULE))
    coordinator: str = field(metadata=_address(1))
    kit: Path
    state_dir: Path = Path("state")
    datasets: dict[str, DatasetSpec] = field(default_factory=dict)
    policy: PolicySpec = field(default_factory=PolicySpec)
    # Experiments only: a slow site emulated on a fast machine. Left out (None) in every real site's config.
    emulation: EmulationSpec | None = field(default=None, metadata=_OMIT_NONE)
    # Data-parallel training inside the site (several processes or machines); left out: one process.
    training: TrainingSpec | None = field(default=None, metadata=_OMIT_NONE)


@dataclass(frozen=True, slots=True)
class CheckpointsSpec:
    """Checkpoint retention: which closed rounds keep their checkpoint once newer ones exist."""

    keep_last: int | None = field(default=None, metadata=in_range(1))    # None: keep every round's checkpoint
    keep_every: int | None = field(default=None, metadata=in_range(1))   # also keep rounds 0, M, 2M, ...


@dataclass(frozen=True, slots=True)
class CoordinatorConfig:
    """The coordinator service; relative paths are relative to the config file."""

    listen: str = field(metadata=_address(0))  # port 0 picks a free port
    kit: Path
    state_dir: Path = Path("state")
    crl: Path | None = None
    poll_timeout_s: float = field(default=20.0, metadata=in_range(0, 300, lo_open=True))
    # When a job starts or resumes, wait this long for its sites (a new job: every registered site) to
    # (re)connect before its first round, so a coordinator restart does not leave out (or, for cwt, skip)
    # sites still reconnecting. Longer than a site's longest backoff wait, or 0.
    rejoin_grace_s: float = field(default=15.0, metadata=_rejoin_grace())
    chunk_bytes: int = field(default=1 << 20, metadata=in_range(1 << 16, 1 << 22))
    max_workers: int = field(default=128, metadata=in_range(8, 4096))
    # Per-stream HTTP/2 flow-control window: what a site may send before the coordinator reads it, so
    # the most an upload waiting for a transfer slot buffers. One stream then carries at most
    # window / round-trip time (1 MiB at 20 ms: ~50 MB/s); raise it for long fat links. 0: gRPC's
    # adaptive windows (bandwidth-delay probing), which on fast links grow to megabytes per stream.
    stream_window_bytes: int = field(default=1 << 20, metadata=_window())
    # Model downloads and update uploads in progress at once; more wait their turn, holding no data.
    # Each costs a few chunks of buffers, so this keeps the coordinator's memory flat in the number
    # of sites; on a CPU-bound coordinator, fewer concurrent streams also contend less.
    max_transfers: int = field(default=4, metadata=in_range(1, 1024))
    # Prometheus metrics over plain HTTP (off unless set; keep it on 127.0.0.1 or a private network).
    metrics_listen: str | None = field(default=None, metadata=_address(0))
    # grpc.health.v1 only, plaintext, for probes that cannot present a client certificate (off unless set).
    health_listen: str | None = field(default=None, metadata=_address(0))
    checkpoints: CheckpointsSpec = field(default_factory=CheckpointsSpec)
    # Calls one identity (a site's or an admin's certificate) may have in progress at once; more are refused
    # with RESOURCE_EXHAUSTED. Below max_workers, so that no one certificate can hold every worker thread
    # with idle streams: a site needs about 2 (its long poll and one transfer), the admin CLI 1 or 2.
    max_calls_per_identity: int = field(default=16, metadata=in_range(1, 4096))
    # A stream whose next message does not arrive (an upload's next chunk), or is not taken (a download's),
    # within this is dropped: its thread and transfer slot come back, a part-way update is taken back out
    # of the sum, and the site is recorded late. Uploads also end when their round closes.
    stream_idle_timeout_s: float = field(default=30.0, metadata=in_range(0, 3600, lo_open=True))
    # The model worker process (coordinator.model_worker) that builds each submitted job's initial model:
    # a build taking longer is stopped and the job refused; the worker's address space is capped at
    # model_build_memory_bytes (torch itself takes about 1 GiB of it), so a model too large for the
    # coordinator's memory is refused at submit instead of taking the machine down.
    model_build_timeout_s: float = field(default=300.0, metadata=in_range(0, 86400, lo_open=True))
    model_build_memory_bytes: int = field(default=8 << 30, metadata=in_range(1 << 30, 1 << 40))


@dataclass(frozen=True, slots=True)
class TierSpec:
    """A relay's own round at its tier: how many of its children must answer, and how long it waits for them."""

    sites_min: int = field(default=1, metadata=in_range(1))
    # The relay answers its parent by then, or by the parent's deadline less upload_margin_s, whichever is first.
    deadline_s: float = field(default=300.0, metadata=in_range(0, 86400, lo_open=True))
    upload_margin_s: float = field(default=10.0, metadata=in_range(0, 3600))
    # The largest model (bytes on the wire) the relay takes from its parent; it holds it a few times over (the
    # model, what its children fetch, its tier's sum). None: a quarter of this machine's memory (or cgroup limit).
    max_model_bytes: int | None = field(default=None, metadata=in_range(1 << 20, 1 << 50))


@dataclass(frozen=True, slots=True)
class RelayConfig:
    """A relay (`plexus relay run`): to its children (sites or relays below) it is their coordinator; to its
    parent (the coordinator or a relay above) it is one site whose weight is its children's total. Relative
    paths are relative to the config file."""

    parent: str = field(metadata=_address(1))   # the coordinator (or relay) above, host:port
    listen: str = field(metadata=_address(0))   # where its children dial; port 0 picks a free port
    kit: Path                                   # its own kit, from `plexus pki add-relay` (kind relay)
    state_dir: Path = Path("state")
    crl: Path | None = None                     # the federation CRL; left out: the kit's crl.pem
    tier: TierSpec = field(default_factory=TierSpec)
    poll_timeout_s: float = field(default=20.0, metadata=in_range(0, 300, lo_open=True))
    rejoin_grace_s: float = field(default=15.0, metadata=_rejoin_grace())
    max_transfers: int = field(default=4, metadata=in_range(1, 1024))
    stream_idle_timeout_s: float = field(default=30.0, metadata=in_range(0, 3600, lo_open=True))
    metrics_listen: str | None = field(default=None, metadata=_address(0))
    health_listen: str | None = field(default=None, metadata=_address(0))

    def serving(self) -> CoordinatorConfig:
        """The coordinator config of the relay's serving side (its children's coordinator)."""
        return CoordinatorConfig(listen=self.listen, kit=self.kit, state_dir=self.state_dir, crl=self.crl,
                                 poll_timeout_s=self.poll_timeout_s, rejoin_grace_s=self.rejoin_grace_s,
                                 max_transfers=self.max_transfers, stream_idle_timeout_s=self.stream_idle_timeout_s,
                                 metrics_listen=self.metrics_listen, health_listen=self.health_listen)


@dataclass(frozen=True, slots=True)
class AdminConfig:
    """Where the admin CLI finds the coordinator and its credentials."""

    coordinator: str = field(metadata=_address(1))
    kit: Path


_DATASET_NEEDS = {"csv": ("path",), "npz": ("path",), "heart-disease": ("hospital",),
                  "fashion-mnist": ("sites", "index", "alpha")}
# Optional keys (default None) that mean something for each kind; the others are rejected.
_DATASET_APPLIES = {"csv": ("path", "label", "features", "encoding", "delimiter"), "npz": ("path",),
                    "heart-disease": ("path", "hospital"),
                    "fashion-mnist": ("path", "sites", "index", "alpha", "limit")}
_DATASET_EXAMPLE = {"path": "<file path>", "hospital": f"<one of {', '.join(HOSPITALS)}>",
                    "sites": "<number of sites, e.g. 8>", "index": "<this site's share, 0..sites-1>",
                    "alpha": "<Dirichlet concentration, e.g. 0.3>"}


def _dataset_problem(spec: DatasetSpec) -> tuple[str, str] | None:
    applies = _DATASET_APPLIES[spec.kind]
    for key in sorted({key for keys in _DATASET_APPLIES.values() for key in keys} - set(applies)):
        if getattr(spec, key) is not None:
            return key, f"does not apply to kind {spec.kind!r}; remove it (that kind uses: {', '.join(applies)})"
    for key in _DATASET_NEEDS[spec.kind]:
        if getattr(spec, key) is None:
            return key, f"required for kind {spec.kind!r} but not set; add '{key}: {_DATASET_EXAMPLE[key]}'"
    if spec.kind == "csv" and spec.features is not None and spec.label is None:
        return "features", ("lists the columns a training job may use, and without `label` this file serves "
                            "statistics jobs only (which read every column); add 'label: <label column>' to train "
                            "on it, or remove `features`")
    if spec.index is not None and spec.sites is not None and spec.index >= spec.sites:
        return "index", f"{spec.index} is not a share of a {spec.sites}-site split; use 0..{spec.sites - 1}"
    if spec.limit is not None and spec.sites is not None and spec.limit < spec.sites:
        return "limit", f"{spec.limit} rows cannot give each of {spec.sites} sites a row; use at least {spec.sites}"
    return None


def _feature_problem(spec: FeatureSpec) -> tuple[str, str] | None:
    if spec.categories is None:
        if spec.impute is not None and cell_number(spec.impute) is None:
            return "impute", (f"{spec.impute!r} is not a number, and {spec.name!r} is a numeric column; "
                              "write a number, or declare `categories` to make the column categorical")
        return None
    if len(set(spec.categories)) != len(spec.categories):
        return "categories", "lists a value twice; list each category once"
    if spec.center != 0.0 or spec.scale != 1.0:
        key = "center" if spec.center != 0.0 else "scale"
        return key, "applies to numeric columns only; a categorical column (with `categories`) is one-hot encoded"
    if spec.impute is not None and spec.impute not in spec.categories:
        return "impute", (f"{spec.impute!r} is not one of the declared categories {list(spec.categories)}; "
                          "use one of them")
    return None


def _label_problem(spec: LabelSpec) -> tuple[str, str] | None:
    if spec.classes is not None and len(set(spec.classes)) != len(spec.classes):
        return "classes", "lists a value twice; list each class once"
    return None


def _data_problem(spec: DataSpec) -> tuple[str, str] | None:
    if (spec.label is None) != (spec.features is None):
        missing = "features" if spec.features is None else "label"
        return missing, ("a CSV schema needs both `label` (column and classes) and `features` (columns by name); "
                         f"add '{missing}:' or remove the other")
    if spec.label is None:
        return None
    if spec.target == "class" and spec.label.classes is None:
        return "label", (f"column {spec.label.column!r} has no `classes`, and target is 'class'; list the classes "
                         "in order (e.g. classes: [no, yes]), or set `target: numeric` for a regression target")
    if spec.target == "numeric" and spec.label.classes is not None:
        return "label", (f"classes apply to a class target, and target is 'numeric' (column {spec.label.column!r} "
                         "holds the numbers to fit); remove label.classes, or remove `target: numeric`")
    names = [f.name for f in spec.features]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        return "features", f"lists column(s) {twice} more than once; list each column once"
    if spec.label.column in names:
        return "features", f"lists the label column {spec.label.column!r}; the label cannot also be a feature"
    return None


def _privacy_problem(spec: PrivacySpec) -> tuple[str, str] | None:
    if spec.dp is not None and spec.dp.mode == "distributed" and not spec.secure_aggregation:
        return "dp", ("mode 'distributed' needs secure_aggregation: true, because each site adds only part "
                      "of the noise and its update would be under-protected if the coordinator saw it alone; "
                      "set privacy.secure_aggregation: true or use dp.mode: central")
    return None


def _dp_problem(spec: DPSpec) -> tuple[str, str] | None:
    if spec.reproducible_noise and spec.mode != "central":
        return "reproducible_noise", ("applies to mode 'central' only (each site's share of distributed noise "
                                      "always comes from its own OS randomness); remove it")
    return None


def _sites_problem(spec: SitesSpec) -> tuple[str, str] | None:
    if spec.count is not None and spec.count < spec.min:
        return "count", (f"samples {spec.count} site(s) per round but min is {spec.min}, so no round could "
                         "reach its quorum; raise count or lower min")
    return None


def _round_problem(cfg: RoundConfig) -> tuple[str, str] | None:
    problem = (_split_problem(cfg) or _statistics_job_problem(cfg) or _exact_problem(cfg) or _target_problem(cfg)
               or _async_problem(cfg) or _compression_problem(cfg))
    if problem:
        return problem
    if cfg.train.steps is not None and cfg.privacy.dp_sgd is not None:
        return "train", ("steps cannot be combined with privacy.dp_sgd, whose privacy accounting counts whole "
                         "epochs of Poisson-sampled batches; use train.epochs")
    if cfg.privacy.secure_aggregation and cfg.sites.min < MIN_SECURE_COHORT:
        return "sites", (f"min is {cfg.sites.min}, and privacy.secure_aggregation needs at least "
                         f"{MIN_SECURE_COHORT} sites in every sum (the sum of one site is its update; of two, each "
                         f"learns the other's); set sites.min to {MIN_SECURE_COHORT} or more")
    return _schema_model_problem(cfg)


STATISTICS_MODEL = "statistics"   # the model registry name and strategy of every statistics job


def statistics_derived(spec: StatisticsSpec) -> dict[str, Any]:
    """The keys a statistics job derives from its `statistics` block, as plain data: model, rounds, strategy."""
    return {"model": {"name": STATISTICS_MODEL, "args": statistics_args(spec)}, "rounds": 1,
            "strategy": {"name": STATISTICS_MODEL, "args": {}}}


def _derive_statistics_job(reader: typed_yaml.Reader, node: Node, path: str) -> Node:
    """Before a round config is read: a `kind: statistics` job gets the model, rounds and strategy its statistics
    block derives, where they are not written (written ones must equal them: _statistics_job_problem)."""
    if not isinstance(node, MappingNode):
        return node   # the reader says what is wrong with it
    entries = {k.value: (k, v) for k, v in node.value if isinstance(k, ScalarNode)}
    kind = entries.get("kind", (None, None))[1]
    if not (isinstance(kind, ScalarNode) and kind.tag == "tag:yaml.org,2002:str" and kind.value == "statistics"):
        return node
    if "statistics" not in entries:
        reader.fail(kind, _join(path, "kind"), "is statistics, but the job has no `statistics:` block; add one "
                                               "listing the columns to describe (docs/statistics.md)")
    # A reader of its own: the main one reads the block again, and would take that for a repeat through an alias.
    spec = typed_yaml.Reader(reader.source, reader.base, checks=reader.checks, after=reader.after).read(
        StatisticsSpec, entries["statistics"][1], _join(path, "statistics"))
    added = []
    for key, value in statistics_derived(spec).items():
        if key not in entries:
            key_node = ScalarNode("tag:yaml.org,2002:str", key, kind.start_mark, kind.end_mark)
            added.append((key_node, _marked(typed_yaml.compose(yaml.safe_dump(value), reader.source), kind)))
    return MappingNode(node.tag, [*node.value, *added], node.start_mark, node.end_mark, node.flow_style)


def _marked(node: Node, at: Node) -> Node:
    """`node` and everything in it marked at `at`, where an error in a derived value then points."""
    node.start_mark, node.end_mark = at.start_mark, at.end_mark
    for item in node.value if isinstance(node, (MappingNode, SequenceNode)) else ():
        for child in item if isinstance(item, tuple) else (item,):
            _marked(child, at)
    return node


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _statistics_job_problem(cfg: RoundConfig) -> tuple[str, str] | None:
    if cfg.kind != "statistics":
        if cfg.statistics is not None:
            return "statistics", ("describes a statistics job, and this is a training job; add `kind: statistics` "
                                  "(and remove model, rounds, strategy and train), or remove the block")
        return None
    derived = statistics_derived(cfg.statistics)
    fix = "remove it: a statistics job derives model, rounds and strategy from its statistics block"
    if cfg.model != ModelSpec(**derived["model"]):
        what = (f"names model {cfg.model.name!r}" if cfg.model.name != STATISTICS_MODEL
                else "has args other than the statistics block")
        return "model", f"{what}; {fix}"
    if cfg.rounds != 1:
        return "rounds", f"is {cfg.rounds}, and a statistics job is one round of sums; {fix}"
    if cfg.strategy.name != STATISTICS_MODEL or cfg.strategy.args:
        return "strategy", f"is {cfg.strategy.name!r} with args {cfg.strategy.args}, not {{name: statistics}}; {fix}"
    for key, unset in (("train", TrainSpec()), ("compression", None), ("asynchronous", None)):
        if getattr(cfg, key) != unset:
            return key, (f"does not apply to a statistics job, which trains nothing and sends its sums once, "
                         f"exactly; remove `{key}:`")
    if cfg.data.label is not None:
        return "data", ("label and features declare a training job's inputs; a statistics job reads the raw columns "
                        "its statistics block names: remove data.label and data.features")
    for key in ("dp", "dp_sgd"):
        if getattr(cfg.privacy, key) is not None:
            return "privacy", (f"{key} noises training updates; a statistics job adds its noise per query: remove "
                               f"privacy.{key} and set statistics.dp (mechanism, epsilon)")
    if cfg.sites.fraction is not None or cfg.sites.count is not None:
        return "sites", ("fraction and count sample the sites of a round, and a statistics job pools the rows of "
                         "every site; remove them")
    if cfg.privacy.secure_aggregation and cfg.statistics.min_max:
        return "statistics", ("min_max is on (the default), and under privacy.secure_aggregation the coordinator "
                              "sees only the sum of the sites' values: a min is not a sum; set "
                              "statistics.min_max: false, or privacy.secure_aggregation: false")
    if cfg.privacy.secure_aggregation:
        for k, column in enumerate(cfg.statistics.columns):
            if column.categories is None and column.range is None:
                return f"statistics.columns[{k}]", (
                    f"{column.name!r} is numeric and has no `range`, and under privacy.secure_aggregation every "
                    "numeric column needs one: its sums are taken of (x − mid)/half-width, so that with values "
                    "inside the range no sum a site sends exceeds its row count, and privacy.secagg.clip at least "
                    "the largest site's rows covers them (docs/statistics.md#privacy); add `range: [lo, hi]` "
                    "spanning its values, or describe it as `categories`, or set privacy.secure_aggregation: false")
    return None


def _split_problem(cfg: RoundConfig) -> tuple[str, str] | None:
    """A split job names its cuts, and none of federated averaging's machinery (it has no updates to average)."""
    if cfg.mode != "split":
        if cfg.split is not None:
            return "split", "configures split learning, but mode is federated; add `mode: split`, or remove `split:`"
        return None
    spec = cfg.split
    if spec is None:
        return "mode", ("is split, and the job has no `split:` block; add one with the variant and cuts, e.g. "
                        "`split: {variant: u-shaped, cuts: [block1, features], schedule: splitfed}`")
    want = 1 if spec.variant == "vanilla" else 2
    if len(spec.cuts) != want:
        return "split.cuts", (f"lists {len(spec.cuts)} cut(s), and a {spec.variant} split takes {want}: "
                              + ("the site's layers end at the one cut" if want == 1 else
                                 "the server's part lies between the two, the site keeps the layers after the second"))
    if spec.logit_adjustment and spec.variant == "vanilla":
        return "split.logit_adjustment", ("applies to u-shaped splits, whose sites compute the loss from their own "
                                          "labels; a vanilla split's loss is computed at the server. Use `variant: "
                                          "u-shaped` with two cuts, or remove split.logit_adjustment")
    if cfg.kind != "train":
        return "kind", "is statistics, which sends sums, not activations; a split job trains: remove `kind:`"
    if cfg.strategy.name != "fedavg" or cfg.strategy.args:
        return "strategy", (f"is {cfg.strategy.name!r}, and a split job has no updates for a server rule: its sites' "
                            "parts are handed on (sequential) or averaged by rows (splitfed); remove `strategy:`")
    for key, unset in (("asynchronous", None), ("compression", None)):
        if getattr(cfg, key) != unset:
            return key, f"does not apply to split learning, which sends activations batch by batch; remove `{key}:`"
    if cfg.privacy != PrivacySpec():
        return "privacy", ("secure aggregation and DP cover averaged updates; a split job's site sends activations, "
                           "which they do not protect: remove `privacy:` and use split.nopeek or split.noise_std "
                           "(docs/split-learning.md says what each does and does not protect)")
    if cfg.train.steps is not None or cfg.train.epochs != 1:
        return "train", ("steps and epochs set local training per round; a split job's round is one epoch over "
                         "every site's rows: remove them, and set `rounds` to the number of epochs")
    if cfg.train.optimizer.name != "sgd":
        return "train.optimizer", "is adam; a split job's both sides step with SGD (lr, momentum, weight_decay)"
    if cfg.sites.fraction is not None or cfg.sites.count is not None:
        return "sites", "fraction and count sample rounds' sites; every online site takes part in a split epoch"
    return None


def _exact_problem(cfg: RoundConfig) -> tuple[str, str] | None:
    """lbfgs and newton evaluate one objective, the sum over every site's rows, at the exact point served."""
    name = cfg.strategy.name
    if name not in EXACT_STRATEGIES:
        return None
    if cfg.model.name not in EXACT_MODELS:
        return "model", (f"{cfg.model.name!r} has no per-row loss the sites can sum for strategy {name!r}; use one "
                         f"of {', '.join(EXACT_MODELS)} (mlp is not convex: allowed, with a warning), or a "
                         "training strategy such as fedavg")
    for key in ("fraction", "count"):
        if getattr(cfg.sites, key) is not None:
            return "sites", (f"{key} samples a round's sites, but strategy {name!r} sums every site's rows each "
                             f"round (a round without one of them evaluates another objective); remove sites.{key}")
    if cfg.asynchronous is not None:
        return "asynchronous", (f"strategy {name!r} evaluates one point per round with every site, which "
                                "asynchronous versions do not do; remove the asynchronous block")
    if cfg.compression is not None and (cfg.compression.uplink.codec, cfg.compression.downlink.codec) != \
            ("none", "none"):
        return "compression", (f"strategy {name!r} needs the exact point at every site and the exact sums back "
                               "(a lossy codec moves the iterate and breaks its line search); remove compression")
    if cfg.privacy.dp_sgd is not None:
        return "privacy", (f"dp_sgd privatises local training, and strategy {name!r} trains nothing at the sites "
                           "(they send loss and gradient sums); use privacy.dp (row-level clipping and noise on "
                           "the gradient sum, with lbfgs) or remove privacy.dp_sgd")
    if name == "newton" and cfg.privacy.dp is not None:
        return "privacy", ("dp cannot protect newton: the Hessian sum would need its own noise, which leaves it "
                           "indefinite; use strategy lbfgs (noisy gradient steps under privacy.dp) or remove "
                           "privacy.dp")
    args = strategy_args(cfg.strategy)
    if name == "lbfgs" and args.c1 >= args.c2:
        return "strategy", (f"args.c1 ({args.c1}) must be below args.c2 ({args.c2}) for a step to satisfy both "
                            "strong-Wolfe conditions; keep the defaults (c1 1e-4, c2 0.9)")
    return None


def _target_problem(cfg: RoundConfig) -> tuple[str, str] | None:
    """A numeric target needs a regression model and a strategy that fits it; a regression model needs one."""
    numeric = cfg.data.target == "numeric"
    if cfg.model.name in REGRESSION_MODELS and not numeric:
        return "data", (f"model {cfg.model.name!r} fits numeric targets (squared error), and data.target is "
                        "'class'; add `target: numeric` to data, or use a classifier such as logistic")
    if numeric and cfg.model.name not in REGRESSION_MODELS:
        return "model", (f"{cfg.model.name!r} is not a regression model, and data.target is 'numeric'; use "
                         f"{' or '.join(REGRESSION_MODELS)}, or remove `target: numeric` for class labels")
    if numeric and cfg.strategy.name not in EXACT_STRATEGIES:
        return "strategy", (f"{cfg.strategy.name!r} trains by minibatch steps, which site training runs for "
                            f"classifiers only, and data.target is 'numeric'; use strategy "
                            f"{' or '.join(EXACT_STRATEGIES)}, which fit the pooled least-squares objective")
    return None


def _async_problem(cfg: RoundConfig) -> tuple[str, str] | None:
    spec = cfg.asynchronous
    if spec is None:
        return None
    if cfg.strategy.name not in ASYNC_STRATEGIES:
        return "strategy", (f"{cfg.strategy.name!r} cannot run asynchronously: its server step needs every round's "
                            f"updates together (or a schedule of rounds); asynchronous jobs take "
                            f"{', '.join(ASYNC_STRATEGIES)}")
    if cfg.sites.fraction is not None or cfg.sites.count is not None:
        return "sites", ("fraction and count sample a round's sites, and asynchronous training has no rounds: "
                         "every idle site trains; remove them (asynchronous.max_per_buffer caps a fast site)")
    if spec.mixing is not None and spec.buffer != 1:
        return "asynchronous", (f"mixing (FedAsync's α) mixes one update into the model at a time, but buffer is "
                                f"{spec.buffer}; set buffer: 1, or remove mixing for FedBuff")
    if cfg.privacy.secure_aggregation and spec.buffer < MIN_SECURE_COHORT:
        return "asynchronous", (f"buffer is {spec.buffer}, and under privacy.secure_aggregation each buffer is one "
                                f"secure sum, which needs at least {MIN_SECURE_COHORT} sites; set buffer to "
                                f"{MIN_SECURE_COHORT} or more")
    if cfg.privacy.secure_aggregation and cfg.sites.min > spec.buffer:
        return "sites", (f"min is {cfg.sites.min}, and under privacy.secure_aggregation a cohort of at most "
                         f"asynchronous.buffer = {spec.buffer} sites must have that many members; set sites.min "
                         f"to at most {spec.buffer}, or raise buffer")
    if cfg.privacy.secure_aggregation and (spec.max_per_buffer or 1) != 1:
        return "asynchronous", (f"max_per_buffer is {spec.max_per_buffer}, but under privacy.secure_aggregation "
                                "each buffer is one secure cohort, in which a site takes part once; remove "
                                "max_per_buffer")
    if cfg.privacy.dp is not None and (spec.max_per_buffer or 1) != 1:
        return "asynchronous", (f"max_per_buffer is {spec.max_per_buffer}, but under privacy.dp a site's share of "
                                "a buffer's sum must be one clipped update for the noise to cover it; set "
                                "max_per_buffer: 1 (the default under dp)")
    return None


def _uplink_problem(spec: UplinkSpec) -> tuple[str, str] | None:
    for key, codecs_ in UPLINK_KEYS.items():
        if getattr(spec, key) is not None and spec.codec not in codecs_:
            return key, (f"codec {spec.codec!r} does not take {key} (only {' and '.join(codecs_)} do); remove it")
    if spec.codec in ("topk", "randk") and (spec.fraction is None) == (spec.k is None):
        return "codec", (f"{spec.codec} sends k entries per tensor: give exactly one of fraction (of each tensor's "
                         "elements, e.g. 0.01) or k (per tensor)")
    return None


def _downlink_problem(spec: DownlinkSpec) -> tuple[str, str] | None:
    for key, codecs_ in DOWNLINK_KEYS.items():
        if getattr(spec, key) is not None and spec.codec not in codecs_:
            return key, (f"codec {spec.codec!r} does not take {key} (only {' and '.join(codecs_)} do); remove it")
    return None


def _compression_problem(cfg: RoundConfig) -> tuple[str, str] | None:
    spec = cfg.compression
    if spec is None or (spec.uplink.codec == "none" and spec.downlink.codec == "none"):
        return None
    if cfg.asynchronous is not None:
        return "compression", ("asynchronous jobs do not take compression yet (their buffers fold whole models "
                               "weighted by staleness); remove compression or the asynchronous block")
    if spec.uplink.codec != "none" and cfg.strategy.name not in COMPRESSIBLE_STRATEGIES:
        return "compression", (f"strategy {cfg.strategy.name!r} cannot take compressed updates: robust rules and "
                               "ensembles judge each site's whole update in the clear, and SCAFFOLD sends its Δc "
                               f"beside it; compressed updates go with {', '.join(COMPRESSIBLE_STRATEGIES)}")
    if cfg.privacy.secure_aggregation and spec.uplink.codec in ("topk", "adacomp"):
        return "compression", (f"uplink codec {spec.uplink.codec!r} sends each site's own choice of coordinates, "
                               "and a masked sum needs the same coordinates at every site; under "
                               "privacy.secure_aggregation use randk (indices shared by seed), int8 or fp16")
    if cfg.privacy.secure_aggregation and spec.uplink.codec == "int4":
        return "compression", ("uplink codec 'int4' cannot be masked: a 4-bit field leaves no room for a sum "
                               "over sites (its 7 levels a side, less one for each site summed, are fewer than the "
                               f"{MIN_GRID_LEVELS} a public grid needs even for one site); under "
                               "privacy.secure_aggregation use int8, fp16 or randk")
    if cfg.privacy.secure_aggregation and spec.uplink.codec == "int8" and spec.uplink.block is not None:
        return "compression", ("under privacy.secure_aggregation int8 masks every element on one public grid "
                               "(clip / L, docs/privacy.md), with no per-block scales; remove uplink.block")
    if cfg.privacy.secure_aggregation and spec.uplink.codec == "randk" and spec.uplink.error_feedback:
        return "compression", ("under privacy.secure_aggregation randk runs without error feedback (a site keeps "
                               "no residual of a masked update yet); remove uplink.error_feedback, or set it false")
    limit = max_secure_sites(spec.uplink.codec) if cfg.privacy.secure_aggregation else None
    for key, value in (("min", cfg.sites.min), ("count", cfg.sites.count or 0)):
        if limit is not None and value > limit:
            return "sites", (f"{key} is {value}, but under privacy.secure_aggregation uplink codec "
                             f"{spec.uplink.codec!r} sums at most {limit} sites per round (its "
                             f"{SECURE_FIELD_BITS[spec.uplink.codec]}-bit field keeps a grid of at least "
                             f"clip/{MIN_GRID_LEVELS}); set sites.{key} to {limit} or fewer, or use "
                             f"{'fp16' if spec.uplink.codec == 'int8' else 'randk'}")
    return None


def _schema_model_problem(cfg: RoundConfig) -> tuple[str, str] | None:
    """A declared CSV schema must give the model exactly the inputs and classes its args expect."""
    if cfg.data.features is None:
        return None
    args = cfg.model.args
    inputs = feature_inputs(cfg.data.features)
    if isinstance(args.get("in_features"), int) and args["in_features"] != len(inputs):
        shown = ", ".join(inputs[:12]) + (", ..." if len(inputs) > 12 else "")
        return "model", (f"args.in_features is {args['in_features']}, but data.features derive {len(inputs)} model "
                         f"inputs after one-hot encoding ({shown}); set in_features: {len(inputs)}")
    if cfg.data.label.classes is None:
        return None
    classes = len(cfg.data.label.classes)
    if isinstance(args.get("num_classes"), int) and args["num_classes"] != classes:
        return "model", (f"args.num_classes is {args['num_classes']}, but data.label declares {classes} classes; "
                         f"set num_classes: {classes}")
    return None


def _stat_column_problem(spec: StatColumnSpec) -> tuple[str, str] | None:
    if spec.categories is not None:
        for key in ("range", "bins"):
            if getattr(spec, key) is not None:
                return key, (f"applies to numeric columns only, and {spec.name!r} is categorical (it has "
                             "`categories`); remove it, or remove `categories` to describe the column as numbers")
        if len(set(spec.categories)) != len(spec.categories):
            return "categories", "lists a value twice; list each category once"
    if spec.bins is not None and spec.range is None:
        return "bins", f"needs `range: [lo, hi]`, the span the {spec.bins} equal-width bins divide; add it"
    return None


def _group_problem(spec: GroupSpec) -> tuple[str, str] | None:
    if len(set(spec.categories)) != len(spec.categories):
        return "categories", "lists a value twice; list each group once"
    return None


def _statistics_problem(spec: StatisticsSpec) -> tuple[str, str] | None:
    names = [c.name for c in spec.columns]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        return "columns", f"lists column(s) {twice} more than once; list each column once"
    numeric = [c for c in spec.columns if c.categories is None]
    if spec.quantiles and not any(c.bins is not None for c in numeric):
        return "quantiles", ("are read from histograms, and no column has one; give the numeric columns to "
                             "describe `range: [lo, hi]` and `bins` (quantiles apply to every column with bins)")
    if spec.covariance and len(numeric) < 2:
        return "covariance", (f"needs at least 2 numeric columns (columns without `categories`), and there "
                              f"{'is' if len(numeric) == 1 else 'are'} {len(numeric)}; add one or remove it")
    if spec.covariance and len(numeric) > MAX_COVARIANCE_COLUMNS:
        return "covariance", (f"over {len(numeric)} numeric columns would sum {len(numeric) * (len(numeric) - 1) // 2} "
                              f"pairs; covariance takes at most {MAX_COVARIANCE_COLUMNS} numeric columns")
    if spec.dp is not None:
        if spec.min_max:
            return "min_max", ("cannot be released under dp: a minimum or maximum is one row's value, which no "
                               "noise calibrated to a range hides; set min_max: false")
        unbounded = [c.name for c in numeric if c.range is None]
        if unbounded:
            return "dp", (f"needs `range: [lo, hi]` on every numeric column, to bound what one row adds to a sum "
                          f"(values are clamped to it under dp); add a range to {', '.join(map(repr, unbounded))}")
        if spec.dp.mechanism == "gaussian" and spec.dp.epsilon >= 1:
            return "dp", (f"epsilon is {spec.dp.epsilon:g}, and the Gaussian mechanism's noise "
                          "sigma = sensitivity * sqrt(2 ln(1.25/delta)) / epsilon is proven for epsilon < 1 only; "
                          "use an epsilon below 1, or mechanism: laplace")
    return None


# Cross-field checks: fn(obj) -> (key, "<problem>; <fix>") or None.
def _checkpoints_problem(spec: CheckpointsSpec) -> tuple[str, str] | None:
    if spec.keep_every is not None and spec.keep_last is None:
        return "keep_every", ("only thins out checkpoints that keep_last would remove; set keep_last too "
                              "(e.g. keep_last: 3), or remove keep_every to keep every checkpoint")
    return None


def _training_problem(spec: TrainingSpec) -> tuple[str, str] | None:
    if spec.backend == "nccl" and spec.device != "cuda":
        return "backend", "nccl runs on GPUs only; set device: cuda, or backend: gloo for CPU workers"
    if spec.nodes is not None and spec.nodes.rank >= spec.nodes.count:
        return "nodes", (f"rank {spec.nodes.rank} is not below count {spec.nodes.count}; number the nodes 0 to "
                         f"{spec.nodes.count - 1} (0 runs the site agent)")
    return None


def _coordinator_problem(cfg: CoordinatorConfig) -> tuple[str, str] | None:
    if cfg.max_calls_per_identity >= cfg.max_workers:
        return "max_calls_per_identity", (
            f"{cfg.max_calls_per_identity} is not below max_workers ({cfg.max_workers}), so one certificate's "
            "idle calls could hold every worker thread; lower max_calls_per_identity (default 16) or raise "
            "max_workers")
    return None


_CROSS_CHECKS: dict[type, Callable[[Any], tuple[str, str] | None]] = {
    DatasetSpec: _dataset_problem, DPSpec: _dp_problem, PrivacySpec: _privacy_problem, SitesSpec: _sites_problem,
    RoundConfig: _round_problem, FeatureSpec: _feature_problem, LabelSpec: _label_problem, DataSpec: _data_problem,
    CheckpointsSpec: _checkpoints_problem, CoordinatorConfig: _coordinator_problem, UplinkSpec: _uplink_problem,
    DownlinkSpec: _downlink_problem, StatColumnSpec: _stat_column_problem, GroupSpec: _group_problem,
    StatisticsSpec: _statistics_problem, TrainingSpec: _training_problem}
# Post-read steps: fn(reader, obj, entries, path) -> obj; pre-read steps: fn(reader, node, path) -> node.
_AFTER_READ = {StrategySpec: _read_strategy_args}
_BEFORE_READ = {RoundConfig: _derive_statistics_job}

# Bounds on a config's size, checked before and while it is read: a round config arrives from any operator
# over the network and is parsed again by every site. Nothing real comes near them (a job with 500
# one-hot features is ~40 KiB).
MAX_ROUND_CONFIG_BYTES = 256 << 10
MAX_CONFIG_BYTES = 1 << 20          # site, coordinator and admin configs: local files


def _parse(text: str, cls: type, source: str) -> Any:
    return typed_yaml.parse(text, cls, source=source, max_bytes=_max_bytes(cls), checks=_CROSS_CHECKS,
                            after=_AFTER_READ, before=_BEFORE_READ)


def _load(path: Path, cls: type) -> Any:
    return typed_yaml.load(path, cls, max_bytes=_max_bytes(cls), checks=_CROSS_CHECKS, after=_AFTER_READ,
                           before=_BEFORE_READ)


def _max_bytes(cls: type) -> int:
    return MAX_ROUND_CONFIG_BYTES if cls is RoundConfig else MAX_CONFIG_BYTES



def parse_round_config(text: str, *, source: str = "<round config>") -> RoundConfig:
    """Parse a round config from YAML text; `source` labels error messages."""
    return _parse(text, RoundConfig, source)


def load_round_config(path: Path) -> RoundConfig:
    """Read and validate a round config file."""
    return _load(path, RoundConfig)


def dump_round_config(cfg: RoundConfig) -> str:
    """Canonical YAML for a round config: sorted keys, every default written out."""
    return yaml.safe_dump(_to_plain(cfg), sort_keys=True, default_flow_style=False, allow_unicode=True)


def dump_site_config(cfg: SiteConfig) -> str:
    """YAML that load_site_config reads back as `cfg` (paths written as they are: absolute ones stay so)."""
    return yaml.safe_dump(_to_plain(cfg), sort_keys=True, default_flow_style=False, allow_unicode=True)


def _to_plain(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj):
        return {f.name: _to_plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)
                if not f.metadata.get("derived") and not (f.metadata.get("omit_none") and getattr(obj, f.name) is None)
                and not (f.metadata.get("omit_default") and getattr(obj, f.name) == f.default)}
    if isinstance(obj, (list, tuple)):
        return [_to_plain(item) for item in obj]
    if isinstance(obj, dict):
        return {key: _to_plain(value) for key, value in obj.items()}
    return str(obj) if isinstance(obj, Path) else obj


def load_site_config(path: Path) -> SiteConfig:
    """Read and validate a site agent config; relative paths resolve against its folder."""
    return _load(path, SiteConfig)


def load_coordinator_config(path: Path) -> CoordinatorConfig:
    """Read and validate a coordinator config; relative paths resolve against its folder."""
    return _load(path, CoordinatorConfig)


def load_relay_config(path: Path) -> RelayConfig:
    """Read and validate a relay config; relative paths resolve against its folder."""
    return _load(path, RelayConfig)


def load_admin_config(path: Path) -> AdminConfig:
    """Read and validate an admin CLI config; relative paths resolve against its folder."""
    return _load(path, AdminConfig)


def ensemble_members(cfg: RoundConfig) -> int:
    """How many member models a job's model has: len(strategy.args.members) for ensembling, else 0."""
    if cfg.strategy.name != "ensemble":
        return 0
    members = cfg.strategy.args.get("members")
    if not isinstance(members, (list, tuple)):
        raise ConfigError(f"strategy.args.members must be a list of site names, got {members!r}")
    return len(members)
