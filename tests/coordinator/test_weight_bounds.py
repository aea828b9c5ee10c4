"""Bounds on one site's weight: rows reported at Join, sites.max_weight_share, its part of the fixed-point range."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, strategies as st

from coordinator.aggregate import WeightedSum
from coordinator.drivers.sync import RoundState, weight_caps
from plexus.config import parse_round_config
from plexus.errors import ConfigError, IntegrityError
from plexus.wire import encode


def test_a_site_is_capped_at_its_share_of_what_the_others_reported():
    # 0.75 of the total: at most 3x the other sites' rows together; honest sites below that keep their rows
    assert weight_caps({"a": 100, "b": 100, "liar": 2 ** 40}, 0.75) == {"a": 100, "b": 100, "liar": 600}
    assert weight_caps({"a": 199, "b": 194}, 0.75) == {"a": 199, "b": 194}
    assert weight_caps({"big": 1000, "small": 100}, 0.5) == {"big": 100, "small": 100}


def test_no_cap_alone_or_at_share_one_and_every_cap_is_at_least_one():
    assert weight_caps({"only": 5000}, 0.5) == {"only": 5000}
    assert weight_caps({"a": 10 ** 9, "b": 1}, 1.0) == {"a": 10 ** 9, "b": 1}
    assert weight_caps({"a": 100, "silent": 0}, 0.75) == {"a": 1, "silent": 1}


@given(st.dictionaries(st.sampled_from("abcdefgh"), st.integers(1, 10 ** 6), min_size=2),
       st.floats(0.5, 0.99))
def test_a_site_at_its_cap_holds_at_most_max_share_when_the_others_weigh_in_fully(rows, share):
    caps = weight_caps(rows, share)
    for site, cap in caps.items():
        others = sum(rows.values()) - rows[site]
        assert cap <= rows[site]
        assert cap / (cap + others) <= share + 1e-12 or cap == 1


def test_num_samples_is_refused_beyond_the_rows_reported_at_join_and_clipped_to_the_cap():
    rs = RoundState(round=1, kind="train", model_round=0, participants=["a", "b", "c"], deadline=0.0, total=None,
                    rows={"a": 100, "b": 100, "c": 10 ** 6}, caps={"a": 100, "b": 100, "c": 600})
    assert rs.weight("a", 100) == 100 and rs.weight("a", 7) == 7
    assert rs.weight("c", 10 ** 6) == 600
    with pytest.raises(IntegrityError, match="exceeds the 100 training rows this site reported"):
        rs.weight("b", 2 ** 31 - 1)
    with pytest.raises(IntegrityError, match="reported no training rows"):
        rs.weight("d", 1)


def test_each_update_holds_only_its_sites_part_of_the_fixed_point_range():
    state = {"w": np.full(8, 0.25, np.float32)}
    layout, blob = encode(state)
    total = WeightedSum(layout, sites=4)
    limit = 2.0 ** 30 / 4   # Σ n·|x| < 2**30, shared by 4 sites
    with pytest.raises(IntegrityError, match="one site's part of the fixed-point range"):
        total.fold([blob], int(limit / 0.25) + 1, 0.25, nbytes=len(blob))
    for _ in range(4):   # every site can use its whole part, together still exact
        total.fold([blob], int(limit / 0.25) - 1, 0.25, nbytes=len(blob))
    assert total.mean()["w"].tolist() == [0.25] * 8
    total.reset(sites=1)
    total.fold([blob], int(limit / 0.25) + 1, 0.25, nbytes=len(blob))   # alone, it may use more


def test_max_weight_share_is_validated_with_its_line():
    text = "name: j\nmodel: {name: logistic}\ndata: {dataset: d}\nrounds: 1\nsites:\n  min: 2\n  max_weight_share: 0\n"
    with pytest.raises(ConfigError, match=r"^job.yaml:7: sites.max_weight_share: 0.0 is out of range"):
        parse_round_config(text, source="job.yaml")
    assert parse_round_config(text.replace(": 0\n", ": 1\n"), source="job.yaml").sites.max_weight_share == 1.0
    assert parse_round_config(text.replace("  max_weight_share: 0\n", ""), source="j").sites.max_weight_share == 0.75
