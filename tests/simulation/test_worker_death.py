"""A worker that dies mid-run ends the simulation with the reason and its log, instead of a hang."""

from __future__ import annotations

import pytest

from simulation.pool import ProcessPool
from simulation.simulator import SimulationError, Simulator

JOB = """\
name: dies
model: {name: logistic, args: {in_features: 13, num_classes: 2}}
data: {dataset: heart-disease}
rounds: 2
sites: {min: 2, deadline_s: 60}
seed: 1
"""


def test_a_worker_that_dies_ends_the_simulation_naming_it(tmp_path, heart_sites):
    simulator = Simulator([JOB], heart_sites, tmp_path / "state", workers=1, pool=ProcessPool,
                          agent="dying_agent:DyingAgent")
    with pytest.raises(SimulationError, match=r"simulation worker 0 \(PID \d+\) failed: it closed its output, exit "
                                              r"status 3; its log is .*worker-0\.log"):
        simulator.run()
