"""Behaviour of plexus.secagg: Shamir sharing, fixed point, and whole rounds with dropouts and a lying coordinator."""

import dataclasses
import math
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from hypothesis.extra import numpy as hnp

from plexus import crypto, errors, identity, pki, secagg

JOB, ROUND = "job-1", 3
NAMES = ["alder", "birch", "cedar", "daisy", "elm", "fir"]
CHI2_LIMIT = 400  # 255 degrees of freedom: mean 255, sd 22.6


@pytest.fixture(scope="module")
def fed(tmp_path_factory):
    """One federation with six sites and a coordinator, plus a site of the same name from another CA."""
    base = tmp_path_factory.mktemp("secagg")
    pki.init_federation(base / "fed", "Secagg Fed")
    pki.init_federation(base / "other", "Other Fed")
    kits = {name: identity.load_kit(pki.add_site(base / "fed", name)) for name in NAMES}
    return SimpleNamespace(
        kits=kits,
        ca_pem=kits["alder"].ca_pem,
        coordinator=identity.load_kit(base / "fed" / "coordinator"),
        impostor=identity.load_kit(pki.add_site(base / "other", "birch")),
    )


def chi_square_bytes(data: bytes) -> float:
    counts = np.bincount(np.frombuffer(data, dtype=np.uint8), minlength=256)
    expected = len(data) / 256
    return float(((counts - expected) ** 2 / expected).sum())


class Round:
    """Drives one round in memory, standing in for the coordinator's relaying."""

    def __init__(self, fed, names, samples=None, threshold=None):
        self.fed, self.names = fed, sorted(names)
        self.samples = samples or {name: 10 * (i + 1) for i, name in enumerate(self.names)}
        self.total = sum(self.samples.values())
        self.t = threshold if threshold is not None else secagg.default_threshold(len(self.names))
        self.sessions = {name: secagg.SiteSession(JOB, ROUND, name, min_cohort=2) for name in self.names}
        self.adverts = [
            self.sessions[n].advertise(self.samples[n], fed.kits[n].key_pem, fed.kits[n].cert_pem) for n in self.names
        ]

    def share(self, skip=()):
        self.outbox = {
            n: self.sessions[n].share(self.adverts, threshold=self.t, total_weight=self.total, ca_pem=self.fed.ca_pem)
            for n in self.names
            if n not in skip
        }
        self.u2 = sorted(self.outbox)
        for v in self.u2:
            self.sessions[v].receive_shares({u: self.outbox[u][v] for u in self.u2 if u != v})

    def mask(self, deltas, *, clip, skip=(), chunk=7, field_bits=32, seed=0):
        """Each site in U2 not skipped masks its update in a `field_bits`-bit field (8 and 16: the grid sized
        for |U1|, rounding from a seeded generator per site); `expected` is the plain sum of what they quantised."""
        self.clip, self.bits = clip, secagg.frac_bits(clip)
        self.field = (secagg.Field.fixed(clip, self.bits) if field_bits == 32
                      else secagg.Field.grid(field_bits, clip, len(self.names)))
        rng = {u: (lambda u=u: np.random.default_rng([seed, self.names.index(u)])) for u in self.names}
        self.ys = {}
        for u in self.u2:
            if u not in skip:
                pieces = [deltas[u][i : i + chunk] for i in range(0, len(deltas[u]), chunk)]
                self.ys[u] = np.concatenate(list(self.sessions[u].mask(pieces, field=self.field, rng=rng[u]())))
        self.u3 = sorted(self.ys)
        self.masked_sum = np.zeros(len(next(iter(deltas.values()))), dtype=self.field.dtype)
        for y in self.ys.values():
            self.masked_sum += y
        self.expected = np.zeros_like(self.masked_sum)
        for u in self.u3:
            self.expected += self.field.quantize(deltas[u], self.samples[u] / self.total, rng[u]())

    def reveals(self, skip=()):
        return {u: self.sessions[u].unmask(self.u3) for u in self.u3 if u not in skip}

    def server(self):
        return secagg.ServerSession(JOB, ROUND, self.adverts, self.t)


def random_deltas(names, dim, seed=0, scale=1.0):
    rng = np.random.default_rng(seed)  # test data, not a secret
    return {name: rng.normal(0, scale, dim) for name in names}


# --- Shamir ----------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_shamir_any_t_shares_rebuild_and_t_minus_1_do_not(data):
    n = data.draw(st.integers(1, 8), label="n")
    t = data.draw(st.integers(1, n), label="t")
    secret = data.draw(st.integers(0, secagg.PRIME - 1), label="secret")
    shares = secagg.shamir_split(secret, n, t)
    assert [x for x, _ in shares] == list(range(1, n + 1))
    order = data.draw(st.permutations(shares), label="order")
    k = data.draw(st.integers(t, n), label="k")
    assert secagg.shamir_combine(list(order[:k]), t) == secret
    with pytest.raises(errors.IntegrityError, match="needed"):
        secagg.shamir_combine(list(order[: t - 1]), t)


def test_shamir_combine_catches_altered_and_duplicate_shares():
    shares = secagg.shamir_split(42, 5, 3)
    altered = [*shares[:4], (shares[4][0], (shares[4][1] + 1) % secagg.PRIME)]
    with pytest.raises(errors.IntegrityError, match="disagrees"):
        secagg.shamir_combine(altered, 3)
    with pytest.raises(errors.IntegrityError, match="two different shares"):
        secagg.shamir_combine([*shares[:3], (shares[0][0], shares[0][1] ^ 1)], 3)
    assert secagg.shamir_combine([*shares[:3], shares[0]], 3) == 42  # an exact repeat is harmless
    with pytest.raises(errors.IntegrityError, match="x outside"):
        secagg.shamir_combine([(0, 42), *shares[:2]], 3)
    with pytest.raises(ValueError):
        secagg.shamir_split(42, 3, 4)
    with pytest.raises(ValueError):
        secagg.shamir_split(secagg.PRIME, 3, 2)


def test_default_threshold_is_a_majority():
    assert [secagg.default_threshold(n) for n in range(1, 8)] == [1, 2, 2, 3, 3, 4, 4]


# --- fixed point -----------------------------------------------------------------


@given(st.floats(1e-30, 1e30))
def test_frac_bits_fills_but_never_exceeds_2_pow_30(clip):
    bits = secagg.frac_bits(clip)
    assert math.ldexp(clip, bits) <= 2**30 < math.ldexp(clip, bits + 1)


@pytest.mark.parametrize("clip", [0.0, -1.0, math.nan, math.inf])
def test_frac_bits_refuses_non_positive_clips(clip):
    with pytest.raises(ValueError):
        secagg.frac_bits(clip)


def test_quantize_is_twos_complement_and_round_trips():
    bits = secagg.frac_bits(1.0)
    assert bits == 30
    q = secagg.quantize(np.array([-1.0, 0.5, 2.0, -7.0]), 1.0, 1.0, bits)
    assert q.dtype == np.uint32
    assert q.tolist() == [2**32 - 2**30, 2**29, 2**30, 2**32 - 2**30]  # clipped to ±1
    np.testing.assert_array_equal(secagg.dequantize(q, bits), [-1.0, 0.5, 1.0, -1.0])


@pytest.mark.parametrize("sites", [1, 3, 17])
@pytest.mark.parametrize("clip", [0.01, 1.0, 3.7, 1000.0])
def test_quantised_weighted_sum_is_within_rounding_error(sites, clip):
    rng = np.random.default_rng(sites)
    samples = rng.integers(1, 1000, sites)
    weights = samples / samples.sum()
    deltas = rng.normal(0, clip, (sites, 2000))
    bits = secagg.frac_bits(clip)
    total = np.zeros(2000, dtype=np.uint32)
    for w, d in zip(weights, deltas):
        total += secagg.quantize(d, float(w), clip, bits)
    exact = (weights[:, None] * np.clip(deltas, -clip, clip)).sum(axis=0)
    assert np.abs(secagg.dequantize(total, bits) - exact).max() <= sites * 2.0**-bits


@pytest.mark.parametrize("sites", [1, 2, 5, 1000])
@pytest.mark.parametrize("clip", [1.0, 0.3, 5.0])
@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_sums_at_the_clip_bound_do_not_overflow(sites, clip, sign):
    bits = secagg.frac_bits(clip)
    samples = np.arange(1, sites + 1)
    total = np.zeros(3, dtype=np.uint32)
    for n in samples:
        total += secagg.quantize(np.full(3, sign * 10 * clip), float(n / samples.sum()), clip, bits)
    np.testing.assert_allclose(secagg.dequantize(total, bits), sign * clip, atol=sites * 2.0**-bits)


def test_quantize_refuses_bad_input():
    bits = secagg.frac_bits(1.0)
    with pytest.raises(ValueError, match="wrap"):
        secagg.quantize(np.zeros(2), 1.0, 1.0, bits + 1)
    for weight in (0.0, 1.5, -0.1):
        with pytest.raises(ValueError, match="weight"):
            secagg.quantize(np.zeros(2), weight, 1.0, bits)
    with pytest.raises(errors.IntegrityError, match="NaN"):
        secagg.quantize(np.array([0.0, np.nan]), 1.0, 1.0, bits)
    with pytest.raises(TypeError):
        secagg.dequantize(np.zeros(2, dtype=np.int64), bits)


def test_advert_message_is_unambiguous():
    k1, k2 = bytes(32), bytes([1]) * 32
    message = secagg.advert_message("ab", 1, "c", k1, k2, 5, k1)
    assert message.startswith(b"plexus/v1/secagg-advert")
    assert message != secagg.advert_message("a", 1, "bc", k1, k2, 5, k1)
    assert message != secagg.advert_message("ab", 1, "c", k2, k1, 5, k1)
    assert message != secagg.advert_message("ab", 2, "c", k1, k2, 5, k1)


# --- whole rounds ----------------------------------------------------------------


@settings(max_examples=15, deadline=None)
@given(data=st.data())
def test_masks_cancel_without_dropouts(fed, data):
    n = data.draw(st.integers(2, 6), label="sites")
    dim = data.draw(st.integers(1, 300), label="dim")
    names = NAMES[:n]
    samples = {name: data.draw(st.integers(1, 10_000), label=f"n_{name}") for name in names}
    clip = data.draw(st.sampled_from([0.05, 1.0, 3.0]), label="clip")
    elements = st.floats(-4 * clip, 4 * clip, allow_nan=False)
    deltas = {name: data.draw(hnp.arrays(np.float64, dim, elements=elements), label=f"delta_{name}") for name in names}
    rnd = Round(fed, names, samples)
    rnd.share()
    rnd.mask(deltas, clip=clip, chunk=data.draw(st.integers(1, dim), label="site chunk"))
    reveals = rnd.reveals()
    result = rnd.server().unmask(rnd.masked_sum, rnd.u2, rnd.u3, reveals, chunk=data.draw(st.integers(1, dim + 3)))

    np.testing.assert_array_equal(result, rnd.expected)
    exact = sum(samples[u] / rnd.total * np.clip(deltas[u], -clip, clip) for u in names)
    assert np.abs(secagg.dequantize(result, rnd.bits) - exact).max() <= n * 2.0**-rnd.bits


def test_masks_cancel_with_a_dropout_before_and_after_masking(fed):
    # t = 3 of 5. birch shares but sends no input (U2 \ U3); elm sends its input but never answers unmask.
    rnd = Round(fed, NAMES[:5], threshold=3)
    rnd.share()
    rnd.mask(random_deltas(rnd.names, 257), clip=1.0, skip={"birch"}, chunk=50)
    assert rnd.u3 == ["alder", "cedar", "daisy", "elm"]
    reveals = rnd.reveals(skip={"elm"})
    assert reveals["alder"]["birch"][0] == "s" and reveals["alder"]["elm"][0] == "b"
    result = rnd.server().unmask(rnd.masked_sum, rnd.u2, rnd.u3, reveals, chunk=64)
    np.testing.assert_array_equal(result, rnd.expected)


def test_masks_cancel_when_a_site_never_shares(fed):
    # t = 4 of 6: fir drops before sharing (outside U2), birch before masking; all of U3 answer.
    rnd = Round(fed, NAMES, threshold=4)
    rnd.share(skip={"fir"})
    assert rnd.u2 == NAMES[:5]
    rnd.mask(random_deltas(rnd.names, 100, seed=1), clip=2.0, skip={"birch"})
    result = rnd.server().unmask(rnd.masked_sum, rnd.u2, rnd.u3, rnd.reveals())
    np.testing.assert_array_equal(result, rnd.expected)


@pytest.mark.parametrize("field_bits", [8, 16, 32])
def test_masks_cancel_in_each_field(fed, field_bits):
    rnd = Round(fed, NAMES[:4])
    rnd.share()
    deltas = random_deltas(rnd.names, 300, seed=5)
    rnd.mask(deltas, clip=1.0, chunk=37, field_bits=field_bits, seed=9)
    assert rnd.masked_sum.dtype == {8: np.uint8, 16: np.uint16, 32: np.uint32}[field_bits]
    assert not np.array_equal(rnd.masked_sum, rnd.expected)
    for y in rnd.ys.values():   # a masked input looks uniform in its field, like the 32-bit ones
        assert chi_square_bytes(y.tobytes()) < CHI2_LIMIT * 2 and y.dtype == rnd.field.dtype
    result = rnd.server().unmask(rnd.masked_sum, rnd.u2, rnd.u3, rnd.reveals(), chunk=64)
    np.testing.assert_array_equal(result, rnd.expected)
    exact = sum(rnd.samples[u] / rnd.total * np.clip(deltas[u], -1.0, 1.0) for u in rnd.names)
    step = 2.0 ** -rnd.bits if field_bits == 32 else 1.0 / rnd.field.levels
    assert np.abs(rnd.field.dequantize(result) - exact).max() <= len(rnd.names) * step


@pytest.mark.parametrize("field_bits", [8, 16, 32])
def test_a_dropouts_masks_are_removed_in_each_field(fed, field_bits):
    # t = 3 of 5: birch shares but sends no input, so its pairwise masks with U3 must be removed from its key
    rnd = Round(fed, NAMES[:5], threshold=3)
    rnd.share()
    rnd.mask(random_deltas(rnd.names, 257, seed=2), clip=0.5, skip={"birch"}, chunk=50, field_bits=field_bits)
    reveals = rnd.reveals(skip={"elm"})
    assert reveals["alder"]["birch"][0] == "s"
    result = rnd.server().unmask(rnd.masked_sum, rnd.u2, rnd.u3, reveals, chunk=64)
    np.testing.assert_array_equal(result, rnd.expected)


def test_a_site_refuses_to_mask_in_a_field_too_small_for_its_cohort(fed):
    rnd = Round(fed, NAMES)
    rnd.share()
    with pytest.raises(errors.IntegrityError, match="cannot hold the sum of the 6 advertised sites"):
        rnd.sessions["alder"].mask([np.zeros(3)], field=secagg.Field.grid(8, 1.0, 3))
    assert rnd.sessions["alder"].advertised == 6


def test_too_many_dropouts_refuse(fed):
    rnd = Round(fed, NAMES[:5], threshold=3)
    rnd.share()
    rnd.mask(random_deltas(rnd.names, 10), clip=1.0, skip={"alder", "birch", "cedar"})
    assert rnd.u3 == ["daisy", "elm"]
    with pytest.raises(errors.IntegrityError, match="fewer than the threshold"):
        rnd.sessions["daisy"].unmask(rnd.u3)
    with pytest.raises(errors.IntegrityError, match="only 2 masked inputs"):
        rnd.server().unmask(rnd.masked_sum, rnd.u2, rnd.u3, {})

    rnd = Round(fed, NAMES[:5], threshold=3)
    rnd.share()
    rnd.mask(random_deltas(rnd.names, 10), clip=1.0, skip={"alder"})
    reveals = rnd.reveals(skip={"birch", "cedar"})
    before = rnd.masked_sum.copy()
    with pytest.raises(errors.IntegrityError, match="only 2 survivors answered"):
        rnd.server().unmask(rnd.masked_sum, rnd.u2, rnd.u3, reveals)
    np.testing.assert_array_equal(rnd.masked_sum, before)  # untouched on refusal

    rnd = Round(fed, NAMES[:5], threshold=3)
    outbox = {n: rnd.sessions[n].share(rnd.adverts, threshold=3, total_weight=rnd.total, ca_pem=fed.ca_pem)
              for n in ("alder", "birch")}
    with pytest.raises(errors.IntegrityError, match="cannot be met"):
        rnd.sessions["alder"].receive_shares({"birch": outbox["birch"]["alder"]})


def test_masked_inputs_look_uniform_and_hide_the_update(fed):
    rnd = Round(fed, NAMES[:3])
    rnd.share()
    dim = 1 << 18  # 1 MiB of uint32
    deltas = {name: np.full(dim, 0.25) for name in rnd.names}
    rnd.mask(deltas, clip=1.0, chunk=100_000)
    q = secagg.quantize(deltas["alder"], rnd.samples["alder"] / rnd.total, 1.0, rnd.bits)
    y = rnd.ys["alder"]
    assert chi_square_bytes(q.tobytes()) > 100 * CHI2_LIMIT
    assert chi_square_bytes(y.tobytes()) < CHI2_LIMIT
    assert np.count_nonzero(y == q) < 10


# --- a lying coordinator, a foreign site, a confused caller -----------------------


def _share(rnd, site, adverts=None, **overrides):
    kwargs = dict(threshold=rnd.t, total_weight=rnd.total, ca_pem=rnd.fed.ca_pem) | overrides
    return rnd.sessions[site].share(rnd.adverts if adverts is None else adverts, **kwargs)


def test_share_refuses_a_substituted_public_key(fed):
    rnd = Round(fed, NAMES[:4])
    _, coordinator_pk = crypto.x25519_keypair()
    swapped = dataclasses.replace(rnd.adverts[1], s_pk=coordinator_pk)
    with pytest.raises(errors.IntegrityError, match="birch"):
        _share(rnd, "alder", [rnd.adverts[0], swapped, *rnd.adverts[2:]])
    # Re-signing with the coordinator's own certificate does not help: it is not site "birch".
    message = secagg.advert_message(JOB, ROUND, "birch", swapped.c_pk, coordinator_pk, swapped.num_samples,
                                     swapped.b_commitment)
    resigned = dataclasses.replace(
        swapped, signature=crypto.sign(fed.coordinator.key_pem, message), cert_pem=fed.coordinator.cert_pem
    )
    with pytest.raises(errors.IntegrityError, match="coordinator"):
        _share(rnd, "alder", [rnd.adverts[0], resigned, *rnd.adverts[2:]])


def test_share_refuses_a_site_from_another_ca(fed):
    rnd = Round(fed, NAMES[:4])
    impostor = secagg.SiteSession(JOB, ROUND, "birch")
    foreign = impostor.advertise(rnd.samples["birch"], fed.impostor.key_pem, fed.impostor.cert_pem)
    with pytest.raises(errors.IntegrityError, match="not issued by this federation's CA"):
        _share(rnd, "alder", [rnd.adverts[0], foreign, *rnd.adverts[2:]])


def test_share_refuses_a_replayed_advert_from_another_round(fed):
    rnd = Round(fed, NAMES[:4])
    old = secagg.SiteSession(JOB, ROUND - 1, "birch")
    stale = old.advertise(rnd.samples["birch"], fed.kits["birch"].key_pem, fed.kits["birch"].cert_pem)
    with pytest.raises(errors.IntegrityError, match="birch"):
        _share(rnd, "alder", [rnd.adverts[0], stale, *rnd.adverts[2:]])


def test_share_refuses_a_lowered_threshold_and_wrong_weights(fed):
    rnd = Round(fed, NAMES[:5])
    with pytest.raises(errors.IntegrityError, match="below a majority"):
        _share(rnd, "alder", threshold=2)
    with pytest.raises(errors.IntegrityError, match="exceeds"):
        _share(rnd, "alder", threshold=6)
    with pytest.raises(errors.IntegrityError, match="total_weight"):
        _share(rnd, "alder", total_weight=rnd.total + 1)
    # A threshold above the minimum majority is fine.
    assert set(_share(rnd, "alder", threshold=5)) == set(NAMES[1:5])


def test_advertised_weights_stay_within_the_sessions_bound_on_both_sides(fed):
    kit = fed.kits["alder"]
    with pytest.raises(ValueError, match="between 1 and 2147483648"):
        secagg.SiteSession(JOB, ROUND, "alder").advertise(2**31 + 1, kit.key_pem, kit.cert_pem)
    # An asynchronous cohort's weight: s(τ)·n in 2**-16 quanta, up to 2**47; a synchronous peer refuses it.
    heavy = secagg.SiteSession(JOB, ROUND, "alder", max_weight=2**47).advertise(2**47, kit.key_pem, kit.cert_pem)
    rnd = Round(fed, NAMES[1:4])
    adverts = [heavy, *rnd.adverts]
    total = sum(a.num_samples for a in adverts)
    with pytest.raises(errors.IntegrityError, match="invalid sample count"):
        rnd.sessions["birch"].share(adverts, threshold=3, total_weight=total, ca_pem=fed.ca_pem)
    wide = secagg.SiteSession(JOB, ROUND, "birch", max_weight=2**47)
    wide.advertise(10, fed.kits["birch"].key_pem, fed.kits["birch"].cert_pem)
    with pytest.raises(ValueError, match="max_weight"):
        secagg.SiteSession(JOB, ROUND, "birch", max_weight=2**63)


def test_share_refuses_missing_altered_or_duplicated_adverts(fed):
    rnd = Round(fed, NAMES[:4])
    with pytest.raises(errors.IntegrityError, match="own advert"):
        _share(rnd, "alder", rnd.adverts[1:])
    with pytest.raises(errors.IntegrityError, match="own advert"):
        _share(rnd, "alder", [dataclasses.replace(rnd.adverts[0], num_samples=1), *rnd.adverts[1:]])
    with pytest.raises(errors.IntegrityError, match="twice"):
        _share(rnd, "alder", [*rnd.adverts, rnd.adverts[2]])
    with pytest.raises(errors.IntegrityError, match="majority"):  # dropping adverts shrinks n, not t's floor
        _share(rnd, "alder", rnd.adverts[:2], threshold=1)


def test_receive_shares_names_a_tampered_or_misdirected_sender(fed):
    rnd = Round(fed, NAMES[:3])
    outbox = {n: _share(rnd, n) for n in rnd.names}
    blob = bytearray(outbox["birch"]["alder"])
    blob[-1] ^= 1
    with pytest.raises(errors.IntegrityError, match="'birch'"):
        rnd.sessions["alder"].receive_shares({"birch": bytes(blob), "cedar": outbox["cedar"]["alder"]})
    with pytest.raises(errors.IntegrityError, match="'cedar'"):  # cedar's shares for birch, relayed to alder
        rnd.sessions["alder"].receive_shares({"birch": outbox["birch"]["alder"], "cedar": outbox["cedar"]["birch"]})
    with pytest.raises(errors.IntegrityError, match="not another participant"):
        rnd.sessions["alder"].receive_shares({"alder": outbox["birch"]["alder"]})


def test_site_unmask_refusals(fed):
    rnd = Round(fed, NAMES[:5], threshold=3)
    rnd.share(skip={"elm"})
    rnd.mask(random_deltas(rnd.names, 8), clip=1.0)
    alder = rnd.sessions["alder"]
    with pytest.raises(errors.IntegrityError, match="not in U2"):
        alder.unmask(["alder", "birch", "elm"])
    with pytest.raises(errors.IntegrityError, match="not among the survivors"):
        alder.unmask(["birch", "cedar", "daisy"])
    with pytest.raises(errors.IntegrityError, match="twice"):
        alder.unmask(["alder", "alder", "birch"])
    first = alder.unmask(["alder", "birch", "cedar", "daisy"])
    assert {kind for kind, _, _ in first.values()} == {"b"}
    assert alder.unmask(["daisy", "cedar", "birch", "alder"]) == first  # a retry with the same U3 is fine
    with pytest.raises(errors.IntegrityError, match="already answered"):
        alder.unmask(["alder", "birch", "cedar"])  # would reveal daisy's mask key after its self mask


def test_calls_out_of_order_refuse(fed):
    rnd = Round(fed, NAMES[:3])
    fresh = secagg.SiteSession(JOB, ROUND, "alder")
    with pytest.raises(errors.FailedPrecondition):
        fresh.share(rnd.adverts, threshold=2, total_weight=rnd.total, ca_pem=fed.ca_pem)
    with pytest.raises(errors.FailedPrecondition):
        rnd.sessions["alder"].mask([np.zeros(3)], field=secagg.Field.fixed(1.0, 30))
    rnd.share()
    with pytest.raises(errors.FailedPrecondition):
        rnd.sessions["alder"].unmask(rnd.names)
    rnd.mask(random_deltas(rnd.names, 3), clip=1.0)
    with pytest.raises(errors.FailedPrecondition, match="once"):
        rnd.sessions["alder"].mask([np.zeros(3)], field=secagg.Field.fixed(1.0, 30))


def test_server_names_a_responder_revealing_the_wrong_kind(fed):
    rnd = Round(fed, NAMES[:4])
    rnd.share()
    rnd.mask(random_deltas(rnd.names, 5), clip=1.0)
    reveals = rnd.reveals(skip=("cedar",))
    # cedar answers as if birch had dropped out: its share of birch's key secret, for a survivor
    reveals["cedar"] = rnd.sessions["cedar"].unmask([u for u in rnd.u3 if u != "birch"])
    assert reveals["cedar"]["birch"][0] == "s" and "birch" in rnd.u3
    with pytest.raises(errors.IntegrityError, match="responder 'cedar'.*'s'"):
        rnd.server().unmask(rnd.masked_sum, rnd.u2, rnd.u3, reveals)


def test_server_leaves_out_an_altered_share_and_names_who_sent_it(fed):
    rnd = Round(fed, NAMES, threshold=4)
    rnd.share()
    rnd.mask(random_deltas(rnd.names, 5), clip=1.0)
    reveals = rnd.reveals()  # 6 responders, t = 4
    kind, x, y = reveals["daisy"]["birch"]
    reveals["daisy"]["birch"] = (kind, x, (y + 1) % secagg.PRIME)
    server = rnd.server()
    np.testing.assert_array_equal(server.unmask(rnd.masked_sum.copy(), rnd.u2, rnd.u3, reveals), rnd.expected)
    assert list(server.rejected) == ["daisy"] and "self-mask seed of 'birch'" in server.rejected["daisy"]
    del reveals["elm"]  # 5 = t + 1 shares: the signed commitment still tells the honest four apart
    server = rnd.server()
    np.testing.assert_array_equal(server.unmask(rnd.masked_sum.copy(), rnd.u2, rnd.u3, reveals), rnd.expected)
    assert list(server.rejected) == ["daisy"]
    kind, x, y = reveals["daisy"]["birch"]
    reveals["daisy"]["birch"] = (kind, x + 1, y)
    with pytest.raises(errors.IntegrityError, match="responder 'daisy'.*wrong x"):
        rnd.server().unmask(rnd.masked_sum.copy(), rnd.u2, rnd.u3, reveals)


def _alter(reveals, responders, peer):
    for r in responders:
        kind, x, y = reveals[r][peer]
        reveals[r][peer] = (kind, x, (y + 7) % secagg.PRIME)


def test_liars_are_left_out_while_t_honest_shares_remain(fed):
    rnd = Round(fed, NAMES, threshold=4)
    rnd.share()
    rnd.mask(random_deltas(rnd.names, 9, seed=3), clip=1.0)
    reveals = rnd.reveals()
    _alter(reveals, ["birch", "daisy"], "alder")      # two of six: four honest shares of alder's seed, t = 4
    server = rnd.server()
    np.testing.assert_array_equal(server.unmask(rnd.masked_sum.copy(), rnd.u2, rnd.u3, reveals), rnd.expected)
    assert sorted(server.rejected) == ["birch", "daisy"]
    assert "self-mask seed of 'alder'" in server.rejected["birch"]

    rnd = Round(fed, NAMES[:5], threshold=3)
    rnd.share()
    rnd.mask(random_deltas(rnd.names, 9, seed=4), clip=1.0, skip={"birch"})   # birch shared, then dropped
    reveals = rnd.reveals()
    _alter(reveals, ["cedar"], "birch")               # its mask key: three honest shares of four, t = 3
    server = rnd.server()
    np.testing.assert_array_equal(server.unmask(rnd.masked_sum.copy(), rnd.u2, rnd.u3, reveals), rnd.expected)
    assert list(server.rejected) == ["cedar"] and "mask key of 'birch'" in server.rejected["cedar"]


def test_fewer_than_t_honest_shares_fail_and_leave_the_sum_untouched(fed):
    rnd = Round(fed, NAMES[:5], threshold=3)
    rnd.share()
    rnd.mask(random_deltas(rnd.names, 9, seed=4), clip=1.0)
    reveals = rnd.reveals()
    _alter(reveals, ["cedar", "daisy", "elm"], "birch")   # alder and birch alone: 2 honest shares, t = 3
    before = rnd.masked_sum.copy()
    with pytest.raises(errors.IntegrityError, match="self-mask seed of 'birch' does not match its signed commitment: "
                                                    "fewer than t = 3"):
        rnd.server().unmask(rnd.masked_sum, rnd.u2, rnd.u3, reveals)
    np.testing.assert_array_equal(rnd.masked_sum, before)


def test_server_detects_a_wrong_mask_key_from_exactly_t_shares(fed):
    rnd = Round(fed, NAMES[:5], threshold=3)
    rnd.share()
    rnd.mask(random_deltas(rnd.names, 5), clip=1.0, skip={"birch"})
    reveals = rnd.reveals(skip={"elm"})
    kind, x, y = reveals["alder"]["birch"]
    reveals["alder"]["birch"] = (kind, x, (y + 12345) % secagg.PRIME)
    with pytest.raises(errors.IntegrityError, match="mask key of dropped site 'birch'|not a 32-byte secret"):
        rnd.server().unmask(rnd.masked_sum, rnd.u2, rnd.u3, reveals)


def test_server_detects_an_altered_self_mask_share_from_exactly_t_shares(fed):
    rnd = Round(fed, NAMES[:5], threshold=3)
    rnd.share()
    rnd.mask(random_deltas(rnd.names, 5), clip=1.0)
    reveals = rnd.reveals(skip={"daisy", "elm"})  # exactly t = 3 responders: no spare share to compare
    kind, x, y = reveals["alder"]["birch"]
    assert kind == "b"
    reveals["alder"]["birch"] = (kind, x, (y + 1) % secagg.PRIME)
    before = rnd.masked_sum.copy()
    with pytest.raises(errors.IntegrityError, match="self-mask seed of 'birch' does not match its signed commitment"):
        rnd.server().unmask(rnd.masked_sum, rnd.u2, rnd.u3, reveals)
    assert np.array_equal(rnd.masked_sum, before)  # refused before anything was subtracted


def test_server_refuses_outsiders_and_inconsistent_sets(fed):
    rnd = Round(fed, NAMES[:5], threshold=3)
    rnd.share()
    rnd.mask(random_deltas(rnd.names, 5), clip=1.0, skip={"birch"})
    reveals = rnd.reveals()
    server = rnd.server()
    with pytest.raises(errors.IntegrityError, match="not survivors"):
        server.unmask(rnd.masked_sum, rnd.u2, rnd.u3, {**reveals, "birch": reveals["alder"]})
    with pytest.raises(errors.IntegrityError, match="not in U2"):
        server.unmask(rnd.masked_sum, ["alder", "cedar", "daisy"], rnd.u3, reveals)
    with pytest.raises(errors.IntegrityError, match="did not advertise"):
        server.unmask(rnd.masked_sum, [*rnd.u2, "zed"], rnd.u3, reveals)
    with pytest.raises(TypeError):
        server.unmask(rnd.masked_sum.astype(np.int64), rnd.u2, rnd.u3, reveals)
