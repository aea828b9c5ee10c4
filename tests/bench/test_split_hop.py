"""bench/split_hop.py: each batch through the compute worker and through the same server part in process, and the
hop as the difference of what each costs beyond its compute (a short run: the figures are the bench's)."""

from __future__ import annotations

import math

import pytest

from bench.split_hop import CASES, run_case


@pytest.mark.parametrize("case", [CASES[0], CASES[1]], ids=["vanilla", "u-shaped"])
def test_a_short_run_measures_both_paths_and_their_difference(case):
    name, args, variant, cuts, row_in, classes, _ = case
    row = run_case(name, args, variant, cuts, row_in, classes, 8, batches=6, warmup=2)
    assert row["variant"] == variant and row["batches"] == 6 and row["transport"] == "shared memory"
    assert row["compute_ms"] > 0 and row["in_process_compute_ms"] > 0 and row["in_process_rest_ms"] > 0
    assert math.isclose(row["hop_share"], row["hop_ms"] / row["compute_ms"])
    assert row["hop_p90_ms"] >= row["hop_ms"]
    assert row["activation_bytes"] == 8 * 16 * 14 * 14 * 4
