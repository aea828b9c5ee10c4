"""Split learning's core (plexus.split): the parts of a model give the unsplit model's gradients and steps, for
both variants; NoPeek's distance correlation; the schedules across sites."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from plexus.errors import ConfigError
from plexus.models import build_model
from plexus.split import (
    ServerStep,
    SiteOptions,
    SiteStep,
    distance_correlation,
    label_log_prior,
    message_bytes,
    num_classes,
    sequential_epoch,
    split,
    splitfed_epoch,
    synchronous_epoch,
    train_batch,
    turn_shares,
)

CASES = [("mlp", {"in_features": 13, "hidden": [32, 16]}, (64, 13), ["hidden1"], ["hidden1", "hidden2"]),
         ("cnn", {"width": 4}, (32, 1, 28, 28), ["block1"], ["block1", "features"])]


def batch(shape, seed=0, classes=2):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g), torch.randint(0, classes, (shape[0],), generator=g)


def sgd(lr):
    return lambda params: torch.optim.SGD(params, lr=lr)


@pytest.mark.parametrize("name,args,shape,vanilla,ushaped", CASES)
@pytest.mark.parametrize("variant", ["vanilla", "u-shaped"])
def test_one_batch_through_the_parts_gives_the_unsplit_gradients_and_step(name, args, shape, vanilla, ushaped,
                                                                           variant):
    model = build_model(name, args, seed=3)
    whole = copy.deepcopy(model)
    x, y = batch(shape, classes=2 if name == "mlp" else 10)
    loss = F.cross_entropy(whole(x), y)
    loss.backward()
    expected = {n: p.grad.clone() for n, p in whole.named_parameters()}
    parts = split(model, variant, vanilla if variant == "vanilla" else ushaped)
    site = SiteStep(parts, sgd(0.0)([p for m in parts.site_modules for p in m.parameters()]))
    server = ServerStep(parts, sgd(0.0)(parts.middle.parameters()))
    got_loss = train_batch(site, server, x, y)
    assert got_loss == pytest.approx(loss.item(), rel=1e-6)
    for n, p in model.named_parameters():
        assert torch.allclose(p.grad, expected[n], atol=1e-6, rtol=1e-5), n
    # and a real step: the same weights as one SGD step of the whole model
    model2, whole2 = build_model(name, args, seed=3), build_model(name, args, seed=3)
    parts2 = split(model2, variant, vanilla if variant == "vanilla" else ushaped)
    train_batch(SiteStep(parts2, sgd(0.1)([p for m in parts2.site_modules for p in m.parameters()])),
                ServerStep(parts2, sgd(0.1)(parts2.middle.parameters())), x, y)
    opt = sgd(0.1)(whole2.parameters())
    F.cross_entropy(whole2(x), y).backward()
    opt.step()
    for (n, a), (_, b) in zip(model2.named_parameters(), whole2.named_parameters()):
        assert torch.allclose(a, b, atol=1e-6), n


def test_the_u_shaped_server_never_sees_the_labels_or_the_loss():
    model = build_model("mlp", {"in_features": 13, "hidden": [32, 16]}, seed=0)
    parts = split(model, "u-shaped", ["hidden1", "hidden2"])
    server = ServerStep(parts, sgd(0.1)(parts.middle.parameters()))
    with pytest.raises(TypeError):
        server.forward(torch.zeros(4, 32), torch.zeros(4))   # it has nowhere to take labels
    sizes = message_bytes(parts, torch.zeros(8, 13))
    assert sizes == {"up": 8 * 32 * 4 + 8 * 16 * 4, "down": 8 * 32 * 4 + 8 * 16 * 4}   # no labels up
    assert message_bytes(split(model, "vanilla", ["hidden1"]), torch.zeros(8, 13)) == \
        {"up": 8 * 32 * 4 + 8 * 8, "down": 8 * 32 * 4}


def test_bad_splits_are_refused_with_the_model_s_cuts():
    model = build_model("cnn", {}, seed=0)
    with pytest.raises(ConfigError, match="block1, block2, features"):
        split(model, "vanilla", ["conv9"])
    with pytest.raises(ConfigError, match="takes 2 cut"):
        split(model, "u-shaped", ["block1"])
    with pytest.raises(ConfigError, match="in order"):
        split(model, "u-shaped", ["block2", "block1"])
    with pytest.raises(ConfigError, match="does not declare how it splits"):
        split(build_model("logistic", {"in_features": 3}, seed=0), "vanilla", ["x"])
    with pytest.raises(ConfigError, match="variant"):
        split(model, "sideways", ["block1"])


def test_distance_correlation_is_one_for_a_similarity_and_small_for_independent_rows():
    x, _ = batch((256, 5))
    assert float(distance_correlation(x, 3 * x + 1)) == pytest.approx(1.0, abs=1e-5)
    z, _ = batch((256, 5), seed=1)
    assert float(distance_correlation(x, z)) < 0.3


def test_nopeek_adds_lambda_times_distance_correlation_to_the_site_s_gradients():
    model = build_model("mlp", {"in_features": 13, "hidden": [32, 16]}, seed=1)
    whole = copy.deepcopy(model)
    x, y = batch((64, 13))
    cut = whole.layers[:2](x)
    (F.cross_entropy(whole.layers[2:](cut), y) + 0.5 * distance_correlation(x, cut)).backward()
    parts = split(model, "vanilla", ["hidden1"])
    site = SiteStep(parts, sgd(0.0)(parts.bottom.parameters()), SiteOptions(nopeek=0.5))
    train_batch(site, ServerStep(parts, sgd(0.0)(parts.middle.parameters())), x, y)
    for (n, a), (_, b) in zip(model.named_parameters(), whole.named_parameters()):
        assert torch.allclose(a.grad, b.grad, atol=1e-6), n


def test_noise_on_the_activations_is_seeded_and_only_on_what_is_sent():
    model = build_model("mlp", {"in_features": 13, "hidden": [8]}, seed=1)
    parts = split(model, "vanilla", ["hidden1"])
    x, _ = batch((16, 13))
    sent = [SiteStep(parts, sgd(0.0)(parts.bottom.parameters()), SiteOptions(noise_std=0.5),
                     generator=torch.Generator().manual_seed(7)).forward(x) for _ in range(2)]
    clean = parts.bottom(x).detach()
    assert torch.equal(sent[0], sent[1]) and not torch.allclose(sent[0], clean)
    assert float((sent[0] - clean).std()) == pytest.approx(0.5, rel=0.2)


def test_logit_adjustment_trains_the_head_on_logits_plus_tau_log_prior():
    """u-shaped with τ: the site's loss is the cross-entropy of logits + τ·log(its label frequencies, add-one
    smoothed), so the gradients are those of that loss on the whole model; τ needs a head and a prior."""
    model = build_model("mlp", {"in_features": 13, "hidden": [32, 16], "num_classes": 3}, seed=1)
    whole = copy.deepcopy(model)
    x, _ = batch((64, 13))
    y = torch.tensor([0] * 50 + [1] * 14)   # a skewed site that never saw class 2
    prior = label_log_prior(y, num_classes(model))
    counts = torch.tensor([51.0, 15.0, 1.0])
    assert torch.allclose(prior, torch.log(counts / counts.sum())) and torch.isfinite(prior).all()
    F.cross_entropy(whole(x) + 0.7 * prior, y).backward()
    parts = split(model, "u-shaped", ["hidden1", "hidden2"])
    site = SiteStep(parts, sgd(0.0)([p for m in parts.site_modules for p in m.parameters()]),
                    SiteOptions(logit_adjustment=0.7), log_prior=prior)
    train_batch(site, ServerStep(parts, sgd(0.0)(parts.middle.parameters())), x, y)
    for (n, a), (_, b) in zip(model.named_parameters(), whole.named_parameters()):
        assert torch.allclose(a.grad, b.grad, atol=1e-6), n
    with pytest.raises(ValueError, match="u-shaped split"):
        SiteStep(split(model, "vanilla", ["hidden1"]), sgd(0.0)(model.parameters()),
                 SiteOptions(logit_adjustment=1.0), log_prior=prior)
    with pytest.raises(ValueError, match="label_log_prior"):
        SiteStep(parts, sgd(0.0)(model.parameters()), SiteOptions(logit_adjustment=1.0))


def by_hand(model, opt, x, y, *, seed: int, batch_size: int = 16) -> None:
    """One epoch of the whole model over (x, y), in the batch order plexus.split draws from `seed`."""
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
    for start in range(0, len(x), batch_size):
        rows = order[start:start + batch_size]
        opt.zero_grad()
        F.cross_entropy(model(x[rows]), y[rows]).backward()
        opt.step()


def _sites(n, rows=40, seed=0):
    return [batch((rows, 13), seed=seed + k) for k in range(n)]


def test_sequential_hands_each_site_the_weights_the_previous_one_left():
    model = build_model("mlp", {"in_features": 13, "hidden": [16]}, seed=2)
    parts = split(model, "vanilla", ["hidden1"])
    server = ServerStep(parts, sgd(0.1)(parts.middle.parameters()))
    sites = _sites(3)
    sequential_epoch(model, parts, server, sites, sgd(0.1), batch_size=16, seed=4)
    # the same as training the whole model site after site, batch by batch (the same batch order)
    whole = build_model("mlp", {"in_features": 13, "hidden": [16]}, seed=2)
    opt = sgd(0.1)(whole.parameters())
    for k, (x, y) in enumerate(sites):
        by_hand(whole, opt, x, y, seed=4 * 1_000_003 + k)
    for (n, a), (_, b) in zip(model.named_parameters(), whole.named_parameters()):
        assert torch.allclose(a, b, atol=1e-5), n


def test_splitfed_averages_the_site_parts_by_rows_and_keeps_one_server_part():
    cuts, args = ["hidden1", "hidden2"], {"in_features": 13, "hidden": [16, 8]}
    sites = [_sites(1, rows=40)[0], _sites(1, rows=80, seed=5)[0]]
    # The server part trains (every parameter moves), shared by both sites.
    model = build_model("mlp", args, seed=2)
    before = {n: p.clone() for n, p in model.named_parameters()}
    parts = split(model, "u-shaped", cuts)
    splitfed_epoch(model, "u-shaped", cuts, ServerStep(parts, sgd(0.1)(parts.middle.parameters())), sites, sgd(0.1),
                   batch_size=16, seed=4)
    assert all(not torch.equal(p, before[n]) for n, p in model.named_parameters())
    # With the server part held still, each site's copy trains on its own, and the model's site parts are their
    # average weighted 40:80.
    model = build_model("mlp", args, seed=2)
    parts = split(model, "u-shaped", cuts)
    splitfed_epoch(model, "u-shaped", cuts, ServerStep(parts, sgd(0.0)(parts.middle.parameters())), sites, sgd(0.1),
                   batch_size=16, seed=4)
    trained = []
    for k, (x, y) in enumerate(sites):
        mine = build_model("mlp", args, seed=2)
        by_hand(mine, sgd(0.1)([p for n, p in mine.named_parameters() if not n.startswith("layers.2.")]), x, y,
                seed=4 * 1_000_003 + k)
        trained.append(dict(mine.named_parameters()))
    for n, p in model.named_parameters():
        if n.startswith("layers.2."):   # the server's middle: held still
            assert torch.equal(p, before[n]), n
            continue
        expected = (40 * trained[0][n].double() + 80 * trained[1][n].double()) / 120
        assert torch.allclose(p.double(), expected, atol=1e-6), n


@pytest.mark.parametrize("variant,cuts", [("vanilla", ["hidden1"]), ("u-shaped", ["hidden1", "hidden2"])])
def test_synchronous_splitfed_takes_the_unsplit_model_s_step_on_each_turn_s_rows(variant, cuts):
    """One server step a turn on every site's share, and the sites' summed gradients of their parts: with momentum,
    and a 3-row site that has no rows in some turns, the joined model is the unsplit model's after the same turns."""
    args = {"in_features": 13, "hidden": [16, 8]}
    sites = [_sites(1, rows=40)[0], _sites(1, rows=10, seed=5)[0], _sites(1, rows=3, seed=7)[0]]
    momentum = lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9)   # noqa: E731
    model = build_model("mlp", args, seed=2)
    parts = split(model, variant, cuts)
    loss = synchronous_epoch(model, variant, cuts, ServerStep(parts, momentum(parts.middle.parameters())), sites,
                             momentum, batch_size=16, seed=4)
    whole = build_model("mlp", args, seed=2)
    opt = momentum(whole.parameters())
    turns = 4   # ⌈53 rows / 16⌉
    shares = [turn_shares(len(x), turns, torch.Generator().manual_seed(4 * 1_000_003 + k))
              for k, (x, _) in enumerate(sites)]
    assert [len(s) for s in shares[2]] == [0, 1, 1, 1]   # the small site sits out the first turn
    losses = []
    for t in range(turns):
        x = torch.cat([x[shares[k][t]] for k, (x, _) in enumerate(sites)])
        y = torch.cat([y[shares[k][t]] for k, (_, y) in enumerate(sites)])
        opt.zero_grad()
        turn_loss = F.cross_entropy(whole(x), y)
        turn_loss.backward()
        opt.step()
        losses.append(float(turn_loss.detach()))
    for (n, a), (_, b) in zip(model.named_parameters(), whole.named_parameters()):
        assert torch.allclose(a, b, atol=1e-5), n
    assert loss == pytest.approx(sum(losses) / turns, abs=1e-5)
