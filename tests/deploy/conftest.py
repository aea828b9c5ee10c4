"""Deployment linters, installed once per machine by deploy/tools/install.sh in their own venvs."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
TOOLS = ("hadolint", "kubernetes-validate", "docker-compose")


def _ready(directory: Path) -> bool:
    return all(os.access(directory / "bin" / tool, os.X_OK) for tool in TOOLS)


@pytest.fixture(scope="session")
def tools(tmp_path_factory) -> Path:
    """DIR/bin with the linters: $PLEXUS_DEPLOY_TOOLS or ~/.cache/plexus-deploy-tools, else installed now."""
    for candidate in (os.environ.get("PLEXUS_DEPLOY_TOOLS"), Path.home() / ".cache" / "plexus-deploy-tools"):
        if candidate and _ready(Path(candidate)):
            return Path(candidate)
    directory = tmp_path_factory.mktemp("deploy-tools")
    result = subprocess.run(["bash", str(DEPLOY / "tools" / "install.sh"), str(directory)],
                            capture_output=True, text=True, timeout=600, stdin=subprocess.DEVNULL)
    if result.returncode != 0 or not _ready(directory):
        pytest.skip(f"deploy/tools/install.sh could not install the linters here:\n{result.stderr[-2000:]}")
    return directory


@pytest.fixture(scope="session")
def kubectl() -> str:
    path = shutil.which("kubectl")
    if path is None:
        pytest.skip("kubectl is not installed (deploy/tools/install.sh installs Debian's kubernetes-client)")
    version = subprocess.run([path, "version", "--client"], capture_output=True, text=True).stdout
    if "Kustomize Version: v" not in version or version.split("Kustomize Version: v")[1][:1] in "0123":
        pytest.skip(f"kubectl's built-in kustomize is older than v4 (`labels:` needs it):\n{version}")
    return path
