"""The tree is the architecture: plexus/ is the kernel below coordinator/, site_agent/ and simulation/, never above
them."""

from __future__ import annotations

import ast
from importlib.metadata import entry_points
from pathlib import Path

import pytest

from plexus.cli import COMMANDS_GROUP, installed_commands, parser

REPO = Path(__file__).resolve().parents[2]
SERVICES = ("coordinator", "site_agent", "simulation")


def _upward_imports(path: Path) -> list[str]:
    """`line: module` for every import of a service package in the module at `path`."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        elif (isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) in
              ("import_module", "__import__") and node.args and isinstance(node.args[0], ast.Constant)):
            names = [str(node.args[0].value)]   # importlib.import_module("coordinator.x") is an import too
        else:
            continue
        found += [f"{node.lineno}: {n}" for n in names if n.split(".")[0] in SERVICES]
    return found


def test_no_module_of_the_kernel_imports_a_service():
    modules = sorted(p for p in (REPO / "plexus").rglob("*.py") if "proto" not in p.relative_to(REPO).parts[1:2])
    assert len(modules) > 30   # the walk found the kernel
    upward = {str(p.relative_to(REPO)): hits for p in modules if (hits := _upward_imports(p))}
    assert upward == {}, "plexus/ must not import coordinator, site_agent or simulation (declare an entry point " \
                         f"instead): {upward}"


def test_the_upward_import_check_catches_each_form(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("import coordinator.server\nfrom site_agent.agent import SiteAgent\n"
                   "import importlib\nimportlib.import_module('site_agent.cli')\nfrom plexus import pki\n")
    assert _upward_imports(bad) == ["1: coordinator.server", "2: site_agent.agent", "4: site_agent.cli"]


def test_the_installed_command_groups_are_the_declared_ones():
    tomllib = pytest.importorskip("tomllib")   # Python 3.11+
    declared = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["entry-points"][COMMANDS_GROUP]
    installed = {ep.name: ep.value for ep in entry_points(group=COMMANDS_GROUP)}
    assert installed == declared, "the installed entry points are stale: run `pip install -e '.[dev]'` again"
    assert sorted(installed_commands()) == ["coordinator", "relay", "simulate", "site"]


@pytest.mark.parametrize("argv", [["coordinator", "run", "--config", "c.yaml"], ["site", "run", "--config", "s.yaml"],
                                  ["site", "check", "--config", "s.yaml"], ["site", "pin-model", "mlp"],
                                  ["site", "audit", "--config", "s.yaml"], ["simulate", "j.yaml", "--state", "d"]])
def test_the_service_groups_plug_into_the_one_parser(argv, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for name in ("c.yaml", "s.yaml"):
        (tmp_path / name).write_text("")
    args = parser().parse_args(argv)
    assert args.run.__module__ == {"coordinator": "coordinator.cli", "site": "site_agent.cli",
                                   "simulate": "simulation.cli"}[argv[0]]
