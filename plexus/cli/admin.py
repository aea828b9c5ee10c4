"""The researcher's and admin's commands, all calls to a running coordinator: `job`, `sites`, `audit`, and
the `health` probe an operator scripts."""

from __future__ import annotations

import argparse
import csv
import io
import json
import os
import sys
import time
from pathlib import Path

from plexus.cli.common import UsageError, audit_flags, command, existing_file, print_audit, seconds, table
from plexus.errors import PlexusError
from plexus.text import csv_cell, printable


def add_commands(sub) -> None:
    """The `job`, `health`, `sites` and `audit` groups under the top-level subparsers `sub`."""
    job = sub.add_parser("job", help="submit and follow jobs").add_subparsers(metavar="ACTION")
    submit = _admin(command(job, "submit", _job_submit, help="submit a round config"))
    submit.add_argument("file", type=existing_file)
    submit.add_argument("--wait", action="store_true", help="follow the job until it ends")
    _admin(command(job, "list", _job_list, help="list jobs"))
    for name, fn, text in (("show", _job_show, "a job's rounds, sites and metrics"),
                           ("watch", _job_watch, "follow a job live"), ("abort", _job_abort, "abort a job"),
                           ("resume", _job_resume, "run a failed job again from its last closed round")):
        _admin(command(job, name, fn, help=text)).add_argument("job_id")
    dl = _admin(command(job, "download", _job_download, help="download a global model as safetensors"))
    dl.add_argument("job_id")
    dl.add_argument("--round", type=int, default=-1, help="round (default: the latest closed round)")
    dl.add_argument("-o", "--output", type=Path, required=True)
    met = _admin(command(job, "metrics", _job_metrics, help="per-site, per-round metrics"))
    met.add_argument("job_id")
    met.add_argument("--format", choices=["table", "csv", "json"], default="table")
    plot = _admin(command(job, "plot", _job_plot, help="plot a job's metrics per round to a PNG"))
    plot.add_argument("job_id")
    plot.add_argument("-o", "--output", type=Path, required=True, help="PNG file to write")

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
    _admin(command(sites, "list", _sites_list, help="list sites"))

    audit = audit_flags(_admin(command(sub, "audit", _audit, help="the coordinator's audit log")))
    audit.add_argument("--export-head", type=Path, metavar="FILE",
                       help="write the log's head, signed by the coordinator, to FILE; keep it off the coordinator")
    audit.add_argument("--against", type=existing_file, metavar="HEAD_FILE",
                       help="with --verify: also check the log still holds, unchanged, every entry HEAD_FILE signed")


def _admin(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("--coordinator", default=os.environ.get("PLEXUS_COORDINATOR"),
                   help="host:port (or PLEXUS_COORDINATOR; default: from the kit's admin.yaml)")
    p.add_argument("--kit", type=Path, default=os.environ.get("PLEXUS_KIT"),
                   help="admin kit folder (or PLEXUS_KIT)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--timeout", type=seconds, metavar="SECONDS",
                   help="deadline of each call to the coordinator (default 30; the audit log 120, downloads 600; "
                        "watching a job has none). A submit that misses it is sent again with the same request "
                        "id, so it never creates a second job")
    return p



def _client(args):
    from plexus.admin_client import AdminClient
    from plexus.config import load_admin_config

    if args.kit is None:
        raise UsageError("no admin kit: pass --kit DIR or set PLEXUS_KIT (made by `plexus pki add-admin`)")
    address = args.coordinator
    if address is None:
        if not (args.kit / "admin.yaml").exists():
            raise UsageError("no coordinator address: pass --coordinator HOST:PORT or set PLEXUS_COORDINATOR")
        address = load_admin_config(args.kit / "admin.yaml").coordinator
    return AdminClient(address, args.kit, timeout_s=args.timeout)


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
        table(["job_id", "status", "round", "rounds", "strategy", "message"], jobs)
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
        table(list(dict.fromkeys(k for r in rows for k in r)), rows)
    issues = [e for e in detail.site_events if e.status not in ("submitted", "evaluated")]
    if issues:
        print("\nsites that did not contribute:")
        table(["round", "site", "status", "reason"],
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
        table(["round", "site", "kind", "name", "value"], [{**r, "value": f"{r['value']:.6g}"} for r in rows])
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
        raise UsageError("no address: pass HOST:PORT or --site-config FILE")
    if kit is None and not args.plaintext:
        raise UsageError("no kit: pass --kit DIR (mTLS) or --site-config FILE, or --plaintext for a health_listen port")
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
        table(["site", "online", "last_seen", "datasets", "policy_digest", "version"], sites)
    return 0


def _audit(args) -> int:
    if args.export_head is not None:
        return _audit_export_head(args)
    if args.against is not None and not args.verify:
        raise UsageError("--against HEAD_FILE checks the log: use it with --verify")
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


