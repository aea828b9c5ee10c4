"""`plexus job plot` against a live coordinator, after a real job."""

from __future__ import annotations

import numpy as np
from PIL import Image

from plexus.cli import main as cli

from integration.harness import heart_job


def test_plot_of_a_real_job(federation, tmp_path, capsys):
    for name in "abc":
        federation.start_site(name)
    federation.wait_online("a", "b", "c")
    job_id = federation.admin().submit(heart_job(rounds=4, min=3)).job_id
    assert federation.wait_job(job_id) == "completed"
    out = tmp_path / "plot.png"
    args = ["--kit", str(federation.root / "admins" / "viewer"), "--coordinator", federation.address]
    assert cli(["job", "plot", job_id, "-o", str(out), *args]) == 0
    assert f"to {out}" in capsys.readouterr().out
    image = Image.open(out)
    assert image.format == "PNG" and image.size[0] >= 1200 and image.size[1] >= 800
    gray = np.asarray(image.convert("L"))
    assert len(np.unique(gray)) > 20 and (gray < 128).mean() > 0.005   # lines and text, not a blank canvas
