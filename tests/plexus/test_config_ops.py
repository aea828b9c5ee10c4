"""The coordinator's operations keys: metrics_listen and health_listen."""

from __future__ import annotations

import pytest

from plexus.config import CoordinatorConfig, load_coordinator_config
from plexus.errors import ConfigError

BASE = "listen: '0.0.0.0:8443'\nkit: k\n"


def _load(tmp_path, text):
    path = tmp_path / "coordinator.yaml"
    path.write_text(BASE + text)
    return path, load_coordinator_config(path)


def test_off_by_default(tmp_path):
    _, cfg = _load(tmp_path, "")
    assert cfg.metrics_listen is None and cfg.health_listen is None
    assert CoordinatorConfig(listen="h:1", kit="k").metrics_listen is None


def test_addresses_are_read(tmp_path):
    _, cfg = _load(tmp_path, "metrics_listen: '127.0.0.1:9100'\nhealth_listen: '[::]:0'\n")
    assert (cfg.metrics_listen, cfg.health_listen) == ("127.0.0.1:9100", "[::]:0")
    _, cfg = _load(tmp_path, "metrics_listen: null\n")
    assert cfg.metrics_listen is None


@pytest.mark.parametrize(("text", "problem"), [
    ("metrics_listen: '9100'\n", "3: metrics_listen: '9100' is not host:port"),
    ("metrics_listen: 9100\n", "3: metrics_listen: expected a string, got an integer (9100)"),
    ("health_listen: 'h:70000'\n", "3: health_listen: port 70000 in 'h:70000' is out of range"),
    ("health_listen: '::1:8081'\n", "3: health_listen: '::1:8081' has a bare IPv6 host"),
    ("health_listen: ''\n", "3: health_listen: is empty"),
    ("metrics_port: 9100\n", "3: metrics_port: unknown key"),
])
def test_errors_name_the_key_and_line(tmp_path, text, problem):
    path = tmp_path / "coordinator.yaml"
    path.write_text(BASE + text)
    with pytest.raises(ConfigError) as info:
        load_coordinator_config(path)
    assert str(info.value).startswith(f"{path}:{problem}"), str(info.value)
