"""A coordinator state dir's database as an operator's sqlite3 sees it: a connection of its own, not the Store's."""

from __future__ import annotations

import sqlite3
from pathlib import Path


def query(state_dir: Path, sql: str, args: tuple = ()) -> list[tuple]:
    """Rows of `sql` on `state_dir`/plexus.db, read-only (committed data only)."""
    db = sqlite3.connect(f"file:{Path(state_dir) / 'plexus.db'}?mode=ro", uri=True)
    try:
        return db.execute(sql, args).fetchall()
    finally:
        db.close()


def execute(state_dir: Path, sql: str, args: tuple = ()) -> None:
    """Run one statement on `state_dir`/plexus.db and commit it, as a restore from an older backup would."""
    db = sqlite3.connect(Path(state_dir) / "plexus.db", isolation_level=None)
    try:
        db.execute(sql, args)
    finally:
        db.close()
