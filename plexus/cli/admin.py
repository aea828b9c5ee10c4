"""The researcher's and admin's commands, all calls to a running coordinator: `job`, `sites`, `audit`, and
the `health` probe an operator scripts. The reads also take `--state DIR`: a state dir no coordinator runs on,
read in this process through the `plexus.local_admin` entry point (coordinator/local.py)."""

from __future__ import annotations

import argparse
import csv
import io
import json
import os
import sys
import time
from importlib.metadata import entry_points
from pathlib import Path

from plexus.cli.common import (
    MAX_COUNT,
    UsageError,
    audit_flags,
    command,
    existing_file,
    int_in,
    output_file,
    print_audit,
    seconds,
    table,
)
from plexus.errors import PlexusError
from plexus.text import csv_cell, printable


def add_commands(sub) -> None:
    """The `job`, `health`, `sites` and `audit` groups under the top-level subparsers `sub`."""
    job = sub.add_parser("job", help="submit and follow jobs").add_subparsers(metavar="ACTION")
    submit = admin_flags(command(job, "submit", _job_submit, help="submit a round config"))
    submit.add_argument("file", type=existing_file)
    submit.add_argument("--wait", action="store_true", help="follow the job until it ends")
    admin_flags(command(job, "list", _job_list, help="list jobs"))
    for name, fn, text in (("show", _job_show, "a job's rounds, sites and metrics"),
                           ("watch", _job_watch, "follow a job live (with --state: print its recorded events)"),
                           ("abort", _job_abort, "abort a job"),
                           ("resume", _job_resume, "run a failed job again from its last closed round")):
        admin_flags(command(job, name, fn, help=text)).add_argument("job_id")
    dl = admin_flags(command(job, "download", _job_download,
                        help="download a global model as safetensors, or a statistics job's figures as CSV or JSON"))
    dl.add_argument("job_id")
    dl.add_argument("--round", type=int_in(-1, MAX_COUNT, why=" (-1: the latest closed round)"), default=-1,
                    help="round (default: the latest closed round)")
    dl.add_argument("-o", "--output", type=output_file, required=True)
    dl.add_argument("--format", choices=DOWNLOAD_FORMATS,
                    help="what to write (default: from the file's suffix, .csv or .json for a statistics job's "
                         "figures, else safetensors)")
    met = admin_flags(command(job, "metrics", _job_metrics, help="per-site, per-round metrics"))
    met.add_argument("job_id")
    met.add_argument("--format", choices=["table", "csv", "json"], default="table")
    plot = admin_flags(command(job, "plot", _job_plot, help="plot a job's metrics per round to a PNG"))
    plot.add_argument("job_id")
    plot.add_argument("-o", "--output", type=output_file, required=True, help="PNG file to write")
    exp = admin_flags(command(job, "export", _job_export,
                         help="log a job's config, metrics and final model as one MLflow run (docs/tracking.md)"))
    exp.add_argument("job_id")
    exp.add_argument("--mlflow", required=True, metavar="URI",
                     help="MLflow tracking URI: http(s)://HOST:PORT of a tracking server, or file:/PATH for a local "
                          "store (allowed for this process: MLFLOW_ALLOW_FILE_STORE=true)")
    exp.add_argument("--experiment", type=_nonempty, metavar="NAME",
                     help="MLflow experiment (default: plexus/JOB_NAME)")
    exp.add_argument("--run-name", type=_nonempty, metavar="NAME", help="the run's name (default: 'JOB_NAME JOB_ID')")
    exp.add_argument("--no-model", action="store_true",
                     help="leave the final model out (a viewer's kit may not download it)")

    health = command(sub, "health", _health, help="ask a coordinator's gRPC health service (exit 0 when SERVING)")
    health.add_argument("address", nargs="?", help="host:port (default: the coordinator in --site-config)")
    health.add_argument("--kit", type=Path, help="present this kit over mTLS")
    health.add_argument("--plaintext", action="store_true",
                        help="probe a plaintext health-only port (health_listen) without a kit; warns")
    health.add_argument("--site-config", type=existing_file,
                        help="use this site config's coordinator address and kit")
    health.add_argument("--service", default="", help="service name to check (default: the whole server)")
    health.add_argument("--timeout", type=float, default=5.0, help="seconds (default 5)")

    sites = sub.add_parser("sites", help="the federation's sites").add_subparsers(metavar="ACTION")
    admin_flags(command(sites, "list", _sites_list, help="list sites"))

    audit = audit_flags(admin_flags(command(sub, "audit", _audit, help="the coordinator's audit log")))
    audit.add_argument("--export-head", type=Path, metavar="FILE",
                       help="write the log's head, signed by the coordinator, to FILE; keep it off the coordinator")
    audit.add_argument("--against", type=existing_file, metavar="HEAD_FILE",
                       help="with --verify: also check the log still holds, unchanged, every entry HEAD_FILE signed")


LOCAL_ADMIN_GROUP = "plexus.local_admin"


def admin_flags(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The flags every admin command takes (and `plexus dashboard`): --coordinator, --kit, --state, --json,
    --timeout."""
    p.add_argument("--coordinator", default=os.environ.get("PLEXUS_COORDINATOR"), action=_Given,
                   help="host:port (or PLEXUS_COORDINATOR; default: from the kit's admin.yaml)")
    p.add_argument("--kit", type=Path, default=os.environ.get("PLEXUS_KIT"), action=_Given,
                   help="admin kit folder (or PLEXUS_KIT)")
    p.add_argument("--state", type=Path, metavar="DIR",
                   help="read this state dir (a stopped coordinator's, or `plexus simulate --state`'s) instead of "
                        "calling a coordinator")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--timeout", type=seconds, metavar="SECONDS",
                   help="deadline of each call to the coordinator (default 30; the audit log 120, downloads 600; "
                        "watching a job has none). A submit that misses it is sent again with the same request "
                        "id, so it never creates a second job")
    return p


class _Given(argparse.Action):
    """Store the value, noting in `given` that the flag was on the command line (not from the environment)."""

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, values)
        namespace.given = {*getattr(namespace, "given", ()), option_string}


def connect(args):
    """An AdminClient for the kit and coordinator `args` name (the coordinator from the kit's admin.yaml unless
    given), or with --state, one that reads that state dir in this process."""
    from plexus.admin_client import AdminClient
    from plexus.config import load_admin_config, split_address

    if args.state is not None:
        return _read_state_dir(args)
    _need_kit(args)
    address = args.coordinator
    if address is not None:   # from the command line or PLEXUS_COORDINATOR: gRPC would dial :99999 as :34463
        try:
            split_address(address)
        except ValueError as exc:
            raise UsageError(f"--coordinator (or PLEXUS_COORDINATOR): {exc}") from None
    if address is None:
        if not (args.kit / "admin.yaml").exists():
            raise UsageError("no coordinator address: pass --coordinator HOST:PORT or set PLEXUS_COORDINATOR")
        address = load_admin_config(args.kit / "admin.yaml").coordinator
    return AdminClient(address, args.kit, timeout_s=args.timeout)


def _read_state_dir(args):
    """--state: an AdminClient from the `plexus.local_admin` entry point (PLEXUS_KIT and PLEXUS_COORDINATOR,
    which name a live coordinator, do not apply)."""
    if given := sorted(getattr(args, "given", ())):
        raise UsageError(f"--state reads a state dir without a coordinator; leave out {' and '.join(given)}")
    found = sorted(entry_points(group=LOCAL_ADMIN_GROUP), key=lambda ep: ep.name)
    if not found:
        raise PlexusError(f"--state needs the coordinator package's {LOCAL_ADMIN_GROUP} entry point, which is not "
                          "installed; reinstall plexus (`pip install -e .` in a checkout)")
    return found[0].load()(args.state)


def needs_coordinator(args, doing: str) -> None:
    """Refuse --state for a command that acts on a running coordinator; `doing`: what it would do."""
    if args.state is not None:
        raise UsageError(f"--state reads a state dir; to {doing}, call a running coordinator with --kit")


def _need_kit(args) -> None:
    if args.kit is None:
        raise UsageError("no admin kit: pass --kit DIR or set PLEXUS_KIT (made by `plexus pki add-admin`)")


def _nonempty(text: str) -> str:
    if not text.strip():
        raise argparse.ArgumentTypeError("must not be empty")
    return text


def _summary_dict(s) -> dict:
    return {"job_id": s.job_id, "name": s.name, "status": s.status, "strategy": s.strategy,
            "round": s.current_round, "rounds": s.rounds, "message": s.message, "submitted_by": s.submitted_by}


def _job_submit(args) -> int:
    needs_coordinator(args, "submit a job")
    try:
        text = args.file.read_text(encoding="utf-8")
    except OSError as exc:
        raise PlexusError(f"cannot read {args.file}: {exc.strerror}") from None
    except UnicodeDecodeError:
        raise PlexusError(f"{args.file}: a round config is UTF-8 text; save it as UTF-8") from None
    with connect(args) as client:
        summary = client.submit(text)
        print(json.dumps(_summary_dict(summary)) if args.json else f"submitted job {summary.job_id}")
        if args.wait:
            return follow(client, summary.job_id, args.json)
    return 0


def _job_list(args) -> int:
    with connect(args) as client:
        jobs = [_summary_dict(s) for s in client.jobs()]
    if args.json:
        print(json.dumps(jobs, indent=2))
    else:
        table(["job_id", "status", "round", "rounds", "strategy", "message"], jobs)
    return 0


def _job_show(args) -> int:
    import grpc

    from plexus.admin_client import job_statistics, statistics_spec

    statistics = denied = None
    with connect(args) as client:
        detail = client.job(args.job_id)
        if statistics_spec(detail) is not None and detail.summary.current_round >= 1:
            try:   # the figures are the job's "model": reading them takes what downloading a model takes
                statistics = job_statistics(client, detail)[1:]
            except grpc.RpcError as exc:
                if exc.code() != grpc.StatusCode.PERMISSION_DENIED:
                    raise
                denied = exc.details()
    print_job(detail, as_json=args.json, statistics=statistics)
    if denied:   # on stderr: what is printed stays machine-readable
        print(printable(f"statistics not shown: {denied}"), file=sys.stderr)
    return 0


def print_job(detail, *, as_json: bool = False, statistics: tuple | None = None) -> None:
    """What `plexus job show` prints of a JobDetail; `statistics`: a statistics job's (figures, DP ledger)."""
    from plexus.admin_client import (
        async_view,
        compression_summary,
        epsilon_by_round,
        mean_eval,
        noise_reproducible,
        statistics_spec,
    )
    from plexus.dp import NOT_PRIVATE

    evals = mean_eval(detail)
    view = async_view(detail)
    if as_json:
        from google.protobuf.json_format import MessageToDict

        out = MessageToDict(detail, preserving_proto_field_name=True)
        if view is not None:
            out["asynchronous"] = view
        if statistics is not None:
            from plexus.statistics import to_json

            out["statistics"] = json.loads(to_json(*statistics))
        print(json.dumps(out, indent=2))
        return
    s = detail.summary
    where = f"version {s.current_round} of {s.rounds}" if view else f"round {s.current_round}/{s.rounds}"
    print(printable(f"job {s.job_id}  ({s.name}, {s.strategy})  status: {s.status}  {where}"))
    if view is not None:
        print(f"  {_async_mode(view['mode'])}")
    if (travels := compression_summary(detail)) is not None:
        print(f"  compression: {travels}")
    if s.message:
        print(f"  {printable(s.message)}")
    if noise_reproducible(detail):
        print(f"  WARNING: {NOT_PRIVATE}")
    eps = epsilon_by_round(detail)
    if view is not None:
        _show_async(detail, view, eps, evals)
    elif detail.rounds:
        rows = [{"round": r.round, "status": r.status, "sites": len(r.contributors), "samples": r.total_samples,
                 "secs": _secs(r), **_evaluated(r.round, eps, evals)} for r in detail.rounds]
        print("\nrounds:" if statistics_spec(detail) is not None else
              "\nrounds (eval_* = the incoming global model on the sites' held-out rows):")
        table(list(dict.fromkeys(k for r in rows for k in r)), rows)
    # An update in the unflushed buffer (or kept at its site for a secure cohort) is waiting, not missing:
    # _show_async lists it.
    issues = [e for e in detail.site_events if e.status not in ("submitted", "evaluated", "buffered", "trained")]
    if issues:
        print("\nsites that did not contribute:")
        table(["round", "site", "status", "reason"],
               [{"round": e.round, "site": e.site, "status": e.status, "reason": e.reason} for e in issues])
    if statistics is not None:
        _show_statistics(*statistics)


def _show_statistics(figures: list, ledger) -> None:
    """A statistics job's figures, one line per column and statistic, one value column per group."""
    from plexus.statistics import to_table

    print("\nstatistics of the pooled rows (var, std and cov with ddof 1, quantiles from the histograms):")
    if ledger is not None:
        per_query = max((q.epsilon for q in ledger.queries), default=0.0)
        print(f"  noised with statistics.dp ({ledger.mechanism}): epsilon {per_query:g} per query, "
              f"{ledger.epsilon:g} in total over {len(ledger.queries)} queries (delta {ledger.delta:g})")
    print(to_table(figures), end="")


def _async_mode(mode: dict) -> str:
    """The settings line of an asynchronous job, as its job_started event words them."""
    fn = mode["staleness"]
    params = {"polynomial": f" (a={fn['a']:g})", "hinge": f" (a={fn['a']:g}, b={fn['b']:g})"}.get(fn["fn"], "")
    text = (f"asynchronous: buffer {mode['buffer']}, max staleness {mode['max_staleness']}, staleness "
            f"{fn['fn']}{params}")
    return text + (f", mixing {mode['mixing']:g}" if mode.get("mixing") is not None else "")


_BAR = 40   # characters of the longest bar of a staleness histogram


def _secs(r) -> str:
    return f"{r.closed_unix_s - r.opened_unix_s:.2f}" if r.closed_unix_s else ""


def _evaluated(round_: int, eps: dict, evals: dict) -> dict:
    """A round's ε after it, and the incoming model's held-out metrics (those of the round before)."""
    return {**({"epsilon": f"{eps[round_]:.3f}"} if round_ in eps else {}),
            **{f"eval_{k}": f"{v:.4f}" for k, v in evals.get(round_ - 1, {}).items()}}


def _show_async(detail, view: dict, eps: dict, evals: dict) -> None:
    """An asynchronous job's versions, its sites' shares and refusals, its staleness histogram, its buffer."""
    from plexus.admin_client import async_ledger

    ledger = async_ledger(detail)
    rows = []
    for r in detail.rounds:   # a version's figures are recorded at its flush: none for an open or failed one
        whole = ledger.get(r.round, {}).get("", {})
        flushed = {"updates": int(whole["updates"]), "sites": len(set(r.contributors)),
                   "samples": r.total_samples, "staleness_mean": f"{whole['staleness_mean']:.2f}",
                   "refused_stale": int(whole.get("refused_stale", 0))} if "updates" in whole else {}
        rows.append({"version": r.round, "status": r.status, **flushed, "secs": _secs(r),
                     **_evaluated(r.round, eps, evals)})
    if rows:
        print("\nversions (eval_* = the version before, on the sites' held-out rows):")
        columns = ["version", "status", "updates", "sites", "samples", "staleness_mean", "refused_stale", "secs"]
        table(list(dict.fromkeys([*columns, *(k for r in rows for k in r)])), rows)
    if view["sites"]:
        print("\nsites (updates in the versions made; refused_stale: older than max staleness):")
        table(["site", "contributions", "refused_stale"], view["sites"])
    if view["staleness"]:
        made = sorted(ledger)
        which = f"version {made[0]}" if len(made) == 1 else f"versions {made[0]}-{made[-1]}"
        top = max(b["updates"] for b in view["staleness"])
        print(f"\nstaleness of the updates in {which} (versions behind the newest when taken in):")
        width = len(str(view["staleness"][-1]["staleness"]))
        for b in view["staleness"]:
            bar = "#" * (round(_BAR * b["updates"] / top) if b["updates"] else 0)
            print(f"  {b['staleness']:>{width}}  {bar:<{_BAR}}  {b['updates']}")
    waiting = view["buffer"]["updates"]
    if waiting:
        held = ", ".join(f"{u['site']} from version {u['from_version']}" for u in waiting)
        print("\n" + printable(f"buffer of version {view['buffer']['version']}: {len(waiting)} of "
                                f"{view['mode']['buffer']} updates ({held})"))


def _job_watch(args) -> int:
    with connect(args) as client:
        return follow(client, args.job_id, args.json)


def follow(client, job_id: str, as_json: bool) -> int:
    """Print a job's events as they happen (`job watch`, `submit --wait`); the exit status says how it ended."""
    from plexus.admin_client import async_spec

    status = "unknown"
    asynchronous = async_spec(client.job(job_id)) is not None
    for event in client.watch(job_id):
        status = event.summary.status
        # A round's close reports the global model it started from, evaluated by the sites on their held-out
        # rows, and the local models the sites trained in it; the job's end, the final global model. A
        # version's close, also the staleness of its updates and the stale ones refused meanwhile.
        metrics = {}
        if event.kind in ("round_closed", "job_completed"):
            detail = client.job(job_id)
            if asynchronous and event.kind == "round_closed":
                flush = _flush_record(detail, event.round)
                metrics = {**_closed_round_metrics(detail, event.round), **flush}
            else:
                metrics = _closed_round_metrics(detail, event.round)
        if as_json:
            print(json.dumps({"at": event.unix_s, "kind": event.kind, "round": event.round, "site": event.site,
                              "message": event.message, "status": status, **metrics}), flush=True)
        else:
            when = time.strftime("%H:%M:%S", time.localtime(event.unix_s))
            # Metric names are only those in _SHOWN: the lines added below them print as they are.
            line = _async_line(event, when) if asynchronous else _event_line(event, when)
            print(printable(line) + _metrics_text(metrics, event.round, asynchronous), flush=True)
    return 0 if status in ("completed", "budget_reached") else 1


def _event_line(event, when: str) -> str:
    where = f" round {event.round}" if event.round else ""
    who = f" {event.site}" if event.site else ""
    return f"[{when}]{where} {event.kind}{who}: {event.message}"


# What became of an asynchronous update (never of an evaluation); its round is the version it trained from.
_UPDATE_OUTCOMES = ("site_buffered", "site_trained", "site_rejected", "site_discarded")


def _async_line(event, when: str) -> str:
    """An asynchronous job's event, in versions: a version made (or failed), what became of an update (which
    version it trained from, and why: a stale refusal says how many versions old it was). Other site events
    keep their task's round; the job's own events name their version in their message."""
    kind, round_, site, message = event.kind, event.round, event.site, event.message
    if kind == "round_closed":
        return f"[{when}] version {round_} made: {message}"
    if kind == "round_failed":
        return f"[{when}] version {round_} failed: {message}"
    if kind == "round_opened":   # its message is the round's kind (Store.open_round): the final evaluation's
        return (f"[{when}] round {round_} opened: every online site evaluates the final model" if message == "evaluate"
                else f"[{when}] buffer of version {round_} opened")
    if kind in _UPDATE_OUTCOMES and site:
        return f"[{when}] {site}: update from version {round_} {kind[5:]}: {message}"
    if kind.startswith("site_"):
        return _event_line(event, when)
    return f"[{when}] {kind}: {message}"


def _flush_record(detail, version: int) -> dict:
    """The flush record of `version` for `job watch`, from a job detail read after the version's close (the
    coordinator writes the record in the same transaction)."""
    from plexus.admin_client import async_ledger, staleness_counts

    ledger = async_ledger(detail)
    if version not in ledger:
        return {}
    per_site = ledger[version]
    whole = per_site.get("", {})
    return {"flush": {
        "version": version, "updates": int(whole.get("updates", 0)), "staleness_mean": whole.get("staleness_mean"),
        "staleness": [{"staleness": t, "updates": n} for t, n in staleness_counts({version: per_site}).items()],
        "contributions": {s: int(v["contributions"]) for s, v in sorted(per_site.items()) if "contributions" in v},
        "refused_stale": {s: int(v["refused_stale"]) for s, v in sorted(per_site.items())
                          if s and v.get("refused_stale")}}}


_SHOWN = ("accuracy", "auc", "loss", "train_loss")


def _closed_round_metrics(detail, round_: int) -> dict:
    """What `job watch` shows when round `round_` closes, keyed by the model it belongs to."""
    from plexus.admin_client import epsilon_by_round, mean_metrics

    out = {}
    evals = {k: v for k, v in mean_metrics(detail, "eval").get(round_ - 1, {}).items() if k in _SHOWN}
    if evals:
        out["global_model"] = {"round": round_ - 1, "eval": evals}
    train = {k: v for k, v in mean_metrics(detail, "train").get(round_, {}).items() if k in _SHOWN}
    if train:
        out["local_models"] = {"round": round_, "train": train}
    if round_ in (eps := epsilon_by_round(detail)):
        out["epsilon"] = eps[round_]
    return out


def _metrics_text(metrics: dict, round_: int, asynchronous: bool = False) -> str:
    def values(named: dict) -> str:
        return " ".join(f"{k}={v:.4f}" for k, v in named.items())

    parts = []
    if "flush" in metrics:
        f = metrics["flush"]
        text = "staleness " + " ".join(f"{b['staleness']}:{b['updates']}" for b in f["staleness"])
        if f["staleness_mean"] is not None:
            text += f" (mean {f['staleness_mean']:.2f})"
        refused = f["refused_stale"]
        if refused:
            text += (f"; refused as stale while it filled: {sum(refused.values())} ("
                     + " ".join(f"{s}={n}" for s, n in refused.items()) + ")")
        parts.append(printable(text))
    model, local = ("version", "in version") if asynchronous else ("global model of round", "of round")
    if "global_model" in metrics:
        g = metrics["global_model"]
        parts.append(f"{model} {g['round']} on the sites' held-out rows: {values(g['eval'])}")
    if "local_models" in metrics:
        m = metrics["local_models"]
        parts.append(f"sites' local models {local} {m['round']}: {values(m['train'])}")
    if "epsilon" in metrics:
        after = "version" if asynchronous else "round"
        parts.append(f"privacy spent after {after} {round_}: epsilon={metrics['epsilon']:.3f}")
    return "".join(f"\n    {part}" for part in parts)


def _job_resume(args) -> int:
    needs_coordinator(args, "resume a job")
    with connect(args) as client:
        s = client.resume(args.job_id)
    print(json.dumps(_summary_dict(s)) if args.json else
          f"job {s.job_id}: {s.status}, resuming after round {s.current_round} "
          f"(follow it: plexus job watch {s.job_id})")
    return 0


def _job_abort(args) -> int:
    needs_coordinator(args, "abort a job")
    with connect(args) as client:
        s = client.abort(args.job_id)
    print(json.dumps(_summary_dict(s)) if args.json else f"job {s.job_id}: {s.status}")
    return 0


DOWNLOAD_FORMATS = ("safetensors", "csv", "json")


def _job_download(args) -> int:
    fmt = args.format or {".csv": "csv", ".json": "json"}.get(args.output.suffix.lower(), "safetensors")
    with connect(args) as client:
        if fmt == "safetensors":
            got = client.download_to(args.job_id, args.output, args.round)
        else:
            got = _download_statistics(client, args.job_id, args.output, args.round, fmt)
    print(json.dumps({"job_id": args.job_id, "round": got, "path": str(args.output), "format": fmt}) if args.json
          else f"wrote round {got} of job {args.job_id} to {args.output} ({fmt})")
    return 0


def _download_statistics(client, job_id: str, path: Path, round_: int, fmt: str) -> int:
    """A statistics job's figures written to `path` as CSV or JSON (with the DP ledger); the round they are of."""
    from plexus.admin_client import job_statistics
    from plexus.files import write_atomically
    from plexus.statistics import to_csv, to_json

    try:
        got, figures, ledger = job_statistics(client, client.job(job_id), round_)
    except PlexusError as exc:
        raise PlexusError(f"cannot write {path} as {fmt}: {exc}") from None
    write_atomically(path, (to_csv(figures) if fmt == "csv" else to_json(figures, ledger)).encode())
    return got


def _job_metrics(args) -> int:
    from plexus.admin_client import noise_reproducible
    from plexus.dp import NOT_PRIVATE

    with connect(args) as client:
        detail = client.job(args.job_id)
    if noise_reproducible(detail):   # on stderr: the table, CSV or JSON on stdout stays machine-readable
        print(f"WARNING: {NOT_PRIVATE}", file=sys.stderr)
    rows = [{"round": m.round, "site": m.site, "kind": m.kind, "name": m.name, "value": m.value}
            for m in detail.metrics]
    fmt = "json" if args.json else args.format
    if fmt == "json":
        print(json.dumps(rows, indent=2))
    elif fmt == "csv":
        out = io.StringIO()
        writer = csv.DictWriter(out, fieldnames=["round", "site", "kind", "name", "value"])
        writer.writeheader()
        writer.writerows({k: csv_cell(v) for k, v in r.items()} for r in rows)
        print(out.getvalue(), end="")
    else:
        table(["round", "site", "kind", "name", "value"], [{**r, "value": f"{r['value']:.6g}"} for r in rows])
    return 0


def _job_plot(args) -> int:
    from plexus.plot import plot_metrics

    with connect(args) as client:
        detail = client.job(args.job_id)
    rows = [(m.round, m.site, m.kind, m.name, m.value) for m in detail.metrics]
    panels = plot_metrics(rows, args.output, title=f"{detail.summary.name} ({detail.summary.job_id})")
    print(json.dumps({"job_id": args.job_id, "path": str(args.output), "panels": panels}) if args.json
          else printable(f"wrote {', '.join(panels)} of job {args.job_id} to {args.output}"))
    return 0


def _job_export(args) -> int:
    import tempfile

    from plexus import tracking
    from plexus.identity import federation_of, identity_from_cert, load_kit

    needs_coordinator(args, "export a job (its run records the federation and who exported it)")
    with tracking.mlflow_env(args.mlflow):
        mlflow = tracking.import_mlflow()
        _need_kit(args)
        kit = load_kit(args.kit)
        me = identity_from_cert(kit.cert_pem)
        if me.role == "viewer" and not args.no_model:   # the coordinator would refuse the download midway
            raise PlexusError(f"viewer kit: pass --no-model or use an operator kit ({args.kit} is {me.name}'s, "
                              "whose role may not download models)")
        tracker = tracking.open_store(mlflow, args.mlflow)   # opens (makes a file: store) before any download
        with connect(args) as client, tempfile.TemporaryDirectory(prefix="plexus-export-") as tmp:
            detail = client.job(args.job_id)
            s = detail.summary
            model, got = (None, None) if args.no_model else _final_model(client, detail, Path(tmp))
            run = tracking.export(detail, coordinator=client.address, federation=federation_of(kit.cert_pem),
                                  exported_by=me.name, experiment=args.experiment, run_name=args.run_name,
                                  model_round=got)
            run_id, experiment_id = tracking.log_run(tracker, args.mlflow, run, model)
    if s.status not in tracking.RUN_STATUS:
        print(printable(f"note: job {s.job_id} is {s.status}: the run holds it as of round {s.current_round}"),
              file=sys.stderr)
    artifact = None if model is None else f"model/{model.name}"
    if args.json:
        print(json.dumps({"job_id": s.job_id, "tracking_uri": args.mlflow, "experiment": run.experiment,
                          "experiment_id": experiment_id, "run_id": run_id, "run_name": run.run_name,
                          "metrics": len(run.metrics), "params": len(run.params), "model": artifact,
                          "model_round": got}))
    else:
        what = f"; model of round {got} as {artifact}" if artifact else ""
        print(printable(f"exported job {s.job_id} to MLflow run {run_id} (experiment {run.experiment!r}) at "
                        f"{args.mlflow}: {len(run.metrics)} metric values, {len(run.params)} params{what}"))
    return 0


def _final_model(client, detail, folder: Path) -> tuple[Path | None, int | None]:
    """The job's latest global model written into `folder`, and its round; (None, None) for a job that has no
    model to log, saying why on stderr."""
    from plexus.admin_client import statistics_spec

    s = detail.summary
    if statistics_spec(detail) is not None:
        print(f"note: job {s.job_id} is a statistics job, whose result is figures, not a model: no model logged "
              f"(`plexus job download {s.job_id} -o FILE.json` writes them)", file=sys.stderr)
        return None, None
    if s.current_round < 1:
        print(f"note: job {s.job_id} has no closed round yet: no model logged", file=sys.stderr)
        return None, None
    path = folder / f"{s.job_id}.safetensors"
    return path, client.download_to(s.job_id, path)


def _health(args) -> int:
    from plexus.health import check

    address, kit = args.address, args.kit
    if args.site_config is not None:
        from plexus.config import load_site_config

        site = load_site_config(args.site_config)
        address, kit = address or site.coordinator, kit or site.kit
    if address is None:
        raise UsageError("no address: pass HOST:PORT or --site-config FILE")
    if kit is None and not args.plaintext:
        raise UsageError("no kit: pass --kit DIR (mTLS) or --site-config FILE, or --plaintext for a health_listen port")
    status = check(address, kit=kit, plaintext=args.plaintext, service=args.service, timeout=args.timeout)
    print(status)
    return 0 if status == "SERVING" else 1


def _sites_list(args) -> int:
    with connect(args) as client:
        sites = [{"site": s.site, "kind": s.kind or "site", "online": s.online, "last_seen": time.strftime(
            "%Y-%m-%d %H:%M:%S", time.localtime(s.last_seen_unix_s)), "policy_digest": s.policy_digest[:16],
            "datasets": ",".join(s.datasets), "dataset_rows": dict(sorted(s.dataset_rows.items())),
            "revoked": s.revoked, "version": s.agent_version, "children": list(s.children)}
            for s in client.sites()]
    if args.json:
        print(json.dumps(sites, indent=2))
    else:
        shown = []
        for s in sites:
            shown.append({**s, "site": s["site"] + (" (relay)" if s["kind"] == "relay" else ""),
                          "rows": ",".join(f"{name}={n}" for name, n in s["dataset_rows"].items())})
            shown += [{"site": "  " * child.count("/") + "└ " + child.rsplit("/", 1)[-1]} for child in s["children"]]
        table(["site", "online", "last_seen", "datasets", "rows", "revoked", "policy_digest", "version"], shown)
    return 0


def _audit(args) -> int:
    needs_coordinator(args, "read the audit log")
    if args.export_head is not None:
        return _audit_export_head(args)
    if args.against is not None and not args.verify:
        raise UsageError("--against HEAD_FILE checks the log: use it with --verify")
    with connect(args) as client:   # --against checks the whole chain, so it reads every entry
        reply = client.audit(verify=args.verify, limit=0 if args.against else max(args.limit, 0))
    if reply.problem == "audit log not configured":
        raise PlexusError("the coordinator has no audit log configured")
    entries = [{"seq": e.seq, "at": e.at, "actor": e.actor, "action": e.action, "subject": e.subject,
                "details": json.loads(e.details_json or "{}"), "hash": e.hash} for e in reply.entries]
    problem = reply.problem
    if args.against is not None and not problem:
        problem = _audit_against(entries, args.against, args.kit)
        if not problem and not args.json:
            print(f"verified against {args.against}: every entry it signed is in the log, unchanged")
        entries = entries[-args.limit:] if args.limit > 0 else entries
    return print_audit(entries, reply.count, args.verify, problem, args.json)


def _audit_against(entries: list[dict], path: Path, kit: Path) -> str:
    """What checking the log's entries against the signed head in `path` found wrong, or ""."""
    from plexus.audit import GENESIS, Entry, SignedHead, verify_against
    from plexus.errors import IntegrityError
    from plexus.identity import load_kit

    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise PlexusError(f"cannot read the signed head {path}: {exc}") from None
    head = SignedHead.from_json(text, source=str(path))
    chain, prev = [], GENESIS
    for e in entries:   # prev_hash is implied by the entry before; verify_against recomputes every hash
        chain.append(Entry(e["seq"], e["at"], e["actor"], e["action"], e["subject"], e["details"], prev, e["hash"]))
        prev = e["hash"]
    try:
        verify_against(chain, head, load_kit(kit).ca_pem)
    except IntegrityError as exc:
        return str(exc)
    return ""


def _audit_export_head(args) -> int:
    from plexus.audit import SignedHead
    from plexus.files import write_atomically
    from plexus.identity import load_kit

    with connect(args) as client:
        reply = client.audit(sign_head=True, limit=1)
    if not reply.signed_head_json:
        raise PlexusError(f"the coordinator returned no signed head: {reply.problem or 'no audit log'}")
    head = SignedHead.from_json(reply.signed_head_json, source="the coordinator's signed head")
    head.verify(load_kit(args.kit).ca_pem)   # never hand the operator a head this federation did not sign
    write_atomically(args.export_head, head.to_json().encode())
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(head.at))
    print(json.dumps({"seq": head.seq, "hash": head.hash, "at": head.at, "path": str(args.export_head)})
          if args.json else
          f"signed head of the audit log (entry {head.seq}, {when}) written to {args.export_head}; keep it "
          f"where the coordinator's operators cannot write, and check with `plexus audit --verify --against FILE`")
    return 0


