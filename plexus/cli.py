"""The `plexus` command: PKI, coordinator, site agent, admin and the demo, behind one entry point."""

from __future__ import annotations

import argparse
import csv
import io
import json
import math
import os
import re
import sys
import time
from pathlib import Path

from plexus.errors import PlexusError
from plexus.text import csv_cell, printable


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if not hasattr(args, "run"):
        parser.print_help()
        return 2
    from plexus.logs import configure

    os.environ["PLEXUS_LOG_FORMAT"] = args.log_format   # processes this one starts (the demo's) log alike
    configure(args.log_format, os.environ.get("PLEXUS_LOG", "INFO"))
    try:
        code = args.run(args) or 0
        sys.stdout.flush()   # here, not at exit, so that a reader that went away is handled below
        return code
    except BrokenPipeError:
        # The reader closed the pipe (`| head -1`): stop quietly. Python's documented recipe: point stdout
        # at devnull so that the flush at exit does not fail once more.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except PlexusError as exc:
        print(f"error: {printable(str(exc))}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    except Exception as exc:
        import grpc

        if isinstance(exc, grpc.RpcError):
            print(f"error: {exc.code().name}: {printable(exc.details() or '')}", file=sys.stderr)
            return 1
        raise


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="plexus", description="Federated learning across hospitals.")
    p.add_argument("--version", action="version", version=f"plexus {_version()}")
    p.add_argument("--log-format", choices=["text", "json"], default=os.environ.get("PLEXUS_LOG_FORMAT") or "text",
                   help="log lines on stderr as text or JSON objects (or PLEXUS_LOG_FORMAT; default text)")
    sub = p.add_subparsers(metavar="COMMAND")

    demo = sub.add_parser("demo", help="run a whole local federation (4 hospitals, mTLS, heart disease)")
    demo.add_argument("--sites", type=int, default=4, help="number of hospitals, 1-4 (default 4)")
    demo.add_argument("--rounds", type=int, default=20, help="federated rounds (default 20)")
    demo.add_argument("--workdir", type=Path, help="keep PKI, state and logs here (default: a temp dir)")
    demo.add_argument("--plot", type=Path, metavar="FILE.png", help="also plot the job's metrics to this PNG")
    demo.add_argument("--secure-aggregation", action="store_true",
                      help="run the job with secure aggregation: the coordinator sees only the sum")
    demo.set_defaults(run=_demo)

    pki = sub.add_parser("pki", help="federation CA and certificates").add_subparsers(metavar="ACTION")
    init = pki.add_parser("init", help="create a federation CA and the coordinator's kit")
    init.add_argument("dir", type=Path)
    init.add_argument("--federation", required=True)
    init.add_argument("--host", action="append", default=[], help="coordinator host name or IP (repeatable)")
    init.add_argument("--port", type=int, default=8443)
    init.set_defaults(run=lambda a: _pki("init", a))
    site = pki.add_parser("add-site", help="issue a site kit")
    site.add_argument("dir", type=Path)
    site.add_argument("name")
    site.add_argument("--dataset", action="append", default=[], type=_dataset_arg, metavar="NAME=DATA",
                      help="map the dataset NAME a job asks for to this site's data, in the kit's site.yaml "
                           "(repeatable). DATA: a built-in heart-disease hospital (cleveland, hungary, "
                           "switzerland, va), FILE.npz, or FILE.csv,label=COLUMN; relative paths are made "
                           "absolute. Without it, fill `datasets:` in site.yaml by hand")
    site.set_defaults(run=lambda a: _pki("add-site", a))
    admin = pki.add_parser("add-admin", help="issue an admin kit")
    admin.add_argument("dir", type=Path)
    admin.add_argument("name")
    admin.add_argument("--role", choices=["admin", "operator", "viewer"], default="viewer")
    admin.set_defaults(run=lambda a: _pki("add-admin", a))
    revoke = pki.add_parser("revoke", help="revoke a certificate (the coordinator refuses it on the next call)")
    revoke.add_argument("dir", type=Path)
    revoke.add_argument("name")
    revoke.set_defaults(run=lambda a: _pki("revoke", a))
    crl = pki.add_parser("crl", help="re-issue the CRL before it expires (the coordinator refuses an expired one)")
    crl.add_argument("dir", type=Path)
    crl.set_defaults(run=lambda a: _pki("crl", a))

    coord = sub.add_parser("coordinator", help="the coordinator service").add_subparsers(metavar="ACTION")
    crun = coord.add_parser("run", help="run the coordinator")
    crun.add_argument("--config", type=Path, required=True)
    crun.set_defaults(run=_coordinator_run)

    siteg = sub.add_parser("site", help="the site agent").add_subparsers(metavar="ACTION")
    srun = siteg.add_parser("run", help="run the site agent")
    srun.add_argument("--config", type=Path, required=True)
    srun.add_argument("--threads", type=int, default=0, help="torch CPU threads (default: torch's choice)")
    srun.set_defaults(run=_site_run)
    saudit = _audit_flags(siteg.add_parser("audit", help="print (and verify) this site's own audit log"))
    saudit.add_argument("--config", type=Path, required=True)
    saudit.add_argument("--json", action="store_true", help="machine-readable output")
    saudit.set_defaults(run=_site_audit)
    scheck = siteg.add_parser("check", help="dry run: load this site's datasets (and check a job's declared "
                              "schema against them) and print what the site would advertise or tell the coordinator")
    scheck.add_argument("--config", type=Path, required=True)
    scheck.add_argument("--job", type=Path, metavar="ROUND.yaml", help="check this round config's data section")
    scheck.add_argument("--dataset", help="check only this dataset (default: every configured one)")
    scheck.add_argument("--encoding", help="read CSV files in this encoding (overrides the datasets' `encoding:`)")
    scheck.add_argument("--delimiter", help="split CSV rows on this character (overrides `delimiter:`)")
    scheck.set_defaults(run=_site_check)
    pin = siteg.add_parser("pin-model", help="print a plug-in model's source SHA-256 for policy.plugin_sha256")
    pin.add_argument("name")
    pin.set_defaults(run=_site_pin_model)

    job = sub.add_parser("job", help="submit and follow jobs").add_subparsers(metavar="ACTION")
    submit = _admin(job.add_parser("submit", help="submit a round config"))
    submit.add_argument("file", type=Path)
    submit.add_argument("--wait", action="store_true", help="follow the job until it ends")
    submit.set_defaults(run=_job_submit)
    _admin(job.add_parser("list", help="list jobs")).set_defaults(run=_job_list)
    for name, fn, text in (("show", _job_show, "a job's rounds, sites and metrics"),
                           ("watch", _job_watch, "follow a job live"), ("abort", _job_abort, "abort a job"),
                           ("resume", _job_resume, "run a failed job again from its last closed round")):
        cmd = _admin(job.add_parser(name, help=text))
        cmd.add_argument("job_id")
        cmd.set_defaults(run=fn)
    dl = _admin(job.add_parser("download", help="download a global model as safetensors"))
    dl.add_argument("job_id")
    dl.add_argument("--round", type=int, default=-1, help="round (default: the latest closed round)")
    dl.add_argument("-o", "--output", type=Path, required=True)
    dl.set_defaults(run=_job_download)
    met = _admin(job.add_parser("metrics", help="per-site, per-round metrics"))
    met.add_argument("job_id")
    met.add_argument("--format", choices=["table", "csv", "json"], default="table")
    met.set_defaults(run=_job_metrics)
    plot = _admin(job.add_parser("plot", help="plot a job's metrics per round to a PNG"))
    plot.add_argument("job_id")
    plot.add_argument("-o", "--output", type=Path, required=True, help="PNG file to write")
    plot.set_defaults(run=_job_plot)

    health = sub.add_parser("health", help="ask a coordinator's gRPC health service (exit 0 when SERVING)")
    health.add_argument("address", nargs="?", help="host:port (default: the coordinator in --site-config)")
    health.add_argument("--kit", type=Path, help="present this kit over mTLS")
    health.add_argument("--plaintext", action="store_true",
                        help="probe a plaintext health-only port (health_listen) without a kit; warns")
    health.add_argument("--site-config", type=Path, help="use this site config's coordinator address and kit")
    health.add_argument("--service", default="", help="service name to check (default: the whole server)")
    health.add_argument("--timeout", type=float, default=5.0, help="seconds (default 5)")
    health.set_defaults(run=_health)

    sites = sub.add_parser("sites", help="the federation's sites").add_subparsers(metavar="ACTION")
    _admin(sites.add_parser("list", help="list sites")).set_defaults(run=_sites_list)

    audit = _audit_flags(_admin(sub.add_parser("audit", help="the coordinator's audit log")))
    audit.add_argument("--export-head", type=Path, metavar="FILE",
                       help="write the log's head, signed by the coordinator, to FILE; keep it off the coordinator")
    audit.add_argument("--against", type=Path, metavar="HEAD_FILE",
                       help="with --verify: also check the log still holds, unchanged, every entry HEAD_FILE signed")
    audit.set_defaults(run=_audit)
    return p


def _admin(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("--coordinator", default=os.environ.get("PLEXUS_COORDINATOR"),
                   help="host:port (or PLEXUS_COORDINATOR; default: from the kit's admin.yaml)")
    p.add_argument("--kit", type=Path, default=os.environ.get("PLEXUS_KIT"),
                   help="admin kit folder (or PLEXUS_KIT)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--timeout", type=_seconds, metavar="SECONDS",
                   help="deadline of each call to the coordinator (default 30; the audit log 120, downloads 600; "
                        "watching a job has none). A submit that misses it is sent again with the same request "
                        "id, so it never creates a second job")
    return p


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds above 0; write e.g. --timeout 60")
    return value


def _dataset_arg(text: str) -> tuple[str, dict[str, str]]:
    """`pki add-site --dataset NAME=DATA` as (NAME, the dataset's entry in site.yaml)."""
    from plexus.datasets import HOSPITALS

    examples = "e.g. heart-disease=cleveland, scans=/data/scans.npz or registry=/data/heart.csv,label=target"
    name, sep, data = text.partition("=")
    if not sep or not data:
        raise argparse.ArgumentTypeError(f"{text!r} is not NAME=DATA; write {examples}")
    if not _DATASET_NAME.fullmatch(name):
        raise argparse.ArgumentTypeError(f"dataset name {name!r} is not valid: use 1-64 letters, digits, '.', '_' "
                                         "or '-', starting with a letter or digit (the name jobs ask for in "
                                         "data.dataset)")
    if data in HOSPITALS:
        return name, {"kind": "heart-disease", "hospital": data}
    path, sep, label = data.rpartition(",label=")
    if not sep:   # rpartition found no label=: all of DATA is the path
        path, label = data, ""
    kind = Path(path).suffix.lower().lstrip(".")
    if kind not in ("csv", "npz"):
        raise argparse.ArgumentTypeError(
            f"{name}={data}: DATA is a built-in heart-disease hospital ({', '.join(HOSPITALS)}), a .npz file or a "
            f".csv file with its label column; write {examples} (other kinds: edit `datasets:` in site.yaml)")
    if kind == "csv" and not label:
        raise argparse.ArgumentTypeError(f"{name}={data}: a CSV dataset needs its label column; write "
                                         f"{name}={path},label=COLUMN")
    if kind == "npz" and sep:
        raise argparse.ArgumentTypeError(f"{name}={data}: label= applies to CSV files only; write {name}={path}")
    entry = {"kind": kind, "path": os.path.abspath(os.path.expanduser(path))}
    if kind == "csv":
        entry["label"] = label
    return name, entry


_DATASET_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("plexus-fl")
    except PackageNotFoundError:   # run from a checkout that was never installed
        from plexus import __version__

        return __version__


def _client(args):
    from plexus.admin_client import AdminClient
    from plexus.config import load_admin_config

    if args.kit is None:
        raise PlexusError("no admin kit: pass --kit DIR or set PLEXUS_KIT (made by `plexus pki add-admin`)")
    address = args.coordinator
    if address is None:
        if not (args.kit / "admin.yaml").exists():
            raise PlexusError("no coordinator address: pass --coordinator HOST:PORT or set PLEXUS_COORDINATOR")
        address = load_admin_config(args.kit / "admin.yaml").coordinator
    return AdminClient(address, args.kit, timeout_s=args.timeout)


# pki / services --------------------------------------------------------------------------
def _pki(action: str, args) -> int:
    from plexus import pki

    if action == "init":
        pki.init_federation(args.dir, args.federation, hosts=args.host, port=args.port)
        print(f"federation {args.federation!r} created in {args.dir}; coordinator kit: {args.dir / 'coordinator'}")
    elif action == "add-site":
        names = [name for name, _ in args.dataset]
        if twice := sorted({n for n in names if names.count(n) > 1}):
            raise PlexusError(f"--dataset maps {', '.join(twice)} more than once; give each dataset name once")
        kit = pki.add_site(args.dir, args.name, datasets=dict(args.dataset))
        print(f"site kit: {kit}" + ("" if args.dataset else f"; map its datasets in {kit / 'site.yaml'} "
                                    "(`datasets:`), or issue it with --dataset NAME=DATA"))
    elif action == "add-admin":
        print(f"admin kit ({args.role}): {pki.add_admin(args.dir, args.name, role=args.role)}")
    elif action == "crl":
        number = pki.reissue_crl(args.dir)
        print(f"CRL number {number} (valid {pki.CRL_VALIDITY.days} days) written to "
              f"{args.dir / 'coordinator' / 'crl.pem'}; ship it to the coordinator")
    else:
        serial = pki.revoke(args.dir, args.name)
        print(f"revoked {args.name!r} (serial {serial}); the CRL in {args.dir / 'coordinator' / 'crl.pem'} is updated")
    return 0


def _coordinator_run(args) -> int:
    from coordinator.server import run
    from plexus.config import load_coordinator_config
    from plexus.memory import limit_malloc_arenas

    limit_malloc_arenas()   # before gRPC starts its threads
    return run(load_coordinator_config(args.config))


def _site_run(args) -> int:
    import logging
    import threading

    from plexus.memory import limit_malloc_arenas
    from plexus.shutdown import StopSignals

    limit_malloc_arenas()   # before torch and gRPC start their threads
    import torch

    from plexus.config import load_site_config
    from site_agent.agent import SiteAgent

    if args.threads:
        torch.set_num_threads(args.threads)
    agent = SiteAgent(load_site_config(args.config))
    signals = StopSignals()

    def serve():
        try:
            agent.run()
        except Exception:
            logging.getLogger("plexus.site").exception("the site agent stopped on an unexpected error")

    worker = threading.Thread(target=serve, name="plexus-site", daemon=True)
    worker.start()
    signals.wait(done=lambda: not worker.is_alive())
    agent.shutdown()
    if not signals.received:   # the agent died on an error it could not report: never linger as a zombie
        print("error: the site agent stopped on an unexpected error (logged above); fix it and restart the agent",
              file=sys.stderr)
        return 1
    # A task in flight may finish its report; a long poll or a training step is left to die with the process.
    worker.join(2.0)
    return 0


# admin ----------------------------------------------------------------------------------
def _summary_dict(s) -> dict:
    return {"job_id": s.job_id, "name": s.name, "status": s.status, "strategy": s.strategy,
            "round": s.current_round, "rounds": s.rounds, "message": s.message, "submitted_by": s.submitted_by}


def _job_submit(args) -> int:
    try:
        text = args.file.read_text()
    except OSError as exc:
        raise PlexusError(f"cannot read {args.file}: {exc.strerror}") from None
    with _client(args) as client:
        summary = client.submit(text)
        print(json.dumps(_summary_dict(summary)) if args.json else f"submitted job {summary.job_id}")
        if args.wait:
            return _follow(client, summary.job_id, args.json)
    return 0


def _job_list(args) -> int:
    with _client(args) as client:
        jobs = [_summary_dict(s) for s in client.jobs()]
    if args.json:
        print(json.dumps(jobs, indent=2))
    else:
        _table(["job_id", "status", "round", "rounds", "strategy", "message"], jobs)
    return 0


def _job_show(args) -> int:
    from plexus.admin_client import epsilon_by_round, mean_eval, noise_reproducible
    from plexus.dp import NOT_PRIVATE

    with _client(args) as client:
        detail = client.job(args.job_id)
    evals = mean_eval(detail)
    if args.json:
        from google.protobuf.json_format import MessageToDict

        print(json.dumps(MessageToDict(detail, preserving_proto_field_name=True), indent=2))
        return 0
    s = detail.summary
    print(printable(f"job {s.job_id}  ({s.name}, {s.strategy})  status: {s.status}  "
                    f"round {s.current_round}/{s.rounds}"))
    if s.message:
        print(f"  {printable(s.message)}")
    if noise_reproducible(detail):
        print(f"  WARNING: {NOT_PRIVATE}")
    eps = epsilon_by_round(detail)
    rows = [{"round": r.round, "status": r.status, "sites": len(r.contributors), "samples": r.total_samples,
             "secs": f"{r.closed_unix_s - r.opened_unix_s:.2f}" if r.closed_unix_s else "",
             **({"epsilon": f"{eps[r.round]:.3f}"} if r.round in eps else {}),
             **{f"eval_{k}": f"{v:.4f}" for k, v in evals.get(r.round - 1, {}).items()}} for r in detail.rounds]
    if rows:
        print("\nrounds (eval_* = the incoming global model on the sites' held-out rows):")
        _table(list(dict.fromkeys(k for r in rows for k in r)), rows)
    issues = [e for e in detail.site_events if e.status not in ("submitted", "evaluated")]
    if issues:
        print("\nsites that did not contribute:")
        _table(["round", "site", "status", "reason"],
               [{"round": e.round, "site": e.site, "status": e.status, "reason": e.reason} for e in issues])
    return 0


def _job_watch(args) -> int:
    with _client(args) as client:
        return _follow(client, args.job_id, args.json)


def _follow(client, job_id: str, as_json: bool) -> int:
    status = "unknown"
    for event in client.watch(job_id):
        status = event.summary.status
        # A round's close reports the global model it started from, evaluated by the sites on their held-out
        # rows, and the local models the sites trained in it; the job's end, the final global model.
        metrics = _closed_round_metrics(client.job(job_id), event.round) \
            if event.kind in ("round_closed", "job_completed") else {}
        if as_json:
            print(json.dumps({"at": event.unix_s, "kind": event.kind, "round": event.round, "site": event.site,
                              "message": event.message, "status": status, **metrics}), flush=True)
        else:
            when = time.strftime("%H:%M:%S", time.localtime(event.unix_s))
            where = f" round {event.round}" if event.round else ""
            who = f" {event.site}" if event.site else ""
            # Metric names are only those in _SHOWN: the lines added below them print as they are.
            print(printable(f"[{when}]{where} {event.kind}{who}: {event.message}")
                  + _metrics_text(metrics, event.round), flush=True)
    return 0 if status in ("completed", "budget_reached") else 1


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


def _metrics_text(metrics: dict, round_: int) -> str:
    def values(named: dict) -> str:
        return " ".join(f"{k}={v:.4f}" for k, v in named.items())

    parts = []
    if "global_model" in metrics:
        g = metrics["global_model"]
        parts.append(f"global model of round {g['round']} on the sites' held-out rows: {values(g['eval'])}")
    if "local_models" in metrics:
        m = metrics["local_models"]
        parts.append(f"sites' local models of round {m['round']}: {values(m['train'])}")
    if "epsilon" in metrics:
        parts.append(f"privacy spent after round {round_}: epsilon={metrics['epsilon']:.3f}")
    return "".join(f"\n    {part}" for part in parts)


def _job_resume(args) -> int:
    with _client(args) as client:
        s = client.resume(args.job_id)
    print(json.dumps(_summary_dict(s)) if args.json else
          f"job {s.job_id}: {s.status}, resuming after round {s.current_round} "
          f"(follow it: plexus job watch {s.job_id})")
    return 0


def _job_abort(args) -> int:
    with _client(args) as client:
        s = client.abort(args.job_id)
    print(json.dumps(_summary_dict(s)) if args.json else f"job {s.job_id}: {s.status}")
    return 0


def _job_download(args) -> int:
    with _client(args) as client:
        got = client.download_to(args.job_id, args.output, args.round)
    print(json.dumps({"job_id": args.job_id, "round": got, "path": str(args.output)}) if args.json
          else f"wrote round {got} of job {args.job_id} to {args.output}")
    return 0


def _job_metrics(args) -> int:
    from plexus.admin_client import noise_reproducible
    from plexus.dp import NOT_PRIVATE

    with _client(args) as client:
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
        _table(["round", "site", "kind", "name", "value"], [{**r, "value": f"{r['value']:.6g}"} for r in rows])
    return 0


def _job_plot(args) -> int:
    from plexus.plot import plot_metrics

    with _client(args) as client:
        detail = client.job(args.job_id)
    rows = [(m.round, m.site, m.kind, m.name, m.value) for m in detail.metrics]
    panels = plot_metrics(rows, args.output, title=f"{detail.summary.name} ({detail.summary.job_id})")
    print(json.dumps({"job_id": args.job_id, "path": str(args.output), "panels": panels}) if args.json
          else printable(f"wrote {', '.join(panels)} of job {args.job_id} to {args.output}"))
    return 0


def _health(args) -> int:
    from plexus.health import check

    address, kit = args.address, args.kit
    if args.site_config is not None:
        from plexus.config import load_site_config

        site = load_site_config(args.site_config)
        address, kit = address or site.coordinator, kit or site.kit
    if address is None:
        raise PlexusError("no address: pass HOST:PORT or --site-config FILE")
    if kit is None and not args.plaintext:
        raise PlexusError("no kit: pass --kit DIR (mTLS) or --site-config FILE, or --plaintext for a health_listen port")
    status = check(address, kit=kit, plaintext=args.plaintext, service=args.service, timeout=args.timeout)
    print(status)
    return 0 if status == "SERVING" else 1


def _sites_list(args) -> int:
    with _client(args) as client:
        sites = [{"site": s.site, "online": s.online, "last_seen": time.strftime(
            "%Y-%m-%d %H:%M:%S", time.localtime(s.last_seen_unix_s)), "policy_digest": s.policy_digest[:16],
            "datasets": ",".join(s.datasets), "version": s.agent_version} for s in client.sites()]
    if args.json:
        print(json.dumps(sites, indent=2))
    else:
        _table(["site", "online", "last_seen", "datasets", "policy_digest", "version"], sites)
    return 0


def _audit_flags(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("--verify", action="store_true", help="check the hash chain; exit 1 if it was tampered with")
    p.add_argument("--limit", type=int, default=0, help="only the last N entries (default: all)")
    return p


def _audit(args) -> int:
    if args.export_head is not None:
        return _audit_export_head(args)
    if args.against is not None and not args.verify:
        raise PlexusError("--against HEAD_FILE checks the log: use it with --verify")
    with _client(args) as client:   # --against checks the whole chain, so it reads every entry
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
    return _print_audit(entries, reply.count, args.verify, problem, args.json)


def _audit_against(entries: list[dict], path: Path, kit: Path) -> str:
    """What checking the log's entries against the signed head in `path` found wrong, or ""."""
    from plexus.audit import GENESIS, Entry, SignedHead, verify_against
    from plexus.errors import IntegrityError
    from plexus.pki import load_kit

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
    from plexus.pki import load_kit

    with _client(args) as client:
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


def _site_audit(args) -> int:
    from plexus.audit import AuditLog
    from plexus.config import load_site_config
    from plexus.errors import IntegrityError

    path = load_site_config(args.config).state_dir / "audit.db"
    if not path.exists():  # never create an empty log here: that would hide a deleted one
        raise PlexusError(f"no audit log at {path}; the site agent writes it once it runs or declines a job")
    with AuditLog(path) as log:
        problem = ""
        if args.verify:
            try:
                log.verify()
            except IntegrityError as exc:
                problem = str(exc)
        try:
            entries = [e.to_dict() for e in log.entries(limit=max(args.limit, 0) or None)]
        except IntegrityError as exc:
            entries, problem = [], problem or str(exc)
        return _print_audit(entries, log.count(), args.verify, problem, args.json)


def _print_audit(entries: list[dict], count: int, verify: bool, problem: str, as_json: bool) -> int:
    if as_json:
        out = {"count": count, "entries": entries}
        if verify:
            out.update(verified=not problem, problem=problem)
        print(json.dumps(out, indent=2))
    else:
        _table(["seq", "time", "actor", "action", "subject", "details"], [
            {"seq": e["seq"], "time": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(e["at"])),
             "actor": e["actor"], "action": e["action"], "subject": e["subject"],
             "details": json.dumps(e["details"], sort_keys=True, separators=(",", ":"))} for e in entries])
        if verify and not problem:
            print(f"\nverified: {count} entries, hash chain intact")
    if problem:
        print(f"audit log verification FAILED: {printable(problem)}", file=sys.stderr)
        return 1
    return 0


def _site_check(args) -> int:
    from plexus.config import load_round_config, load_site_config
    from site_agent.check import check_site

    config = load_site_config(args.config)
    job = load_round_config(args.job) if args.job else None
    report, ok = check_site(config, job=job, dataset=args.dataset, encoding=args.encoding, delimiter=args.delimiter)
    print(report)
    return 0 if ok else 1


def _site_pin_model(args) -> int:
    from plexus.models import plugin_source_sha256

    digest = plugin_source_sha256(args.name)
    print(f"{digest}\n\n# in site.yaml:\npolicy:\n  plugin_sha256: {{{args.name}: '{digest}'}}")
    return 0


def _demo(args) -> int:
    from plexus.demo import run_demo

    return run_demo(sites=args.sites, rounds=args.rounds, workdir=args.workdir, secure=args.secure_aggregation,
                    plot=args.plot)


def _table(columns: list[str], rows: list[dict]) -> None:
    """Rows as aligned columns; every cell is made printable, as most hold text from sites or the coordinator."""
    cells = [[printable(str(r.get(c, ""))) for c in columns] for r in rows]
    widths = [max([len(c)] + [len(row[i]) for row in cells]) for i, c in enumerate(columns)]
    print("  ".join(c.ljust(w) for c, w in zip(columns, widths)).rstrip())
    for row in cells:
        print("  ".join(v.ljust(w) for v, w in zip(row, widths)).rstrip())


if __name__ == "__main__":
    sys.exit(main())
