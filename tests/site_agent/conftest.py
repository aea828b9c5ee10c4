"""Fixtures shared by the site agent's tests."""

from __future__ import annotations

import pytest

from plexus import pki


@pytest.fixture(scope="module")
def kit(tmp_path_factory):
    """Site "a"'s kit from a federation CA made for the test module."""
    root = tmp_path_factory.mktemp("pki") / "federation"
    pki.init_federation(root, "site-test", hosts=["127.0.0.1"])
    return pki.add_site(root, "a")
