"""`plexus dashboard`'s command line: where it listens, what it warns about, and what it says without its extra."""

from __future__ import annotations

import argparse
import socket
import sys

import pytest

from plexus.cli import main as cli
from plexus.cli.dashboard import allowed_hosts, exposure_warning, is_loopback, listen_address, url_host


@pytest.mark.parametrize("text", ["8765", "127.0.0.1", "127.0.0.1:http", ":8765", "127.0.0.1:70000"])
def test_listen_refuses_what_is_not_host_port(text):
    with pytest.raises(argparse.ArgumentTypeError, match="is not HOST:PORT; write e.g. --listen 127.0.0.1:8765"):
        listen_address(text)


def test_listen_takes_port_0_and_ipv6_in_brackets():
    assert listen_address("127.0.0.1:0") == ("127.0.0.1", 0)
    assert listen_address("[::1]:8765") == ("::1", 8765)
    assert listen_address("dash.example.org:443") == ("dash.example.org", 443)


def test_only_loopback_goes_without_a_warning():
    assert [is_loopback(h) for h in ("127.0.0.1", "127.8.0.1", "::1", "localhost", "0.0.0.0", "10.1.2.3", "box")] \
        == [True, True, True, True, False, False, False]
    assert exposure_warning("127.0.0.1", 8765, "ops", "operator") is None
    loud = exposure_warning("0.0.0.0", 8765, "ops", "operator")
    assert loud.startswith("WARNING: the dashboard listens on 0.0.0.0:8765, beyond this machine")
    assert "acts as 'ops' with role operator and may abort jobs" in loud and "ssh -L" in loud
    assert "may abort" not in exposure_warning("10.1.2.3", 80, "viewer", "viewer")


def test_without_the_dashboard_extra_it_says_what_to_install(monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(sys.modules, "uvicorn", None)   # as if not installed: importing it raises ImportError
    monkeypatch.setitem(sys.modules, "plexus.dashboard.app", None)
    assert cli(["dashboard", "--kit", str(tmp_path), "--coordinator", "127.0.0.1:1"]) == 1
    assert "error: the dashboard needs Starlette and uvicorn: pip install 'plexus-fl[dashboard]'" \
        in capsys.readouterr().err


def test_a_bad_listen_address_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exit_:
        cli(["dashboard", "--kit", "k", "--listen", "8765"])
    assert exit_.value.code == 2 and "'8765' is not HOST:PORT" in capsys.readouterr().err


def test_the_host_names_it_answers_and_the_url_it_prints():
    assert allowed_hosts("127.0.0.1") == ("127.0.0.1", "localhost")
    assert allowed_hosts("10.1.2.3") == ("10.1.2.3", "127.0.0.1", "localhost")
    everywhere = allowed_hosts("0.0.0.0")
    assert everywhere[:3] == ("0.0.0.0", "127.0.0.1", "localhost")
    assert socket.gethostname().lower() in everywhere and socket.getfqdn().lower() in everywhere
    assert [url_host(h) for h in ("127.0.0.1", "0.0.0.0", "::", "::1", "dash.example.org")] == [
        "127.0.0.1", "127.0.0.1", "127.0.0.1", "[::1]", "dash.example.org"]
