"""The coordinator's secure-round state machine: phases, quorum, and what it refuses from sites."""

from __future__ import annotations

import numpy as np
import pytest

from coordinator.secure_round import SecureRound, SecureRoundFailed
from plexus import crypto, identity, pki
from plexus.config import SecAggSpec, UplinkSpec
from plexus.errors import IntegrityError
from plexus.secagg import MAX_WEIGHT, NO_EXTRAS, Advert, SiteSession, advert_message, frac_bits, mask_plan
from plexus.wire import DTYPES, Layout

LAYOUT = Layout.of({"w": np.zeros((2, 3), np.float32), "b": np.zeros(2, np.float32)})


def _round(min_sites=2, threshold=None) -> SecureRound:
    return SecureRound("job", 1, LAYOUT, SecAggSpec(threshold=threshold), min_sites)


_KITS: dict = {}   # the module's site kits (the kits fixture fills it)


def _advert(site: str, n: int = 10, *, round_: int = 1) -> Advert:
    """Site `site`'s advert for round_ of "job", signed by its kit, with fresh keys; `n` as given, even out of range."""
    kit = _KITS[site]
    (_, c_pk), (_, s_pk) = crypto.x25519_keypair(), crypto.x25519_keypair()
    signature = crypto.sign(kit.key_pem, advert_message("job", round_, site, c_pk, s_pk, n, b"h" * 32))
    return Advert(site=site, c_pk=c_pk, s_pk=s_pk, num_samples=n, signature=signature, cert_pem=kit.cert_pem,
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
    cohort.on_advert("a", _advert("a", n=2**47, round_=12))
    with pytest.raises(IntegrityError, match="between 1 and 140737488355328"):
        cohort.on_advert("b", _advert("b", n=2**47 + 1, round_=12))


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


# --- compressed uplinks: the field and entries each codec masks -------------------------------------------


@pytest.mark.parametrize(("codec", "dtype", "shapes"), [
    ("int8", "U8", [(2,), (2, 3)]), ("fp16", "U16", [(2,), (2, 3)]), ("randk", "U32", [(1,), (3,)])])
def test_the_masked_layout_follows_the_uplink_codec(codec, dtype, shapes):
    uplink = UplinkSpec(codec=codec, fraction=0.5 if codec == "randk" else None)
    sr = SecureRound("job", 1, LAYOUT, SecAggSpec(), 3, uplink=uplink, seed=4)
    assert [(t.name, t.dtype, t.shape) for t in sr.masked_layout.tensors] == [
        ("b", dtype, shapes[0]), ("w", dtype, shapes[1])]
    assert sr.masked.acc.dtype == DTYPES[dtype]


def test_an_int8_round_advertised_by_more_sites_than_its_field_sums_fails_with_the_reason():
    sr = SecureRound("job", 1, LAYOUT, SecAggSpec(), 3, uplink=UplinkSpec(codec="int8"))
    sites = [f"s{i:03d}" for i in range(112)]
    for site in sites:
        sr.on_advert(site, _advert(site))
    with pytest.raises(SecureRoundFailed, match="112 sites advertised.*at most 111"):
        sr.advance(sites, sites)


@pytest.fixture(scope="module", autouse=True)
def kits(tmp_path_factory):
    root = tmp_path_factory.mktemp("pki") / "fed"
    pki.init_federation(root, "Round Fed")
    _KITS.update({name: identity.load_kit(pki.add_site(root, name)) for name in "abcd"})
    many = [f"s{i:03d}" for i in range(112)]   # an int8 round's too many
    _KITS.update(zip(many, map(identity.load_kit, pki.add_sites(root, {name: {} for name in many}, durable=False))))
    return {name: _KITS[name] for name in "abcd"}


def _run(kits, uplink, deltas, samples, *, drop="", clip=1.0, extras=NO_EXTRAS, max_weight=MAX_WEIGHT):
    """One secure round over real SiteSessions driven through a SecureRound; `drop` shares, then never masks."""
    sr = SecureRound("job", 2, LAYOUT, SecAggSpec(clip=clip), 3, uplink=uplink, seed=8, extras=extras,
                     max_weight=max_weight)
    sessions = {s: SiteSession("job", 2, s) for s in kits}
    for s, session in sessions.items():
        sr.on_advert(s, session.advertise(samples[s], kits[s].key_pem, kits[s].cert_pem))
    sr.advance(list(kits), list(kits))
    for s, session in sessions.items():
        p = sr.payload(s)
        sr.on_shares(s, session.share(p["adverts"], threshold=p["threshold"], total_weight=p["total_weight"],
                                      ca_pem=kits[s].ca_pem))
    sr.advance(list(kits), list(kits))
    plan = mask_plan(uplink, LAYOUT, seed=8, round_=2, extras=extras)     # as the site agent draws it
    survivors = [s for s in kits if s != drop]
    for s in survivors:
        p = sr.payload(s)
        sessions[s].receive_shares(p["shares_for_you"])
        field = plan.field(clip=p["clip"], frac_bits=p["frac_bits"], sites=sessions[s].advertised)
        masked = list(sessions[s].mask(plan.values(deltas[s]), field=field))
        sr.masked.fold([y.tobytes() for y in masked], nbytes=sum(y.nbytes for y in masked))
    sr.advance(survivors, list(kits))
    for s in survivors:
        sr.on_reveal(s, sessions[s].unmask(sr.payload(s)["u3"]))
    sr.advance(survivors, survivors)
    return sr, plan


@pytest.mark.parametrize("codec", ["int8", "fp16", "randk"])
def test_the_unmasked_mean_is_dequantised_and_randk_scattered_back(kits, codec):
    rng = np.random.default_rng(3)
    uplink = UplinkSpec(codec=codec, k=3 if codec == "randk" else None)
    deltas = {s: {t.name: rng.uniform(-0.8, 0.8, t.shape) for t in LAYOUT.tensors} for s in kits}
    samples = {"a": 10, "b": 20, "c": 30, "d": 40}
    sr, plan = _run(kits, uplink, deltas, samples, drop="d")
    mean, weight = sr.result()
    assert weight == 60
    step = 1.0 / plan.field(clip=1.0, frac_bits=0, sites=4).levels if codec != "randk" else 2.0 ** -sr.bits
    bound = 3 * step * 100 / 60           # each survivor's rounding, rescaled from W over U1 to W over U3
    for t, idx in zip(LAYOUT.tensors, plan.indices):
        expect = sum(samples[s] * deltas[s][t.name] for s in "abc") / 60
        if idx is not None:
            off = np.ones(t.numel, bool)
            off[idx] = False
            assert np.all(mean[t.name].reshape(-1)[off] == 0)      # zero off randk's shared indices
            expect = np.where(off.reshape(t.shape), 0.0, expect)
        assert mean[t.name].shape == t.shape
        assert np.abs(mean[t.name] - expect).max() <= bound, (t.name, np.abs(mean[t.name] - expect).max(), bound)


def test_update_extras_are_unmasked_as_the_survivors_mean_value(kits):
    """A summing rule's extras (weight 1 per site): the unmasked mean times |U3| is the survivors' plain sum."""
    rng = np.random.default_rng(5)
    extras = Layout.build([("exact/grad", "F64", (4,)), ("exact/rows", "F64", (1,))])
    deltas = {s: {"w": np.zeros((2, 3)), "b": np.zeros(2), "exact/grad": rng.uniform(-200, 200, 4),
                  "exact/rows": np.array([float(rng.integers(50, 300))])} for s in kits}
    clip = 512.0   # at least every site's largest |value| (rows up to 300): nothing is clipped
    sr, _ = _run(kits, None, deltas, dict.fromkeys(kits, 1), drop="d", clip=clip, extras=extras, max_weight=1)
    mean, weight = sr.result()
    assert weight == 3 and sorted(mean) == ["b", "exact/grad", "exact/rows", "w"]
    # each of |U1| = 4 sites rounds w·x (w = 1/4) to 2**-f; the mean is rescaled by |U1|/|U3|, the sum by |U3|
    bound = 4 * 3 * 0.5 * 2.0 ** -frac_bits(clip)
    for name in ("exact/grad", "exact/rows"):
        plain = sum(deltas[s][name] for s in "abc")
        assert np.abs(mean[name] * 3 - plain).max() <= bound, name
    assert round(float(mean["exact/rows"][0] * 3)) == sum(deltas[s]["exact/rows"][0] for s in "abc")
    assert not mean["w"].any() and not mean["b"].any()


def test_a_uniformly_weighted_round_refuses_an_advert_of_more_than_one():
    sr = SecureRound("job", 1, LAYOUT, SecAggSpec(), 3, max_weight=1)
    sr.on_advert("a", _advert("a", 1))
    with pytest.raises(IntegrityError, match="weighs every site's update 1"):
        sr.on_advert("b", _advert("b", 120))
