"""The coordinator's `checkpoints` retention settings: typed, validated, with file:line errors."""

from __future__ import annotations

import pytest

from plexus.config import CheckpointsSpec, load_coordinator_config
from plexus.errors import ConfigError


def _load(tmp_path, text: str):
    path = tmp_path / "coordinator.yaml"
    path.write_text("listen: 'h:1'\nkit: k\n" + text)
    return path, load_coordinator_config(path)


def test_retention_is_off_unless_configured(tmp_path):
    assert _load(tmp_path, "")[1].checkpoints == CheckpointsSpec(keep_last=None, keep_every=None)


def test_retention_reads_keep_last_and_keep_every(tmp_path):
    _, cfg = _load(tmp_path, "checkpoints: {keep_last: 3, keep_every: 10}\n")
    assert cfg.checkpoints == CheckpointsSpec(keep_last=3, keep_every=10)


@pytest.mark.parametrize(("text", "expected"), [
    ("checkpoints: {keep_last: 0}\n", "3: checkpoints.keep_last: 0 is out of range; use a value >= 1"),
    ("checkpoints: {keep_last: 2, keep_every: 0}\n", "3: checkpoints.keep_every: 0 is out of range"),
    ("checkpoints: {keep_every: 5}\n", "3: checkpoints.keep_every: only thins out checkpoints that keep_last"),
    ("checkpoints: {keep: 5}\n", "3: checkpoints.keep: unknown key"),
    ("checkpoints: {keep_last: two}\n", "3: checkpoints.keep_last: "),
])
def test_bad_retention_settings_are_refused_with_the_line(tmp_path, text, expected):
    path = tmp_path / "coordinator.yaml"
    path.write_text("listen: 'h:1'\nkit: k\n" + text)
    with pytest.raises(ConfigError) as info:
        load_coordinator_config(path)
    assert str(info.value).startswith(f"{path}:{expected}"), str(info.value)
