"""The coordinator's secure-round state machine: phases, quorum, and what it refuses from sites."""

from __future__ import annotations

import numpy as np
import pytest

from coordinator.secure_round import SecureRound, SecureRoundFailed
from plexus.config import SecAggSpec
from plexus.errors import IntegrityError
from plexus.secagg import Advert
from plexus.wire import Layout

LAYOUT = Layout.of({"w": np.zeros((2, 3), np.float32), "b": np.zeros(2, np.float32)})


def _round(min_sites=2, threshold=None) -> SecureRound:
    return SecureRound("job", 1, LAYOUT, SecAggSpec(threshold=threshold), min_sites)


def _advert(site: str, n: int = 10) -> Advert:
    return Advert(site=site, c_pk=b"c" * 32, s_pk=b"s" * 32, num_samples=n, signature=b"", cert_pem=b"",
                  b_commitment=b"h" * 32)


def test_masked_layout_mirrors_the_model_in_u32():
    sr = _round()
    assert [(t.name, t.dtype, t.shape) for t in sr.masked_layout.tensors] == [("b", "U32", (2,)), ("w", "U32", (2, 3))]
    assert sr.task_kind == "secagg_advertise"


def test_phases_advance_with_majority_threshold_and_weights():
    sr = _round()
    for site, n in (("a", 10), ("b", 20), ("c", 30)):
        sr.on_advert(site, _advert(site, n))
    assert sr.advance(["c", "a", "b"], ["a", "b", "c"]) == ["a", "b", "c"]
    assert (sr.phase, sr.threshold, sr.total_weight) == ("share", 2, 60)
    assert [a.site for a in sr.payload("a")["adverts"]] == ["a", "b", "c"]
    sr.on_shares("a", {"b": b"ab", "c": b"ac"})
    sr.on_shares("b", {"a": b"ba", "c": b"bc"})
    assert sr.advance(["a", "b"], ["a", "b", "c"]) == ["a", "b"]
    assert sr.payload("a")["shares_for_you"] == {"b": b"ba"}   # c's shares are void: c is not in U2
    assert sr.advance(["a", "b"], ["a", "b"]) == ["a", "b"]
    assert sr.phase == "unmask" and sr.payload("b")["u3"] == ["a", "b"]


@pytest.mark.parametrize("answered", [[], ["a"]])
def test_too_few_answers_fail_the_round_with_the_reason(answered):
    sr = _round(min_sites=2)
    for site in answered:
        sr.on_advert(site, _advert(site))
    with pytest.raises(SecureRoundFailed, match=rf"advertise phase: {len(answered)} of 3 sites answered"):
        sr.advance(answered, ["a", "b", "c"])


def test_a_configured_threshold_below_a_majority_is_raised_to_one():
    sr = _round(min_sites=1, threshold=1)
    for site in "abcd":
        sr.on_advert(site, _advert(site))
    sr.advance(list("abcd"), list("abcd"))
    assert sr.threshold == 3


def test_refusals_name_what_is_wrong():
    sr = _round()
    with pytest.raises(IntegrityError, match="caller's certificate is 'b'"):
        sr.on_advert("b", _advert("a"))
    with pytest.raises(IntegrityError, match="num_samples"):
        sr.on_advert("a", _advert("a", n=0))
    for site in "abc":
        sr.on_advert(site, _advert(site))
    sr.advance(list("abc"), list("abc"))
    with pytest.raises(IntegrityError, match="exactly the other sites of U1"):
        sr.on_shares("a", {"b": b"x"})
    with pytest.raises(IntegrityError, match="exceeds"):
        sr.on_shares("a", {"b": b"x" * 5000, "c": b"y"})
    for site in "abc":
        sr.on_shares(site, {p: b"z" for p in "abc" if p != site})
    sr.advance(list("abc"), list("abc"))
    sr.advance(["a", "b"], list("abc"))           # c dropped before masking
    with pytest.raises(IntegrityError, match="never reveals both"):
        sr.on_reveal("a", {"a": ("b", 1, 5), "b": ("b", 1, 5), "c": ("b", 1, 5)})
    with pytest.raises(IntegrityError, match="covers exactly U2"):
        sr.on_reveal("a", {"a": ("b", 1, 5), "b": ("b", 1, 5)})
    sr.on_reveal("a", {"a": ("b", 1, 5), "b": ("b", 1, 5), "c": ("s", 1, 5)})
    assert set(sr.reveals) == {"a"}


def test_an_asynchronous_cohorts_round_takes_weights_up_to_its_own_bound():
    sr = _round()
    with pytest.raises(IntegrityError, match="between 1 and 2147483648"):
        sr.on_advert("a", _advert("a", n=2**31 + 1))
    cohort = SecureRound("job", 12, LAYOUT, SecAggSpec(), 3, max_weight=2**47)
    cohort.on_advert("a", _advert("a", n=2**47))
    with pytest.raises(IntegrityError, match="between 1 and 140737488355328"):
        cohort.on_advert("b", _advert("b", n=2**47 + 1))


def test_a_reveal_at_the_wrong_x_or_outside_the_field_is_refused_on_arrival():
    from plexus.secagg import PRIME

    sr = _round(min_sites=3)
    for site in "abc":
        sr.on_advert(site, _advert(site))
    sr.advance(list("abc"), list("abc"))
    for site in "abc":
        sr.on_shares(site, {p: b"z" for p in "abc" if p != site})
    sr.advance(list("abc"), list("abc"))
    sr.advance(list("abc"), list("abc"))
    with pytest.raises(IntegrityError, match="x = 2"):       # b is second in sorted U1
        sr.on_reveal("b", {"a": ("b", 1, 5), "b": ("b", 1, 5), "c": ("b", 1, 5)})
    with pytest.raises(IntegrityError, match="below the field prime"):
        sr.on_reveal("b", {"a": ("b", 2, PRIME), "b": ("b", 2, 5), "c": ("b", 2, 5)})
    sr.on_reveal("b", {"a": ("b", 2, 5), "b": ("b", 2, 5), "c": ("b", 2, 5)})
    assert set(sr.reveals) == {"b"}
