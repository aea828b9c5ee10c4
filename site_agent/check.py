"""`plexus site check`: a dry run of what the site agent does with its data, printed for the hospital.

Everything here stays local, so it names files, rows and cell values; the one line a job's
decline would send the coordinator is printed as such, so the operator sees exactly what leaves.
"""

from __future__ import annotations

import codecs
import dataclasses
from collections import Counter

from plexus.config import RoundConfig, SiteConfig
from plexus.datasets import (
    DataError,
    Table,
    cell_number,
    csv_train_rows,
    feature_inputs,
    load_as_stored,
    load_for_job,
    read_table,
    schema_differences,
)
from plexus.errors import ConfigError
from plexus.text import listing

_VALUES_SHOWN = 12


def check_site(config: SiteConfig, *, job: RoundConfig | None = None, dataset: str | None = None,
               encoding: str | None = None, delimiter: str | None = None) -> tuple[str, bool]:
    """(the report, whether every checked dataset loads and the job, if given, would be accepted)."""
    if encoding:
        try:
            codecs.lookup(encoding)
        except LookupError:
            raise ConfigError(f"--encoding {encoding!r} is not a text encoding Python knows; "
                              "use e.g. utf-8, latin-1 or cp1252") from None
    if delimiter is not None and len(delimiter) != 1:
        raise ConfigError(f"--delimiter {delimiter!r} is not one character; use e.g. ';' or a tab")
    names = [job.data.dataset] if job is not None else [dataset] if dataset else sorted(config.datasets)
    lines, ok = [f"site {config.site}: datasets {sorted(config.datasets)}"], True
    if config.emulation is not None:
        lines.append(f"EMULATION ONLY: emulation.slowdown {config.emulation.slowdown:g} stretches every training "
                     "task; remove `emulation:` at any real site (docs/install-site.md)")
    if (training := config.training) is not None and training.world > 1:
        where = (f"{training.nodes.count} nodes (this is node {training.nodes.rank}; rendezvous "
                 f"{training.nodes.address})" if training.nodes is not None else "this machine")
        lines.append(f"training: {training.workers} {training.backend} workers on {training.device} per node, "
                     f"{training.world} in all on {where}; DP-SGD jobs are declined (docs/install-site.md)")
    for name in names:
        lines.append("")
        if name not in config.datasets:
            lines.append(f"dataset {name!r} is not configured at this site (datasets: {sorted(config.datasets)}); "
                         "a job that uses it is declined")
            ok = False
            continue
        spec = config.datasets[name]
        if spec.kind == "csv":
            spec = dataclasses.replace(spec, encoding=encoding or spec.encoding, delimiter=delimiter or spec.delimiter)
        ok &= _check_dataset(lines, name, spec)
        if job is not None:
            ok &= _check_job(lines, job, spec, min_cell_count=config.policy.min_cell_count)
    return "\n".join(lines), ok


def _check_dataset(lines: list[str], name: str, spec) -> bool:
    """What Join advertises for this dataset, and (for CSV) the file's columns as the site reads them."""
    lines.append(f"dataset {name!r}: kind {spec.kind}" + (f", file {spec.path}" if spec.path else ""))
    try:
        if spec.kind != "csv":
            split = load_as_stored(spec)
            labels = f"{split.num_classes} classes" if split.num_classes else "numeric targets"
            lines.append(f"  {len(split.y_train)} training rows, {len(split.y_test)} test rows, "
                         f"{labels}, input shape {split.x_train.shape[1:]}")
            lines.append(f"  advertised at Join with {len(split.y_train)} training rows")
            return True
        table = read_table(spec.path, encoding=spec.encoding, delimiter=spec.delimiter)
        _describe_table(lines, table, spec)
        rows = csv_train_rows(spec)
    except (ValueError, OSError) as exc:
        lines.append(f"  NOT advertised at Join: it does not load:\n{_indent(str(exc))}")
        return False
    lines.append(f"  advertised at Join with {rows} training rows" if spec.label is not None
                 else f"  advertised at Join with {rows} rows (all of them: statistics jobs read every row)")
    return True


def _describe_table(lines: list[str], table: Table, spec) -> None:
    lines.append(f"  {len(table.rows)} data rows, encoding {spec.encoding or 'utf-8'}, "
                 f"delimiter {spec.delimiter or ','!r}; "
                 + (f"label column {spec.label!r}" if spec.label is not None else "no label: statistics jobs only")
                 + (f"; features offered: {list(spec.features)}" if spec.features is not None else ""))
    width = max(len(c) for c in table.header)
    for at, column in enumerate(table.header):
        cells = [row[at].strip() for row in table.rows]
        filled = [c for c in cells if c]
        empty = f", {len(cells) - len(filled)} empty" if len(filled) < len(cells) else ""
        if column == spec.label:
            kind = "label: " + _counts(filled)
        elif all(cell_number(c) is not None for c in filled):
            kind = "numeric"
        else:
            kind = "text: " + _counts(filled)
        lines.append(f"    {column:<{width}}  {kind}{empty}")


def _check_job(lines: list[str], job: RoundConfig, spec, *, min_cell_count: int | None) -> bool:
    data = job.data
    if job.kind == "statistics":
        return _check_statistics(lines, job, spec, min_cell_count)
    lines.append(f"job {job.name!r} (model {job.model.name} {job.model.args}) uses dataset {data.dataset!r}")
    if data.label is not None:
        inputs = feature_inputs(data.features)
        lines.append(f"  declared label {data.label.column!r}: " + (
            "numeric target" if data.label.classes is None
            else ", ".join(f"{c}={i}" for i, c in enumerate(data.label.classes))))
        lines.append(f"  declared features ({len(inputs)} model inputs): "
                     + "; ".join(_feature_text(f) for f in data.features))
        if spec.kind == "csv":
            try:
                _, extra = schema_differences(read_table(spec.path, encoding=spec.encoding,
                                                         delimiter=spec.delimiter), spec, data)
            except DataError:
                extra = []
            if extra:
                lines.append(f"  columns in the file that are not features (left unused): {listing(extra)}")
    try:
        split = load_for_job(spec, data)
    except DataError as exc:
        return _declines(lines, exc)
    accepts = (f"  this site accepts the job: {len(split.y_train)} training rows, {len(split.y_test)} test rows, "
               f"model input shape {split.x_train.shape[1:]}")
    if data.target == "numeric":
        y = split.y_train
        lines.append(f"{accepts}, numeric target")
        lines.append(f"  training targets: mean {y.mean():.6g}, std {y.std():.6g}, from {y.min():.6g} to {y.max():.6g}")
        return True
    counts = Counter(split.y_train.tolist())
    classes = data.label.classes if data.label is not None else range(split.num_classes)
    lines.append(f"{accepts}, {split.num_classes} classes")
    lines.append("  training rows per class: " + ", ".join(f"{c} {counts.get(i, 0)}" for i, c in enumerate(classes)))
    return True


def _check_statistics(lines: list[str], job: RoundConfig, spec, min_cell_count: int | None) -> bool:
    """What the site half does with a statistics job: read the raw table, check its columns, compute the sums."""
    # Imported here: the site half imports torch, which checking a dataset or a training job does not need.
    from site_agent.local import check_statistics_columns, raw_table, statistics_sums

    columns = [c.name for c in job.statistics.columns]
    group = job.statistics.group_by
    lines.append(f"statistics job {job.name!r} of columns {listing(columns)}"
                 + (f" by {group.column!r}" if group is not None else "") + f" uses dataset {job.data.dataset!r}")
    try:
        table = raw_table(spec, job.data.dataset)
        check_statistics_columns(job, spec, table)
        sums = statistics_sums(job, table, min_cell_count=min_cell_count)
    except DataError as exc:
        return _declines(lines, exc)
    lines.append(f"  this site accepts the job: its sums over {int(sums['stats/rows'][0])} rows (every row)")
    return True


def _declines(lines: list[str], exc: DataError) -> bool:
    lines.append(f"  this site DECLINES the job; the coordinator is told:\n{_indent(exc.remote)}")
    lines.append(f"  detail (stays at this site):\n{_indent(str(exc))}")
    return False


def _feature_text(f) -> str:
    impute = f", empty -> {f.impute}" if f.impute is not None else ""
    if f.categories is not None:
        return f"{f.name} one-hot [{', '.join(f.categories)}]{impute}"
    scaled = f" (x - {f.center:g}) / {f.scale:g}" if (f.center, f.scale) != (0.0, 1.0) else ""
    return f"{f.name} numeric{scaled}{impute}"


def _counts(values: list[str]) -> str:
    counts = Counter(values).most_common()
    shown = ", ".join(f"{v!r} x{n}" for v, n in counts[:_VALUES_SHOWN])
    return f"{len(counts)} distinct ({shown}{', ...' if len(counts) > _VALUES_SHOWN else ''})"


def _indent(text: str) -> str:
    return "\n".join("    " + line for line in text.splitlines())
