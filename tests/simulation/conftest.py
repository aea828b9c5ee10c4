"""Fixtures of the simulation tests."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from plexus.config import DatasetSpec, PolicySpec, SiteConfig


@pytest.fixture
def heart_sites(monkeypatch) -> dict[str, SiteConfig]:
    """Virtual sites cleveland and hungary on their heart-disease rows; simulation workers can import the agent
    classes of this folder (dying_agent, noisy_agent)."""
    here = str(Path(__file__).resolve().parent)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [here, os.environ.get("PYTHONPATH")])))
    return {h: SiteConfig(site=h, coordinator="unused.invalid:1", kit=Path("unused"),
                          datasets={"heart-disease": DatasetSpec(kind="heart-disease", hospital=h)},
                          policy=PolicySpec(allowed_models=("logistic",))) for h in ("cleveland", "hungary")}
