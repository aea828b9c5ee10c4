"""The benchmarks are modules of the `bench` package: run as `python -m bench.NAME` from the repository root,
with no sys.path edits and only the product's public names."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BENCH = sorted((REPO / "bench").rglob("*.py"))
PRODUCT = ("plexus", "coordinator", "site_agent")


def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), filename=str(path))


@pytest.mark.parametrize("path", BENCH, ids=lambda p: str(p.relative_to(REPO)))
def test_no_bench_module_edits_sys_path(path):
    edits = [node.lineno for node in ast.walk(_tree(path))
             if isinstance(node, ast.Attribute) and node.attr == "path"
             and isinstance(node.value, ast.Name) and node.value.id == "sys"]
    assert edits == [], f"{path.name} touches sys.path at line(s) {edits}; import through the bench package instead"


@pytest.mark.parametrize("path", BENCH, ids=lambda p: str(p.relative_to(REPO)))
def test_bench_imports_only_public_names_of_the_product_and_its_siblings_through_the_package(path):
    siblings = {p.stem for p in BENCH}
    wrong = []
    for node in ast.walk(_tree(path)):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in PRODUCT:
            wrong += [f"line {node.lineno}: private {node.module}.{a.name}" for a in node.names
                      if a.name.startswith("_")]
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
            [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module else []
        wrong += [f"line {node.lineno}: {name} (write bench.{name})" for name in names if name in siblings]
    assert wrong == []


@pytest.mark.parametrize("module", ["bench.run", "bench.plexus_site"])
def test_a_bench_entry_point_starts_as_a_module_from_the_repository_root(module):
    """bench.run spawns itself and bench.plexus_site this way (cwd the repository root)."""
    done = subprocess.run([sys.executable, "-m", module, "--help"], cwd=REPO, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert "usage:" in done.stdout
