"""Log lines: JSON objects with job/round/site when given, and never a private key."""

from __future__ import annotations

import io
import json
import logging
import os

import pytest

from plexus.cli import main as cli
from plexus.logs import REDACTED, JsonFormatter, configure


@pytest.fixture
def restore_logging():
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


def _ours() -> logging.Handler:
    (handler,) = [h for h in logging.getLogger().handlers if getattr(h, "plexus", False)]
    return handler


def _lines(stream: io.StringIO) -> list[dict]:
    return [json.loads(line) for line in stream.getvalue().splitlines()]


def test_json_lines_carry_context_fields(restore_logging):
    out = io.StringIO()
    configure("json", "DEBUG", stream=out)
    log = logging.getLogger("plexus.coordinator")
    log.info("round %d closed", 3, extra={"job": "heart-1", "round": 3, "site": "cleveland"})
    log.warning("no context here")
    try:
        raise ValueError("boom\nsecond line")
    except ValueError:
        log.exception("failed", extra={"job": "heart-1"})
    first, second, third = _lines(out)
    assert first["message"] == "round 3 closed" and first["level"] == "INFO"
    assert first["logger"] == "plexus.coordinator"
    assert (first["job"], first["round"], first["site"]) == ("heart-1", 3, "cleveland")
    assert first["time"].endswith("+00:00")
    assert "job" not in second and "round" not in second
    assert third["job"] == "heart-1" and "ValueError: boom" in third["exc"]


def test_records_with_private_keys_are_withheld(restore_logging, tmp_path):
    from plexus import pki

    pki.init_federation(tmp_path / "fed", "logs", hosts=["127.0.0.1"])
    key = (tmp_path / "fed" / "coordinator" / "key.pem").read_text()
    out = io.StringIO()
    configure("text", stream=out)
    log = logging.getLogger("plexus.test")
    log.info("loaded %s", key)
    try:
        raise RuntimeError(f"bad kit:\n{key}")
    except RuntimeError:
        log.exception("while loading")
    log.info("a harmless line")
    text = out.getvalue()
    assert "PRIVATE KEY" not in text and key.splitlines()[1] not in text
    assert text.count(REDACTED) == 2 and "a harmless line" in text


def test_cli_flag_and_environment_choose_the_format(restore_logging, monkeypatch, capsys, tmp_path):
    monkeypatch.delenv("PLEXUS_LOG_FORMAT", raising=False)
    assert cli(["--log-format", "json", "pki", "revoke", str(tmp_path / "none"), "x"]) == 1
    assert isinstance(_ours().formatter, JsonFormatter)
    assert os.environ["PLEXUS_LOG_FORMAT"] == "json"   # inherited by processes the CLI starts
    monkeypatch.setenv("PLEXUS_LOG_FORMAT", "text")
    assert cli(["pki", "revoke", str(tmp_path / "none"), "x"]) == 1
    assert not isinstance(_ours().formatter, JsonFormatter)
    with pytest.raises(SystemExit):
        cli(["--log-format", "xml", "sites", "list"])
    assert "invalid choice: 'xml'" in capsys.readouterr().err
    with pytest.raises(ValueError, match="use one of: text, json"):
        configure("xml")
