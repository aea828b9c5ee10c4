"""`plexus simulate JOB.yaml --state DIR`: the job on virtual sites on this machine (docs/simulate.md)."""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import sys
from pathlib import Path

from plexus.cli.common import UsageError


def add_commands(sub) -> None:
    p = sub.add_parser(
        "simulate", help="run a job on virtual sites on this machine (or a Ray cluster), bit for bit as a federation",
        description="Run JOB.yaml with the coordinator's own engine and the sites' own agent code on virtual sites, "
                    "on a virtual clock, with no network. The state dir is a coordinator's: read it with `plexus "
                    "job show|metrics|plot|download --state DIR`.")
    p.add_argument("jobs", type=Path, nargs="+", metavar="JOB.yaml",
                   help="the round config, as `plexus job submit` takes it; several run one after the other")
    p.add_argument("--state", type=Path, required=True, metavar="DIR",
                   help="a new (or empty) folder for the run: the coordinator's store and checkpoints, the sites' "
                        "state, their logs")
    sites = p.add_argument_group("sites: site configs, or a dataset and a partition")
    sites.add_argument("--site", type=Path, action="append", default=[], metavar="FILE.yaml",
                       help="a site's config (site.yaml; its datasets and policy are used, its kit and address are "
                            "not); repeat for each site")
    sites.add_argument("--data", metavar="DATA",
                       help="heart-disease (its four hospitals), fashion-mnist, or csv:FILE")
    sites.add_argument("--partition", metavar="P", help="iid, dirichlet:ALPHA or by-column:COLUMN")
    sites.add_argument("--sites", type=int, metavar="N", help="how many virtual sites to make of --data")
    sites.add_argument("--label", metavar="COLUMN", help="csv:FILE's label column")
    sites.add_argument("--partition-seed", type=int, default=0, metavar="SEED",
                       help="the partition's seed (default 0): the same seed, the same rows at every site")
    run = p.add_argument_group("running")
    run.add_argument("--workers", type=int, default=os.cpu_count() or 1, metavar="N",
                     help="worker processes (or Ray actors) the virtual sites run in (default: the cores)")
    run.add_argument("--backend", choices=["process", "ray"], default="process",
                     help="process: worker processes here (default); ray: Ray actors (pip install 'plexus-fl[ray]')")
    run.add_argument("--ray-address", metavar="ADDRESS",
                     help="an existing Ray cluster's address (default: start a local Ray instance)")
    run.add_argument("--threads", type=int, metavar="N",
                     help="torch threads each worker trains with (default: the cores over the workers); for a model "
                          "bit for bit the federation's, the threads the sites train with (`plexus site run "
                          "--threads`): convolutions' results depend on it")
    run.add_argument("--profile", type=Path, metavar="FILE.yaml",
                     help="the sites' compute speed, links and dropout, for the virtual clock (docs/simulate.md)")
    run.add_argument("--json", action="store_true", help="the job's events as JSON lines, as `job watch --json`")
    p.set_defaults(run=_simulate, usage=p)


def _simulate(args: argparse.Namespace) -> int:
    from plexus.config import load_round_config
    from plexus.memory import set_up_simulation
    from simulation.profile import load_profile
    from simulation.simulator import Simulator

    set_up_simulation()
    if args.workers < 1:
        raise UsageError(f"--workers must be at least 1; got {args.workers}")
    if args.threads is not None and args.threads < 1:
        raise UsageError(f"--threads must be at least 1; got {args.threads}")
    if args.ray_address and args.backend != "ray":
        raise UsageError("--ray-address needs --backend ray")
    _check_state(args.state)
    jobs = [load_round_config(path) for path in args.jobs]   # errors name the file and line before anything is made
    datasets = sorted({job.data.dataset for job in jobs})
    if args.data and len(datasets) > 1:
        raise UsageError(f"--data makes one dataset for the sites, and the jobs read {datasets}; simulate them "
                         "separately")
    try:   # a mistake found while the sites are made leaves the state dir as it was: empty
        sites = _sites(args, datasets[0])
        profile = load_profile(args.profile, sorted(sites))
        simulator = Simulator([path.read_text(encoding="utf-8") for path in args.jobs], sites, args.state,
                              workers=args.workers, pool=_pool(args), profile=profile, threads=args.threads)
    except BaseException:
        _empty(args.state)
        raise
    coordinator_log = logging.getLogger("plexus.coordinator")
    level = coordinator_log.level
    if "PLEXUS_LOG" not in os.environ:   # the job's events are the progress; the coordinator's own lines repeat them
        coordinator_log.setLevel(logging.WARNING)
    try:
        outcome = simulator.run(watch=lambda stub, job_id: _follow(stub, job_id, args.json))
    finally:
        coordinator_log.setLevel(level)
    if not args.json:
        for job_id, status, rounds in outcome.jobs:
            print(f"job {job_id} {status} after round {rounds}")
        print(f"{_count(outcome.sites, 'virtual site')} in {_count(outcome.workers, 'worker')}: "
              f"{outcome.simulated_s:.1f} s simulated, "
              f"{outcome.wall_s:.1f} s here" + (f"; {outcome.dropped} tasks dropped by the profile"
                                                 if outcome.dropped else ""))
        print(f"read it with: plexus job show --state {args.state} {outcome.job_id}")
    return 0 if all(status == "completed" for _, status, _ in outcome.jobs) else 1


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s")


def _check_state(state: Path) -> None:
    if state.exists() and (not state.is_dir() or any(state.iterdir())):
        raise UsageError(f"--state {state} is not empty; give a new folder for each simulation")


def _empty(state: Path) -> None:
    """Remove what this run wrote into `state` (it was new or empty: _check_state)."""
    if state.is_dir():
        for entry in state.iterdir():
            shutil.rmtree(entry) if entry.is_dir() else entry.unlink()


def _sites(args, dataset: str) -> dict:
    """Site name -> SiteConfig, from --site files or from --data and its partition."""
    from plexus.config import SiteConfig, load_site_config
    from simulation.partition import parse_partition, virtual_sites

    if args.site and args.data:
        raise UsageError("give either --site files or --data (with --partition and --sites), not both")
    if args.site:
        if args.partition or args.sites or args.label:
            raise UsageError("--partition, --sites and --label go with --data, not --site")
        configs = {}
        for path in args.site:
            config = load_site_config(path)
            if config.site in configs:
                raise UsageError(f"site {config.site!r} is given twice ({path}); each --site names another site")
            if config.training is not None and config.training.world > 1:
                print(f"note: site {config.site!r} trains with several workers (training: in {path}); a virtual "
                      "site trains in one process, which gives the same update to float tolerance (not bit for "
                      "bit)", file=sys.stderr)
            configs[config.site] = config
        return configs
    if not args.data:
        raise UsageError("no sites: give --site FILE.yaml (repeated) or --data with --partition and --sites")
    partition = parse_partition(args.partition) if args.partition else None
    made = virtual_sites(args.data, dataset=dataset, out_dir=(args.state / "data").resolve(), partition=partition,
                         sites=args.sites, label=args.label, seed=args.partition_seed)
    policy = open_policy()
    return {name: SiteConfig(site=name, coordinator="simulation.invalid:1", kit=Path("unused"), datasets=datasets,
                             policy=policy)
            for name, datasets in made.items()}


def open_policy():
    """The policy of a site made from --data: every installed model (plug-ins at their installed source), the
    smallest secure cohort: a researcher's own partition of their own data has no hospital to ask."""
    from plexus.config import PolicySpec
    from plexus.models import REGISTRY, installed_models, plugin_source_sha256

    models = sorted(installed_models())
    return PolicySpec(allowed_models=tuple(models), min_secure_cohort=2,
                      plugin_sha256={name: plugin_source_sha256(name) for name in models if name not in REGISTRY})


def _pool(args):
    if args.backend == "ray":
        from simulation.ray_pool import ray_pool

        return ray_pool(args.ray_address)
    from simulation.pool import ProcessPool

    return ProcessPool


def _follow(stub, job_id: str, as_json: bool) -> None:
    from plexus.admin_client import AdminClient
    from plexus.cli.admin import follow

    follow(AdminClient.over(stub, close=lambda: None, address="simulation"), job_id, as_json)
