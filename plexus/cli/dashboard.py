"""`plexus dashboard`: a live web view of the federation, served on this machine for one admin kit."""

from __future__ import annotations

import argparse
import ipaddress
import json
import socket
import sys

from plexus.cli.admin import admin_flags, connect, needs_coordinator
from plexus.cli.common import command
from plexus.errors import PlexusError

DEFAULT_LISTEN = "127.0.0.1:8765"
NEEDS = "the dashboard needs Starlette and uvicorn: pip install 'plexus-fl[dashboard]'"
WILDCARD = ("0.0.0.0", "::")   # listen on every interface


def add_commands(sub) -> None:
    """The `dashboard` command under the top-level subparsers `sub`."""
    p = admin_flags(command(sub, "dashboard", _dashboard,
                       help="serve a live web dashboard of the federation, acting with this admin kit"))
    p.add_argument("--listen", type=listen_address, default=DEFAULT_LISTEN, metavar="HOST:PORT",
                   help=f"where to serve it (default {DEFAULT_LISTEN}; port 0: any free port). Anything but "
                        "loopback lets whoever reaches it and has the URL act with this kit's role")


def listen_address(text: str) -> tuple[str, int]:
    """An argparse type: HOST:PORT ([::1]:PORT for IPv6) with a port from 0 to 65535."""
    host, sep, port = text.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not HOST:PORT; write e.g. --listen 127.0.0.1:8765")
    return host, int(port)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:   # a name: it may resolve anywhere
        return False


def allowed_hosts(host: str) -> tuple[str, ...]:
    """The Host header names the dashboard answers (against DNS rebinding): the listen host, loopback's names,
    and for a wildcard listen this machine's own names."""
    names = [host, "127.0.0.1", "localhost"]
    if host in WILDCARD:
        names += [socket.gethostname(), socket.getfqdn()]
    return tuple(dict.fromkeys(n.lower() for n in names if n))


def url_host(host: str) -> str:
    """How the printed URL names the listen host (a wildcard: loopback, which reaches it from here)."""
    if host in WILDCARD:
        return "127.0.0.1"
    return f"[{host}]" if ":" in host else host


def exposure_warning(host: str, port: int, name: str, role: str) -> str | None:
    """What to say, loudly, when the dashboard listens beyond this machine (None on loopback)."""
    if is_loopback(host):
        return None
    return (f"WARNING: the dashboard listens on {host}:{port}, beyond this machine: anyone who reaches it with its "
            f"URL acts as {name!r} with role {role}"
            + (" and may abort jobs" if role in ("admin", "operator") else "")
            + ". Prefer the default 127.0.0.1 and an SSH tunnel (ssh -L 8765:127.0.0.1:8765 HOST).")


def _dashboard(args) -> int:
    needs_coordinator(args, "serve the dashboard (a live view)")
    try:
        import uvicorn

        from plexus.dashboard.app import Session, create_app
    except ImportError:
        raise PlexusError(NEEDS) from None
    from plexus.identity import identity_from_cert, load_kit

    host, port = args.listen
    client = connect(args)
    try:
        me = identity_from_cert(load_kit(args.kit).cert_pem)
        if me.kind != "admin":
            raise PlexusError(f"{args.kit} is a {me.kind} kit; the dashboard needs an admin kit (made by "
                              "`plexus pki add-admin`)")
        sock = _bind(host, port)
        port = sock.getsockname()[1]
        session = Session(name=me.name, role=me.role, coordinator=client.address, cookie=f"plexus_dashboard_{port}")
        hosts = allowed_hosts(host)
        app = create_app(client, session, hosts=hosts)
        if (warning := exposure_warning(host, port, me.name, me.role)) is not None:
            print(warning, file=sys.stderr)
            if host in WILDCARD:
                print(f"other machines open it as http://{hosts[-1]}:{port}/?token=… (the Host names it answers: "
                      f"{', '.join(hosts[1:])})", file=sys.stderr)
        url = f"http://{url_host(host)}:{port}/?token={session.token}"
        print(json.dumps({"url": url, "name": me.name, "role": me.role}) if args.json
              else f"dashboard: {url} (as {me.name}, role {me.role})", flush=True)
        # No access log: the first request's URL carries the token.
        server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off",
                                               proxy_headers=False, server_header=False,
                                               timeout_graceful_shutdown=2))
        server.run(sockets=[sock])
    finally:
        client.close()
    return 0


def _bind(host: str, port: int) -> socket.socket:
    """A bound socket (port 0: a free one), so the printed URL names the real port."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise PlexusError(f"cannot listen on {host}:{port}: {exc.strerror}; check --listen") from None
    family, _, _, _, address = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as exc:
        sock.close()
        raise PlexusError(f"cannot listen on {host}:{port}: {exc.strerror}; pick another port with --listen "
                          "(port 0: any free one)") from None
    return sock
