"""`plexus job plot` drawing: panels chosen from the metrics present, a real non-blank PNG."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from plexus.errors import PlexusError
from plexus.plot import plot_metrics, weighted_by_round


def _rows(with_epsilon: bool) -> list[tuple]:
    rows = []
    for r in range(6):
        for i, site in enumerate(("a", "b", "c")):
            rows += [(r, site, "eval", "accuracy", 0.5 + 0.07 * r - 0.02 * i), (r, site, "eval", "auc", 0.6 + 0.05 * r),
                     (r, site, "eval", "loss", 0.7 - 0.08 * r), (r, site, "eval", "num_samples", 10.0 * (i + 1))]
            if r:
                rows += [(r, site, "train", "train_loss", 0.7 - 0.09 * r), (r, site, "train", "num_samples", 50.0)]
            if with_epsilon and r:
                rows.append((r, site, "train", "epsilon", 0.4 * r))
    return rows


def non_blank(path) -> np.ndarray:
    image = np.asarray(Image.open(path).convert("RGB"))
    assert image.std() > 5, "the image is blank"
    assert (image.min(axis=2) < 128).mean() > 0.005, "almost nothing is drawn"
    return image


def test_plot_draws_global_loss_and_per_site_panels(tmp_path):
    path = tmp_path / "m.png"
    panels = plot_metrics(_rows(False), path, title="heart")
    assert panels == ["global model (held-out rows, all sites)", "loss", "per-site held-out accuracy"]
    image = non_blank(path)
    assert image.shape[1] >= 1200 and image.shape[0] >= 800


def test_epsilon_panel_only_when_epsilon_is_recorded(tmp_path):
    panels = plot_metrics(_rows(True), tmp_path / "dp.png")
    assert panels[-1] == "privacy budget ε"
    non_blank(tmp_path / "dp.png")


def test_global_curve_weights_sites_by_their_rows():
    rows = [(1, "a", "eval", "accuracy", 1.0), (1, "a", "eval", "num_samples", 30.0),
            (1, "b", "eval", "accuracy", 0.0), (1, "b", "eval", "num_samples", 10.0)]
    assert weighted_by_round(rows, "eval", "accuracy") == {1: pytest.approx(0.75)}


def test_no_metrics_is_a_clear_error(tmp_path):
    with pytest.raises(PlexusError, match="no metrics yet"):
        plot_metrics([], tmp_path / "x.png")
    assert not (tmp_path / "x.png").exists()
