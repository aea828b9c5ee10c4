"""Tests for site_agent.policy: every rule declines with its reason, before any data is read."""

from __future__ import annotations

import sys
import textwrap
from importlib.metadata import EntryPoint

import pytest

from plexus import models
from plexus.accounting import dp_sgd_epsilon, epsilon_after
from plexus.config import PolicySpec, parse_round_config
from site_agent.policy import policy_digest, refusal

INSTALLED = {"logistic", "mlp", "cnn", "vector"}


def job(privacy: str = "", *, model: str = "mlp", dataset: str = "heart-disease", rounds: int = 10):
    text = (f"name: j\nmodel: {{name: {model}, args: {{in_features: 13}}}}\ndata: {{dataset: {dataset}}}\n"
            f"rounds: {rounds}\nsites: {{min: 3}}\ntrain: {{epochs: 1, batch_size: 32}}\n")
    return parse_round_config(text + (f"privacy: {privacy}\n" if privacy else ""))


DP = "{dp: {mode: central, noise_multiplier: 1.0, clip_norm: 1.0}}"


def untouched():
    """A dataset-size callable that fails the test if a rule reads the data."""
    def count() -> int:
        raise AssertionError("the policy read the site's data for a job it should decline first")
    return count


def test_allowed_job_passes():
    policy = PolicySpec(allowed_models=("mlp",), require_secure_aggregation=True, max_epsilon=50.0,
                        min_dp_noise=0.5, max_rounds=10, allowed_datasets=("heart-disease",))
    assert refusal(policy, job("{secure_aggregation: true, " + DP[1:]), INSTALLED, train_size=untouched()) is None


SYNCHRONOUS_SPLIT = parse_round_config(
    "name: s\nmodel: {name: mlp, args: {in_features: 13, hidden: [32, 16]}}\ndata: {dataset: heart-disease}\n"
    "rounds: 2\nmode: split\nsplit: {variant: u-shaped, cuts: [hidden1, hidden2], schedule: synchronous}\n"
    "train: {batch_size: 32}\n")


@pytest.mark.parametrize(("policy", "the_job", "reason"), [
    (PolicySpec(allowed_models=("logistic",)), job(),
     "model 'mlp' is not in this site's policy.allowed_models ['logistic']"),
    (PolicySpec(allowed_models=("mlp", "ghost")), job(model="ghost"), "model 'ghost' is not installed at this site"),
    (PolicySpec(allowed_models=("mlp",), allowed_datasets=("breast-cancer",)), job(),
     "dataset 'heart-disease' is not in this site's policy.allowed_datasets ['breast-cancer']"),
    (PolicySpec(allowed_models=("mlp",), max_rounds=5), job(rounds=6),
     "the job has 6 rounds; this site's policy.max_rounds allows at most 5"),
    (PolicySpec(allowed_models=("mlp",), require_secure_aggregation=True), job(),
     "this site's policy requires secure aggregation (privacy.secure_aggregation: true)"),
    (PolicySpec(allowed_models=("mlp",), min_dp_noise=0.5), job(),
     "this site's policy.min_dp_noise is 0.5, and the job adds no differential-privacy noise"),
    (PolicySpec(allowed_models=("mlp",), min_dp_noise=1.5), job(DP),
     "the job's DP noise (privacy.dp.noise_multiplier = 1.0) is below this site's policy.min_dp_noise 1.5"),
    (PolicySpec(allowed_models=("mlp",), max_epsilon=8.0), job(),
     "this site's policy caps ε at 8.0, and the job has no differential privacy (its ε is unbounded)"),
    (PolicySpec(allowed_models=("mlp",), max_epsilon=8.0), job(DP, rounds=10),
     f"the job's accounted ε after its 10 rounds would be client-level ε {epsilon_after(10, 1.0, 1.0, 1e-5):.3g}"),
    (PolicySpec(allowed_models=("mlp",), split_schedules=("sequential", "splitfed")), SYNCHRONOUS_SPLIT,
     "the job's split schedule is synchronous, which shows the coordinator this site's gradients of its parts every "
     "turn; this site's policy.split_schedules allows sequential, splitfed"),
])
def test_every_rule_declines_with_its_reason_before_touching_data(policy, the_job, reason):
    got = refusal(policy, the_job, INSTALLED, train_size=untouched())
    assert got is not None and got.startswith(reason), got


def test_max_epsilon_reason_says_how_to_fix():
    got = refusal(PolicySpec(allowed_models=("mlp",), max_epsilon=8.0), job(DP), INSTALLED)
    assert "above this site's policy.max_epsilon 8.0" in got and "privacy.dp.target_epsilon <= 8.0" in got


def test_epsilon_within_the_cap_is_accepted():
    cap = epsilon_after(10, 1.0, 1.0, 1e-5)
    assert refusal(PolicySpec(allowed_models=("mlp",), max_epsilon=cap), job(DP), INSTALLED) is None


def test_lbfgs_under_dp_counts_its_noisy_row_count_as_one_more_release_and_says_row_level():
    """As the coordinator's accountant counts it (ε after n rounds = n + 1 releases at q = 1): a cap exactly at
    10 releases refuses the 10-round job, one at 11 takes it."""
    exact = parse_round_config("name: j\nmodel: {name: logistic, args: {in_features: 13, dtype: float64}}\n"
                               "data: {dataset: heart-disease}\nrounds: 10\nsites: {min: 3}\n"
                               f"strategy: {{name: lbfgs}}\nprivacy: {DP}\n")
    policy = PolicySpec(allowed_models=("logistic",), max_epsilon=epsilon_after(10, 1.0, 1.0, 1e-5))
    assert "row-level ε" in refusal(policy, exact, INSTALLED)
    policy = PolicySpec(allowed_models=("logistic",), max_epsilon=epsilon_after(11, 1.0, 1.0, 1e-5))
    assert refusal(policy, exact, INSTALLED) is None


def test_target_epsilon_within_the_cap_accepts_the_job_and_the_site_stops_per_round():
    dp = "{dp: {mode: central, noise_multiplier: 1.0, clip_norm: 1.0, target_epsilon: 5.0}}"
    policy = PolicySpec(allowed_models=("mlp",), max_epsilon=6.0)
    the_job = job(dp, rounds=100)
    assert refusal(policy, the_job, INSTALLED) is None
    last_ok = max(r for r in range(1, 101) if epsilon_after(r, 1.0, 1.0, 1e-5) <= 6.0)
    assert refusal(policy, the_job, INSTALLED, round_=last_ok) is None
    got = refusal(policy, the_job, INSTALLED, round_=last_ok + 1)
    assert got.startswith(f"the job's accounted ε after round {last_ok + 1} would be"), got


def test_dp_sgd_epsilon_uses_the_sites_dataset_size():
    dp_sgd = "{dp_sgd: {noise_multiplier: 1.0, max_grad_norm: 1.0}}"
    eps = dp_sgd_epsilon(10, train_size=300, batch_size=32, epochs=1, noise_multiplier=1.0, delta=1e-5)
    loose, tight = PolicySpec(allowed_models=("mlp",), max_epsilon=eps), PolicySpec(allowed_models=("mlp",),
                                                                                     max_epsilon=eps * 0.99)
    assert refusal(loose, job(dp_sgd), INSTALLED, train_size=300) is None
    assert refusal(loose, job(dp_sgd), INSTALLED, train_size=lambda: 300) is None
    got = refusal(tight, job(dp_sgd), INSTALLED, train_size=300)
    assert f"DP-SGD ε {eps:.3g} on 300 rows" in got
    assert "training-set size, which was not given" in refusal(loose, job(dp_sgd), INSTALLED)


def test_either_dp_guarantee_within_the_cap_is_enough():
    both = ("{dp: {mode: central, noise_multiplier: 0.3, clip_norm: 1.0},"
            " dp_sgd: {noise_multiplier: 2.0, max_grad_norm: 1.0}}")
    policy = PolicySpec(allowed_models=("mlp",), max_epsilon=8.0, min_dp_noise=1.0)
    assert refusal(policy, job(both), INSTALLED, train_size=300) is None


def test_policy_digest_changes_with_every_field():
    base = PolicySpec(allowed_models=("mlp",))
    variants = [PolicySpec(allowed_models=("mlp",), min_dp_noise=1.0),
                PolicySpec(allowed_models=("mlp",), max_rounds=3),
                PolicySpec(allowed_models=("mlp",), allowed_datasets=("x",)),
                PolicySpec(allowed_models=("mlp",), plugin_sha256={"p": "0" * 64}),
                PolicySpec(allowed_models=("mlp",), split_schedules=("splitfed",))]
    digests = {policy_digest(p) for p in [base, *variants]}
    assert len(digests) == 6 and policy_digest(base) == policy_digest(PolicySpec(allowed_models=("mlp",)))


# plug-in pinning ----------------------------------------------------------------------------
PLUGIN = textwrap.dedent('''\
    from torch import nn


    class Tiny(nn.Module):
        def __init__(self, in_features: int = 13):
            super().__init__()
            self.linear = nn.Linear(in_features, 2)

        def forward(self, x):
            return self.linear(x)
    ''')


@pytest.fixture
def tiny_plugin(tmp_path, monkeypatch):
    """A real plug-in module on disk, registered through a fake entry point (no package install possible here)."""
    source = tmp_path / "plexus_tiny_plugin.py"
    source.write_text(PLUGIN)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "plexus_tiny_plugin", raising=False)  # restored (and dropped) after the test
    ep = EntryPoint(name="tiny", value="plexus_tiny_plugin:Tiny", group=models.ENTRY_POINT_GROUP)
    monkeypatch.setattr(models, "entry_points", lambda group=None: [ep] if group == models.ENTRY_POINT_GROUP else [])
    return source


def test_plugin_hash_is_the_sha256_of_its_source(tiny_plugin):
    import hashlib

    assert models.plugin_source_sha256("tiny") == hashlib.sha256(tiny_plugin.read_bytes()).hexdigest()
    assert "tiny" in models.available_models()


def test_pinned_plugin_runs_and_a_modified_one_is_caught(tiny_plugin):
    pinned = models.plugin_source_sha256("tiny")
    policy = PolicySpec(allowed_models=("tiny",), plugin_sha256={"tiny": pinned})
    the_job = job(model="tiny")
    assert refusal(policy, the_job, INSTALLED | {"tiny"}, train_size=untouched()) is None

    data = bytearray(tiny_plugin.read_bytes())
    data[data.index(b"2)")] = ord("3")  # one byte: two outputs become three
    tiny_plugin.write_bytes(bytes(data))
    got = refusal(policy, the_job, INSTALLED | {"tiny"}, train_size=untouched())
    assert got.startswith("plug-in model 'tiny' does not match this site's policy.plugin_sha256"), got
    assert pinned in got and models.plugin_source_sha256("tiny") in got


def test_unpinned_plugin_is_declined_with_the_hash_to_pin(tiny_plugin):
    got = refusal(PolicySpec(allowed_models=("tiny",)), job(model="tiny"), INSTALLED | {"tiny"})
    assert got.startswith("plug-in model 'tiny' is not pinned") and models.plugin_source_sha256("tiny") in got


def test_plugin_package_hash_covers_every_module(tmp_path, monkeypatch):
    pkg = tmp_path / "plexus_tiny_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("from .net import Tiny\n")
    (pkg / "net.py").write_text(PLUGIN)
    monkeypatch.syspath_prepend(str(tmp_path))
    ep = EntryPoint(name="tinypkg", value="plexus_tiny_pkg.net:Tiny", group=models.ENTRY_POINT_GROUP)
    monkeypatch.setattr(models, "entry_points", lambda group=None: [ep])
    before = models.plugin_source_sha256("tinypkg")
    (pkg / "helpers.py").write_text("X = 1\n")  # even a module the entry point does not name
    assert models.plugin_source_sha256("tinypkg") != before


def test_builtin_models_are_not_hashed():
    from plexus.errors import ConfigError

    with pytest.raises(ConfigError, match="built in"):
        models.plugin_source_sha256("mlp")


def test_pin_model_cli_prints_the_hash_to_pin(tiny_plugin, capsys):
    from plexus.cli import main as cli

    assert cli(["site", "pin-model", "tiny"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0] == models.plugin_source_sha256("tiny")
    assert f"plugin_sha256: {{tiny: '{models.plugin_source_sha256('tiny')}'}}" in out
    assert cli(["site", "pin-model", "mlp"]) == 1
    assert "built in" in capsys.readouterr().err


def _sized(model: str, args: str):
    return parse_round_config(f"name: j\nmodel: {{name: {model}, args: {args}}}\ndata: {{dataset: heart-disease}}\n"
                              "rounds: 1\n")


def test_a_model_over_max_model_bytes_is_declined_without_being_built():
    """The coordinator picks the model's arguments; the site sizes them on torch's meta device. 784 × 1024 float32
    weights are 3.2 MB; 8 GB of a vector is sized without a byte of it allocated."""
    policy = PolicySpec(allowed_models=("mlp", "vector"), max_model_bytes=1 << 20)
    assert refusal(policy, _sized("mlp", "{in_features: 784, hidden: [64]}"), INSTALLED) is None
    got = refusal(policy, _sized("mlp", "{in_features: 784, hidden: [1024]}"), INSTALLED)
    assert got == ("model 'mlp' with the job's arguments holds 3,223,560 bytes of parameters and buffers, over this "
                   "site's policy.max_model_bytes (1,048,576 bytes); raise policy.max_model_bytes if this machine "
                   "can train it"), got
    got = refusal(policy, _sized("vector", "{size: 2000000000}"), INSTALLED)
    assert "holds 8,000,000,000 bytes" in got, got
    got = refusal(policy, _sized("mlp", "{in_features: 0}"), INSTALLED)
    assert got.startswith("model 'mlp' cannot be built with the job's arguments: model 'mlp': argument "
                          "'in_features' must be >= 1"), got
    got = refusal(policy, _sized("mlp", "{in_features: 4611686018427387904, hidden: [4]}"), INSTALLED)
    assert got.startswith("model 'mlp' cannot be built with the job's arguments: RuntimeError: Storage size "
                          "calculation overflowed"), got


def test_the_default_cap_is_a_quarter_of_the_memory_the_agent_may_use(tmp_path):
    from plexus.memory import machine_memory
    from site_agent.policy import max_model_bytes

    total = machine_memory()
    assert max_model_bytes(PolicySpec()) == total // 4
    assert max_model_bytes(PolicySpec(max_model_bytes=5 << 20)) == 5 << 20
    words = (total // 4) // 4 + 1   # float32 elements one past the default
    got = refusal(PolicySpec(allowed_models=("vector",)), _sized("vector", f"{{size: {words}}}"), INSTALLED)
    assert "over a quarter of this machine's memory, the default of policy.max_model_bytes" in got, got
    cgroup = tmp_path / "memory.max"
    cgroup.write_text("1073741824\n")
    assert machine_memory(cgroup) == min(total, 1 << 30)
    cgroup.write_text("max\n")   # no limit
    assert machine_memory(cgroup) == total
    assert machine_memory(tmp_path / "absent") == total


def test_a_plugin_that_cannot_be_sized_on_the_meta_device_is_declined_saying_why(tiny_plugin):
    """The plug-in reads one of its own values while it builds: there are none on the meta device."""
    tiny_plugin.write_text(PLUGIN.replace("nn.Linear(in_features, 2)\n", "nn.Linear(in_features, 2)\n"
                                          "        self.scale = float(self.linear.weight.detach().sum())\n"))
    policy = PolicySpec(allowed_models=("tiny",), plugin_sha256={"tiny": models.plugin_source_sha256("tiny")})
    got = refusal(policy, job(model="tiny"), {"tiny"})
    assert got.startswith("model 'tiny' cannot be sized on torch's meta device before it is built "), got
    assert got.endswith("the plug-in must build its layers without reading their values"), got
