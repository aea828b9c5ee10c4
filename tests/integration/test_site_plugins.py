"""A model plug-in's code runs at a site only when the site's policy lists it and pins its source."""

from __future__ import annotations

import sys
import textwrap

import pytest

from plexus.config import PolicySpec
from plexus.models import plugin_source_sha256

from integration.harness import install_plugin, wait_until
from integration.rogue import rogue_federation, site_agents

MODULE = "plexus_marker_plugin"
SOURCE = textwrap.dedent('''\
    """A plug-in that leaves a mark when its module code runs."""
    from pathlib import Path

    from torch import nn

    Path(__file__).with_name("imported.marker").write_text("this module's code ran\\n")


    class Tiny(nn.Module):
        def __init__(self, in_features: int = 13, num_classes: int = 2):
            super().__init__()
            self.linear = nn.Linear(in_features, num_classes)

        def forward(self, x):
            return self.linear(x)
    ''')
JOB = """\
name: plugged
model: {name: marker, args: {in_features: 13, num_classes: 2}}
data: {dataset: heart-disease}
rounds: 1
train: {epochs: 1, batch_size: 32, optimizer: {name: sgd, lr: 0.1}}
"""


@pytest.fixture
def marker(tmp_path, monkeypatch):
    """A really installed plug-in: its module and a dist-info with a `plexus.models` entry point on sys.path."""
    lib = install_plugin(tmp_path / "lib", MODULE, SOURCE, {"marker": "Tiny"})
    monkeypatch.syspath_prepend(str(lib))
    monkeypatch.delitem(sys.modules, MODULE, raising=False)   # and dropped again after the test
    yield lib / "imported.marker"
    sys.modules.pop(MODULE, None)


@pytest.fixture
def rogue(tmp_path):
    with rogue_federation(tmp_path, "plugin-test") as coordinator:
        yield coordinator


@pytest.fixture
def site(rogue, tmp_path):
    with site_agents(rogue, tmp_path / "state") as start:
        def start_joined(policy: PolicySpec) -> None:
            start(policy)
            wait_until(lambda: rogue.joins, 60, "the site to join")

        yield start_joined


def test_an_unlisted_plugin_is_advertised_by_name_but_never_imported(marker, rogue, site):
    site(PolicySpec(allowed_models=("logistic",)))
    assert "marker" in rogue.joins[0].models
    got = rogue.ask("plugged-0123abcd", JOB)
    assert got.what == "RESULT_DECLINED" and "not in this site's policy.allowed_models" in got.reason, got
    assert rogue.ask("other-0123abcd", JOB.replace("name: marker", "name: logistic")).what == "update"
    assert not marker.exists(), "the plug-in's module code ran at the site"


@pytest.mark.parametrize("pin", [None, "0" * 64])
def test_a_listed_plugin_without_its_pin_is_never_imported(marker, rogue, site, pin):
    site(PolicySpec(allowed_models=("logistic", "marker"), plugin_sha256={} if pin is None else {"marker": pin}))
    got = rogue.ask("plugged-0123abcd", JOB)
    assert got.what == "RESULT_DECLINED", got
    assert ("is not pinned" if pin is None else "does not match this site's policy.plugin_sha256") in got.reason
    assert not marker.exists(), "the plug-in's module code ran at the site"


def test_a_listed_and_pinned_plugin_runs(marker, rogue, site):
    site(PolicySpec(allowed_models=("marker",), plugin_sha256={"marker": plugin_source_sha256("marker")}))
    assert not marker.exists()
    assert rogue.ask("plugged-0123abcd", JOB).what == "update"
    assert marker.exists()
