"""`plexus site ...`: hospital IT's commands: run the site agent, check its data, read its audit log, pin a
plug-in model.

Found by the kernel's CLI through the `plexus.commands` entry point `site` (pyproject.toml).
"""

from __future__ import annotations

import sys

from plexus.cli.common import audit_flags, command, existing_file, int_in, print_audit
from plexus.errors import PlexusError


def add_commands(sub) -> None:
    """The `site` group under the top-level subparsers `sub`."""
    site = sub.add_parser("site", help="the site agent").add_subparsers(metavar="ACTION")
    run = command(site, "run", _run, help="run the site agent")
    run.add_argument("--config", type=existing_file, required=True)
    run.add_argument("--threads", type=int_in(0), default=0, help="torch CPU threads (default: torch's choice)")
    node = command(site, "node", _node, help="run this machine's training workers for a site that trains over "
                   "several machines (site.yaml training.nodes, rank 1 or more)")
    node.add_argument("--config", type=existing_file, required=True)
    audit = audit_flags(command(site, "audit", _audit, help="print (and verify) this site's own audit log"))
    audit.add_argument("--config", type=existing_file, required=True)
    audit.add_argument("--json", action="store_true", help="machine-readable output")
    check = command(site, "check", _check, help="dry run: load this site's datasets (and check a job's declared "
                    "schema against them) and print what the site would advertise or tell the coordinator")
    check.add_argument("--config", type=existing_file, required=True)
    check.add_argument("--job", type=existing_file, metavar="ROUND.yaml", help="check this round config's data section")
    check.add_argument("--dataset", help="check only this dataset (default: every configured one)")
    check.add_argument("--encoding", help="read CSV files in this encoding (overrides the datasets' `encoding:`)")
    check.add_argument("--delimiter", help="split CSV rows on this character (overrides `delimiter:`)")
    pin = command(site, "pin-model", _pin_model, help="print a plug-in model's source SHA-256 for "
                  "policy.plugin_sha256")
    pin.add_argument("name")


def _run(args) -> int:
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


def _node(args) -> int:
    import logging
    import threading

    from plexus.config import load_site_config
    from plexus.shutdown import StopSignals
    from site_agent.team import run_node

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    config = load_site_config(args.config)
    signals = StopSignals()
    stop = threading.Event()
    failed: list[BaseException] = []

    def serve():
        try:
            run_node(config, stop)
        except BaseException as exc:   # told on the main thread below
            failed.append(exc)

    worker = threading.Thread(target=serve, name="plexus-site-node", daemon=True)
    worker.start()
    signals.wait(done=lambda: not worker.is_alive())
    stop.set()
    worker.join(15)
    if failed:
        raise failed[0]
    return 0


def _audit(args) -> int:
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
        return print_audit(entries, log.count(), args.verify, problem, args.json)


def _check(args) -> int:
    from plexus.config import load_round_config, load_site_config
    from site_agent.check import check_site

    config = load_site_config(args.config)
    job = load_round_config(args.job) if args.job else None
    report, ok = check_site(config, job=job, dataset=args.dataset, encoding=args.encoding, delimiter=args.delimiter)
    print(report)
    return 0 if ok else 1


def _pin_model(args) -> int:
    from plexus.models import plugin_source_sha256

    digest = plugin_source_sha256(args.name)
    print(f"{digest}\n\n# in site.yaml:\npolicy:\n  plugin_sha256: {{{args.name}: '{digest}'}}")
    return 0

