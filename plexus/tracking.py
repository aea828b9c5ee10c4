"""What `plexus job export --mlflow` logs of a job, as plain data: an MLflow run's name, tags, params and
metrics, from the job's detail, and the calls that hand it to MLflow's client (docs/tracking.md). MLflow is
imported only inside those calls: the rest needs no MLflow.

Keys keep to what any MLflow store accepts (letters, digits, `_ - . /` and spaces, at most 250 characters,
no empty, `.` or `..` path segment): a name that needs changing gets its characters outside that set made
`_` and a short hash of the original appended, so two names never share a key.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import yaml

from plexus.errors import PlexusError

# MLflow's own limits (mlflow.utils.validation), copied so that this module needs no MLflow.
MAX_KEY = 250
MAX_PARAM_VALUE = 6000
MAX_TAG_VALUE = 8000
BATCH_PARAMS = 100
BATCH_METRICS = 1000

CONFIG_ARTIFACT = "config.yaml"
MEAN = "mean"   # the site segment of the weighted means over sites (eval/mean/accuracy)
# Weighted over sites by their rows, as `plexus job watch` shows them (plexus.admin_client.mean_metrics).
MEAN_KINDS = ("eval", "train")
# A site's own privacy spend (privacy.dp_sgd: its ledger's ε) is no figure to average: a mean of the sites'
# ε is no one's guarantee. Each site's stays under its own key.
NOT_AVERAGED = frozenset({"epsilon", "delta"})

_UNSAFE = re.compile(r"[^A-Za-z0-9_.\- ]")


@dataclass(frozen=True, slots=True)
class Point:
    """One metric value at one step (the round; the version for asynchronous jobs)."""

    key: str
    value: float
    step: int
    timestamp_ms: int


@dataclass(frozen=True, slots=True)
class Export:
    """One MLflow run's worth of a job."""

    experiment: str
    run_name: str
    tags: dict[str, str]
    params: list[tuple[str, str]]
    metrics: list[Point]
    config_yaml: str
    start_ms: int
    end_ms: int
    run_status: str   # FINISHED, FAILED or KILLED


# A job that is still queued or running is exported as a snapshot and its run finished; its tag says so.
RUN_STATUS = {"completed": "FINISHED", "budget_reached": "FINISHED", "failed": "FAILED", "aborted": "KILLED"}


def export(detail, *, coordinator: str, federation: str, exported_by: str, experiment: str | None = None,
           run_name: str | None = None, model_round: int | None = None) -> Export:
    """The run for `detail` (an admin JobDetail): every metric row of the job and the weighted means over
    sites, the config as params, tags naming the job and where it came from."""
    s = detail.summary
    tags = {"plexus.job_id": s.job_id, "plexus.job_name": s.name, "plexus.status": s.status,
            "plexus.strategy": s.strategy, "plexus.submitted_by": s.submitted_by,
            "plexus.rounds": f"{s.current_round} of {s.rounds}", "plexus.coordinator": coordinator,
            "plexus.federation": federation, "plexus.exported_by": exported_by}
    if s.message:
        tags["plexus.message"] = _cut(s.message, MAX_TAG_VALUE)
    if model_round is not None:
        tags["plexus.model_round"] = str(model_round)
    return Export(experiment=experiment or f"plexus/{s.name}", run_name=run_name or f"{s.name} {s.job_id}",
                  tags=tags, params=params(detail.config_yaml), metrics=metrics(detail),
                  config_yaml=detail.config_yaml, start_ms=_ms(s.created_unix_s),
                  end_ms=_ms(s.updated_unix_s or s.created_unix_s), run_status=RUN_STATUS.get(s.status, "FINISHED"))


def metrics(detail) -> list[Point]:
    """Every metric row as `<kind>/<name>` (site "") or `<kind>/<site>/<name>`, then the weighted means over
    sites as `<kind>/mean/<name>`, each at its round; in a fixed order."""
    from plexus.admin_client import mean_metrics

    when = _round_times(detail)
    points = [Point(metric_key(m.kind, m.site, m.name), m.value, m.round, when(m.round)) for m in detail.metrics]
    for kind in MEAN_KINDS:
        for round_, values in sorted(mean_metrics(detail, kind).items()):
            points += [Point(f"{clean(kind)}/{MEAN}/{clean(name)}", value, round_, when(round_))
                       for name, value in values.items() if name not in NOT_AVERAGED]
    return points


def metric_key(kind: str, site: str, name: str) -> str:
    """The MLflow key of a metric row. A site named `mean` is written `site.mean` (no site name holds a dot),
    which leaves `<kind>/mean/` to the means over sites."""
    if not site:
        return _fit(f"{clean(kind)}/{clean(name)}")
    where = f"site.{MEAN}" if site == MEAN else clean(site)
    return _fit(f"{clean(kind)}/{where}/{clean(name)}")


def params(config_yaml: str) -> list[tuple[str, str]]:
    """The job's config (as the coordinator keeps it, every default written out) flattened to dotted keys
    (`train.optimizer.lr`), sorted. A list or an empty mapping is one value, as JSON; a value past MLflow's
    6000 characters is cut, saying so: the whole config is logged as the artifact config.yaml."""
    try:
        tree = yaml.safe_load(config_yaml)
    except yaml.YAMLError:
        tree = None
    if not isinstance(tree, dict):   # a coordinator keeps the config it parsed; anything else is in config.yaml
        return []
    out: dict[str, str] = {}
    _flatten(tree, "", out)
    return sorted((key, _param_value(value)) for key, value in out.items())


def _flatten(node, prefix: str, out: dict) -> None:
    for name, value in node.items():
        key = f"{prefix}.{clean(str(name))}" if prefix else clean(str(name))
        if isinstance(value, dict) and value:
            _flatten(value, key, out)
        else:
            out[_fit(key)] = value


def _param_value(value) -> str:
    text = value if isinstance(value, str) else json.dumps(value, sort_keys=True, default=str)
    if len(text) <= MAX_PARAM_VALUE:
        return text
    note = f" ... [cut: {len(text)} characters in all; the whole config is the run's artifact {CONFIG_ARTIFACT}]"
    return text[:MAX_PARAM_VALUE - len(note)] + note


def clean(name: str) -> str:
    """`name` as one segment of an MLflow key: as it is when MLflow takes it, else with every other character
    made `_` and `-` plus 6 hex digits of its SHA-256 appended."""
    if name and name not in (".", "..") and not _UNSAFE.search(name):
        return name
    return f"{_UNSAFE.sub('_', name)}-{_digest(name)}"


def _fit(key: str) -> str:
    """A key within MLflow's 250 characters: a longer one is cut and ends in a hash of the whole."""
    return key if len(key) <= MAX_KEY else f"{key[:MAX_KEY - 7].rstrip('/')}-{_digest(key)}"


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()[:6]


def _cut(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[:limit - 1] + "…"


def _ms(unix_s: float) -> int:
    return int(unix_s * 1000) if math.isfinite(unix_s) and unix_s > 0 else 0


def _round_times(detail):
    """Round -> when its model was made (the round's close, else its opening) in ms; the job's creation for
    round 0 (the initial model), its last update for a round the detail does not list."""
    s = detail.summary
    made = {r.round: _ms(r.closed_unix_s or r.opened_unix_s) for r in detail.rounds}
    fallback = _ms(s.updated_unix_s or s.created_unix_s)
    return lambda round_: made.get(round_) or (_ms(s.created_unix_s) if round_ == 0 else fallback)


def batches(points: list[Point], named: list[tuple[str, str]]) -> Iterator[tuple[list[Point], list[tuple[str, str]]]]:
    """(metrics, params) per MLflow log_batch call within its limits: params 100 at a time (up to 6000
    characters each, so alone), then metrics 1000 at a time."""
    for i in range(0, len(named), BATCH_PARAMS):
        yield [], named[i:i + BATCH_PARAMS]
    for i in range(0, len(points), BATCH_METRICS):
        yield points[i:i + BATCH_METRICS], []


# The MLflow client's settings for this process while it exports: a `file:` store (which MLflow 3 refuses
# unless allowed), and no usage telemetry sent to MLflow's servers from an operator's machine. A value the
# operator set is kept; the environment is put back afterwards.
_MLFLOW_ENV = {"MLFLOW_DISABLE_TELEMETRY": "true"}
_FILE_STORE_ENV = {"MLFLOW_ALLOW_FILE_STORE": "true"}


@contextlib.contextmanager
def mlflow_env(uri: str):
    """MLflow's settings for this process while the block exports to `uri` (see above)."""
    from urllib.parse import urlparse

    wanted = {**_MLFLOW_ENV, **(_FILE_STORE_ENV if urlparse(uri).scheme in ("", "file") else {})}
    saved = {key: os.environ.get(key) for key in wanted}
    for key, value in wanted.items():
        os.environ.setdefault(key, value)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def import_mlflow():
    """The mlflow module, or a PlexusError that says how to install it."""
    try:
        import mlflow
        import mlflow.entities
        import mlflow.exceptions
        import mlflow.tracking
    except ImportError as exc:
        raise PlexusError(f"exporting to MLflow needs its client, which is not installed ({exc}): "
                          "pip install 'plexus-fl[mlflow]'") from None
    return mlflow


def open_store(mlflow, uri: str):
    """MLflow's client for `uri`."""
    try:
        return mlflow.tracking.MlflowClient(tracking_uri=uri)
    except mlflow.exceptions.MlflowException as exc:
        raise PlexusError(f"MLflow cannot use {uri}: {exc.message.strip()} (with plexus-fl[mlflow], i.e. "
                          "mlflow-skinny, give a tracking server's http(s):// URI or a file: path)") from None


def log_run(client, uri: str, run, model: Path | None) -> tuple[str, str]:
    """Log `run` (a plexus.tracking.Export) and its artifacts as a new run at `uri` through MLflow's `client`;
    (run id, experiment id)."""
    from mlflow.entities import Metric, Param
    from mlflow.exceptions import MlflowException


    try:
        experiment = client.get_experiment_by_name(run.experiment)
        if experiment is None:
            experiment_id = client.create_experiment(run.experiment)
        elif experiment.lifecycle_stage == "deleted":
            raise PlexusError(f"the MLflow experiment {run.experiment!r} at {uri} is deleted: restore it there, or "
                              "pass --experiment NAME")
        else:
            experiment_id = experiment.experiment_id
        run_id = client.create_run(experiment_id, start_time=run.start_ms, tags=run.tags,
                                   run_name=run.run_name).info.run_id
        try:
            for points, named in batches(run.metrics, run.params):
                client.log_batch(run_id, metrics=[Metric(p.key, p.value, p.timestamp_ms, p.step) for p in points],
                                 params=[Param(key, value) for key, value in named])
            client.log_text(run_id, run.config_yaml, CONFIG_ARTIFACT)
            if model is not None:
                client.log_artifact(run_id, str(model), artifact_path="model")
        except BaseException:
            with contextlib.suppress(Exception):   # the error that stopped the export is the one to report
                client.set_terminated(run_id, "FAILED")
            raise
        client.set_terminated(run_id, run.run_status, end_time=run.end_ms)
    except MlflowException as exc:
        raise PlexusError(f"MLflow at {uri}: {exc.message}") from None
    return run_id, experiment_id
