import threading

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file, save_file
from torch import nn

from plexus.errors import ConfigError, IntegrityError
from plexus.models import REGISTRY, available_models, build_model, load_numpy_state, state_to_numpy, state_views
from plexus.wire import decode, encode

from overlap import overlapping

MLP_ARGS = {"in_features": 13, "hidden": [8, 4], "num_classes": 2}


def _same_bits(a, b):
    return a.keys() == b.keys() and all(a[k].tobytes() == b[k].tobytes() for k in a)


def test_builtins_are_available():
    assert {"logistic", "mlp", "cnn"} <= set(available_models())
    assert available_models()["mlp"] is REGISTRY["mlp"]


def test_unknown_model_lists_names():
    with pytest.raises(ConfigError, match=r"'resnet'.*\['cnn', 'linear', 'logistic', 'mlp'"):
        build_model("resnet", {}, seed=0)


def test_unknown_argument_names_model_argument_and_accepted():
    with pytest.raises(ConfigError, match=r"'mlp'.*'hiden'.*in_features, hidden=.*num_classes=2, dropout=0.0"):
        build_model("mlp", {"in_features": 4, "hiden": [3]}, seed=0)


def test_missing_argument():
    with pytest.raises(ConfigError, match=r"'logistic' needs argument 'in_features'.*accepted"):
        build_model("logistic", {}, seed=0)


@pytest.mark.parametrize(
    "name, args, bad",
    [
        ("logistic", {"in_features": 0}, "in_features"),
        ("logistic", {"in_features": 3, "num_classes": 1}, "num_classes"),
        ("logistic", {"in_features": "13"}, "in_features"),
        ("mlp", {"in_features": 3, "hidden": [4, 0]}, "hidden"),
        ("mlp", {"in_features": 3, "hidden": 4}, "hidden"),
        ("mlp", {"in_features": 3, "dropout": 1.0}, "dropout"),
        ("cnn", {"image_size": 2}, "image_size"),
        ("cnn", {"width": True}, "width"),
        ("logistic", {"in_features": 3, "dtype": "float16"}, "dtype"),
        ("mlp", {"in_features": 3, "dtype": 64}, "dtype"),
        ("linear", {"in_features": 3, "outputs": 2}, "outputs"),
        ("linear", {"in_features": 0}, "in_features"),
    ],
)
def test_bad_argument_values(name, args, bad):
    with pytest.raises(ConfigError, match=rf"'{name}'.*'{bad}'.*accepted arguments"):
        build_model(name, args, seed=0)


def test_args_must_be_a_mapping():
    with pytest.raises(ConfigError, match="mapping"):
        build_model("logistic", [13], seed=0)


@pytest.mark.parametrize(
    "name, args",
    [("logistic", {"in_features": 13}), ("mlp", MLP_ARGS), ("cnn", {"width": 4}), ("linear", {"in_features": 13}),
     ("logistic", {"in_features": 13, "dtype": "float64"})],
)
def test_init_is_deterministic_per_seed_and_leaves_global_rng(name, args):
    before = torch.get_rng_state()
    a = state_to_numpy(build_model(name, args, seed=5))
    b = state_to_numpy(build_model(name, args, seed=5))
    c = state_to_numpy(build_model(name, args, seed=6))
    assert torch.equal(torch.get_rng_state(), before)
    assert _same_bits(a, b)
    assert not _same_bits(a, c)


_PAUSE = threading.local()   # a thread's `fn`, called half-way through building a _Halves


class _Halves(nn.Module):
    """Two layers, and between them the building thread's pause, if it set one: a build stopped half-way, as a
    preempted thread's is."""

    def __init__(self):
        super().__init__()
        self.first = nn.Linear(4, 4)
        getattr(_PAUSE, "fn", lambda: None)()
        self.second = nn.Linear(4, 4)


def test_two_builds_in_two_threads_that_overlap_each_get_their_seeds_weights(monkeypatch):
    """One build starts while another is half-way and is half-way itself when the other ends (several site agents,
    or an agent and a test recomputing its model, in one process): a seed alone still decides the weights."""
    monkeypatch.setitem(REGISTRY, "halves", _Halves)

    def run(seed, pause=None):
        if pause is not None:
            _PAUSE.fn = pause
        try:
            return state_to_numpy(build_model("halves", {}, seed=seed))
        finally:
            _PAUSE.__dict__.pop("fn", None)

    alone = {seed: run(seed) for seed in (1, 2)}
    got = overlapping(run)
    assert _same_bits(got[1], alone[1]) and _same_bits(got[2], alone[2])


def test_output_shapes():
    assert build_model("logistic", {"in_features": 13}, seed=0)(torch.zeros(5, 13)).shape == (5, 2)
    mlp = build_model("mlp", {"in_features": 13, "hidden": [], "num_classes": 3, "dropout": 0.2}, seed=0)
    assert mlp(torch.zeros(4, 13)).shape == (4, 3)
    assert build_model("mlp", {**MLP_ARGS, "dropout": 0.5}, seed=0)(torch.zeros(2, 13)).shape == (2, 2)
    cnn = build_model("cnn", {}, seed=0)
    assert cnn(torch.zeros(3, 1, 28, 28)).shape == (3, 10)
    rgb = build_model("cnn", {"in_channels": 3, "image_size": 10, "num_classes": 4, "width": 2}, seed=0)
    assert rgb(torch.zeros(2, 3, 10, 10)).shape == (2, 4)
    assert build_model("linear", {"in_features": 13}, seed=0)(torch.zeros(5, 13)).shape == (5, 1)


@pytest.mark.parametrize("name, args", [("logistic", {"in_features": 13, "num_classes": 3}), ("mlp", MLP_ARGS),
                                        ("linear", {"in_features": 13})])
def test_dtype_float64_makes_every_tensor_float64_from_the_float32_init(name, args):
    narrow = state_to_numpy(build_model(name, args, seed=3))
    wide = build_model(name, {**args, "dtype": "float64"}, seed=3)
    state = state_to_numpy(wide)
    assert {a.dtype for a in state.values()} == {np.dtype(np.float64)}
    assert all(np.array_equal(state[k], narrow[k].astype(np.float64)) for k in narrow)
    assert wide(torch.zeros(2, 13, dtype=torch.float64)).dtype == torch.float64


def test_float64_model_survives_wire_checkpoint_and_load_bit_for_bit(tmp_path):
    source = build_model("logistic", {"in_features": 13, "num_classes": 3, "dtype": "float64"}, seed=1)
    with torch.no_grad():   # values float32 cannot hold
        source.linear.weight.add_(1e-12)
    layout, blob = encode(state_views(source))
    assert {t.dtype for t in layout.tensors} == {"F64"}
    received = decode(layout, bytes(blob))
    path = tmp_path / "model.safetensors"
    save_file(received, str(path))   # the checkpoint format
    target = build_model("logistic", {"in_features": 13, "num_classes": 3, "dtype": "float64"}, seed=2)
    load_numpy_state(target, load_file(str(path)))
    assert _same_bits(state_to_numpy(target), state_to_numpy(source))
    x = torch.randn(3, 13, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    assert torch.equal(source(x), target(x))


def test_state_to_numpy_is_sorted_contiguous_copy():
    model = build_model("mlp", MLP_ARGS, seed=0)
    state = state_to_numpy(model)
    assert list(state) == sorted(state)
    assert all(isinstance(v, np.ndarray) and v.flags.c_contiguous for v in state.values())
    name = next(iter(state))
    state[name][...] = 123.0
    assert not torch.all(model.state_dict()[name] == 123.0)


def test_state_round_trip():
    source = build_model("mlp", MLP_ARGS, seed=1)
    target = build_model("mlp", MLP_ARGS, seed=2)
    load_numpy_state(target, state_to_numpy(source))
    assert _same_bits(state_to_numpy(target), state_to_numpy(source))
    x = torch.randn(3, 13, generator=torch.Generator().manual_seed(0))
    assert torch.equal(source(x), target(x))


def test_load_state_rejects_missing_unexpected_and_misshapen():
    model = build_model("logistic", {"in_features": 13}, seed=0)
    state = state_to_numpy(model)
    with pytest.raises(IntegrityError, match="missing tensor 'linear.bias'"):
        load_numpy_state(model, {"linear.weight": state["linear.weight"]})
    with pytest.raises(IntegrityError, match="unexpected tensor 'extra'"):
        load_numpy_state(model, {**state, "extra": np.zeros(1, dtype=np.float32)})
    with pytest.raises(IntegrityError, match=r"'linear.weight' has shape \(2, 12\)"):
        load_numpy_state(model, {**state, "linear.weight": np.zeros((2, 12), dtype=np.float32)})


def test_failed_load_changes_nothing():
    model = build_model("logistic", {"in_features": 13}, seed=0)
    before = state_to_numpy(model)
    bad = {"linear.bias": np.ones(2, dtype=np.float32), "linear.weight": np.ones((1, 13), dtype=np.float32)}
    with pytest.raises(IntegrityError):
        load_numpy_state(model, bad)
    assert _same_bits(state_to_numpy(model), before)


def test_the_statistics_model_is_zero_float64_sums_of_its_layout_and_has_no_forward_pass():
    from plexus import statistics as stats
    from plexus.config import parse_round_config
    from plexus.models import build_job_model

    job = parse_round_config("name: s\nkind: statistics\ndata: {dataset: d}\nstatistics:\n  columns:\n"
                             "    - {name: age, range: [0, 100], bins: 4}\n    - {name: sex, categories: [M, F]}\n")
    model = build_job_model(job)
    state = state_to_numpy(model)
    assert [(n, "F64", a.shape) for n, a in state.items()] == sorted(stats.layout(job.statistics))
    assert all(a.dtype == np.float64 and not a.any() for a in state.values())
    with pytest.raises(RuntimeError, match="has no forward pass"):
        model(torch.zeros(1, 1))
    with pytest.raises(ConfigError, match=r"model.args.columns\[0\].bins: 0 is out of range") as info:
        build_model("statistics", {"columns": [{"name": "age", "bins": 0}]}, seed=0)
    assert "accepted arguments" not in str(info.value)
