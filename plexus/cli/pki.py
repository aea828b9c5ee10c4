"""`plexus pki`: the operator's offline commands that issue the federation's CA, kits and CRL."""

from __future__ import annotations

import argparse
import os
import re
from pathlib import Path

from plexus.cli.common import command, int_in
from plexus.errors import PlexusError


def add_commands(sub) -> None:
    """The `pki` group under the top-level subparsers `sub`."""
    pki = sub.add_parser("pki", help="federation CA and certificates").add_subparsers(metavar="ACTION")
    init = command(pki, "init", _init, help="create a federation CA and the coordinator's kit")
    init.add_argument("dir", type=Path)
    init.add_argument("--federation", required=True)
    init.add_argument("--host", action="append", default=[], help="coordinator host name or IP (repeatable)")
    init.add_argument("--port", type=int_in(1, 65535), default=8443)
    site = command(pki, "add-site", _add_site, help="issue a site kit")
    site.add_argument("dir", type=Path)
    site.add_argument("name")
    site.add_argument("--dataset", action="append", default=[], type=_dataset_arg, metavar="NAME=DATA",
                      help="map the dataset NAME a job asks for to this site's data, in the kit's site.yaml "
                           "(repeatable). DATA: a built-in heart-disease hospital (cleveland, hungary, "
                           "switzerland, va), FILE.npz, or FILE.csv,label=COLUMN; relative paths are made "
                           "absolute. Without it, fill `datasets:` in site.yaml by hand")
    site.add_argument("--via", metavar="RELAY", help="the site dials this relay (issued with `pki add-relay`) "
                                                    "instead of the coordinator: its site.yaml names the relay")
    relay = command(pki, "add-relay", _add_relay,
                    help="issue a relay kit (a relay aggregates its children's updates and is one site to its parent)")
    relay.add_argument("dir", type=Path)
    relay.add_argument("name")
    relay.add_argument("--host", action="append", required=True,
                       help="host name or IP the relay's children dial (repeatable; its certificate names each)")
    relay.add_argument("--port", type=int_in(1, 65535), default=8443, help="port the relay listens on (default 8443)")
    admin = command(pki, "add-admin", _add_admin, help="issue an admin kit")
    admin.add_argument("dir", type=Path)
    admin.add_argument("name")
    admin.add_argument("--role", choices=["admin", "operator", "viewer"], default="viewer")
    revoke = command(pki, "revoke", _revoke, help="revoke a certificate (the coordinator refuses it on the next call)")
    revoke.add_argument("dir", type=Path)
    revoke.add_argument("name")
    crl = command(pki, "crl", _crl, help="re-issue the CRL before it expires (the coordinator refuses an expired one)")
    crl.add_argument("dir", type=Path)


def _init(args) -> int:
    from plexus import pki

    pki.init_federation(args.dir, args.federation, hosts=args.host, port=args.port)
    print(f"federation {args.federation!r} created in {args.dir}; coordinator kit: {args.dir / 'coordinator'}")
    return 0


def _add_site(args) -> int:
    from plexus import pki

    names = [name for name, _ in args.dataset]
    if twice := sorted({n for n in names if names.count(n) > 1}):
        raise PlexusError(f"--dataset maps {', '.join(twice)} more than once; give each dataset name once")
    kit = pki.add_site(args.dir, args.name, datasets=dict(args.dataset), via=args.via)
    print(f"site kit: {kit}" + (f" (it dials relay {args.via!r})" if args.via else "")
          + ("" if args.dataset else f"; map its datasets in {kit / 'site.yaml'} "
             "(`datasets:`), or issue it with --dataset NAME=DATA"))
    return 0


def _add_relay(args) -> int:
    from plexus import pki
    from plexus.config import load_relay_config

    kit = pki.add_relay(args.dir, args.name, hosts=args.host, port=args.port)
    relay = load_relay_config(kit / "relay.yaml")
    host = args.host[0]
    dialled = f"[{host}]:{args.port}" if ":" in host else f"{host}:{args.port}"
    print(f"relay kit: {kit}; it dials its parent at {relay.parent} and listens at {relay.listen}.\n"
          f"Next: check `parent:` and `tier:` in {kit / 'relay.yaml'} (a relay below another relay dials that "
          f"relay), install the kit on the relay's machine and run `plexus relay run --config relay.yaml`; then "
          f"point each child's `coordinator:` in its site.yaml at {dialled} (docs/install-relay.md)")
    return 0


def _add_admin(args) -> int:
    from plexus import pki

    print(f"admin kit ({args.role}): {pki.add_admin(args.dir, args.name, role=args.role)}")
    return 0


def _crl(args) -> int:
    from plexus import pki

    number = pki.reissue_crl(args.dir)
    print(f"CRL number {number} (valid {pki.CRL_VALIDITY.days} days) written to {_crl_copies(args.dir)}")
    return 0


def _revoke(args) -> int:
    from plexus import pki

    serial = pki.revoke(args.dir, args.name)
    print(f"revoked {args.name!r} (serial {serial}); the CRL is updated in {_crl_copies(args.dir)}")
    return 0


def _crl_copies(root: Path) -> str:
    """Where the CRL was written, and to ship each copy to its server (the coordinator, each relay)."""
    from plexus import pki

    kits = pki.crl_kits(root)
    if len(kits) <= 1:
        return f"{root / 'coordinator' / 'crl.pem'}; ship it to the coordinator"
    return (", ".join(str(kit / "crl.pem") for kit in kits)
            + "; ship each to its server (the coordinator, and each relay: its children are checked against it)")


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
