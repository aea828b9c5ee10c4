"""Logging setup for every `plexus` process: text or JSON lines, and never key material.

JSON lines carry time, level, logger and message, plus job, round and site when a
call passes them: ``log.info("round closed", extra={"job": j, "round": r, "site": s})``.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import sys
from typing import TextIO

FORMATS = ("text", "json")
CONTEXT_FIELDS = ("job", "round", "site")
TEXT_FORMAT = "%(asctime)s %(name)s %(levelname)s %(message)s"
REDACTED = "[log record withheld: it contained private key material]"


class JsonFormatter(logging.Formatter):
    """One JSON object per line; exceptions go in an "exc" field, never across lines."""

    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "time": dt.datetime.fromtimestamp(record.created, dt.timezone.utc).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        for name in CONTEXT_FIELDS:
            value = getattr(record, name, None)
            if value is not None and value != "":
                entry[name] = value if isinstance(value, (int, float, bool)) else str(value)
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        if record.stack_info:
            entry["stack"] = self.formatStack(record.stack_info)
        return json.dumps(entry, ensure_ascii=False, default=str)


class RedactKeys(logging.Filter):
    """Withhold any record whose rendered text holds a PEM private key.

    Defence in depth: no code path logs keys on purpose, but an exception that
    prints a config or a file's contents must not put one into a log collector.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            text = record.getMessage()
        except Exception:  # a broken format string is logging's problem to report, not ours
            return True
        if record.exc_info and not record.exc_text:
            record.exc_text = logging.Formatter().formatException(record.exc_info)
        for part in (text, record.exc_text or ""):
            if "-----BEGIN" in part and "PRIVATE KEY" in part:
                record.msg, record.args = REDACTED, None
                record.exc_info, record.exc_text, record.stack_info = None, None, None
                break
        return True


def configure(fmt: str = "text", level: str = "INFO", stream: TextIO | None = None) -> logging.Handler:
    """Route the root logger to stream (stderr) in `fmt`; replaces the handler an earlier call installed."""
    if fmt not in FORMATS:
        raise ValueError(f"log format {fmt!r} is not known; use one of: {', '.join(FORMATS)}")
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(TEXT_FORMAT))
    handler.addFilter(RedactKeys())
    handler.plexus = True
    root = logging.getLogger()
    for old in [h for h in root.handlers if getattr(h, "plexus", False)]:
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
    return handler
