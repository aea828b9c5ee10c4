"""Coordinator tests that need a live federation borrow the integration fixtures."""

from integration.conftest import federation, pki_root  # noqa: F401  (pytest fixtures)
