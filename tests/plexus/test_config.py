"""Tests for plexus.config: parsing, defaults, round trips and error messages."""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

import pytest
from hypothesis import given, settings, strategies as st

from plexus.config import (
    MAX_NOISE,
    MAX_WAIT_S,
    MIN_NOISE,
    AdminConfig,
    CoordinatorConfig,
    DatasetSpec,
    DataSpec,
    DPSGDSpec,
    DPSpec,
    EmulationSpec,
    ModelSpec,
    OptimizerSpec,
    PolicySpec,
    PrivacySpec,
    RoundConfig,
    SitesSpec,
    StrategySpec,
    TrainSpec,
    dump_round_config,
    load_admin_config,
    load_coordinator_config,
    load_round_config,
    load_site_config,
    parse_round_config,
    split_address,
)
from plexus.errors import ConfigError

DESIGN_ROUND = """\
name: heart-fedavg
model: {name: mlp, args: {in_features: 13, hidden: [32], num_classes: 2}}
data: {dataset: heart-disease}          # each site maps this name to its own data
strategy: {name: fedavg}
rounds: 20
sites: {min: 3, deadline_s: 60}
train: {epochs: 1, batch_size: 32, optimizer: {name: sgd, lr: 0.05}}
privacy: {secure_aggregation: true, dp: {mode: central, noise_multiplier: 1.0, clip_norm: 1.0}}
seed: 0
"""

DESIGN_SITE = """\
site: cleveland
coordinator: coordinator.example.org:8443
kit: ./kits/cleveland
datasets:
  heart-disease: {kind: csv, path: /data/heart.csv, label: target}
policy:
  allowed_models: [mlp, logistic]
  require_secure_aggregation: true
  max_epsilon: 8.0
"""

MINIMAL = "name: job\nmodel: {name: mlp}\ndata: {dataset: heart}\nrounds: 3\n"


def write(tmp_path: Path, text: str, name: str = "config.yaml") -> Path:
    path = tmp_path / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text), encoding="utf-8")
    return path


def round_error(text: str) -> str:
    with pytest.raises(ConfigError) as info:
        parse_round_config(textwrap.dedent(text), source="job.yaml")
    return str(info.value)


def site_error(tmp_path: Path, text: str) -> str:
    path = write(tmp_path, text, "site.yaml")
    with pytest.raises(ConfigError) as info:
        load_site_config(path)
    return str(info.value).removeprefix(f"{path}:")


# --- valid configs -----------------------------------------------------------


def test_design_round_config_example():
    cfg = parse_round_config(DESIGN_ROUND)
    assert cfg == RoundConfig(
        name="heart-fedavg",
        model=ModelSpec(name="mlp", args={"in_features": 13, "hidden": [32], "num_classes": 2}),
        data=DataSpec(dataset="heart-disease"),
        strategy=StrategySpec(name="fedavg"),
        rounds=20,
        sites=SitesSpec(min=3, deadline_s=60.0),
        train=TrainSpec(epochs=1, batch_size=32, optimizer=OptimizerSpec(name="sgd", lr=0.05)),
        privacy=PrivacySpec(
            secure_aggregation=True,
            dp=DPSpec(mode="central", noise_multiplier=1.0, clip_norm=1.0),
        ),
        seed=0,
    )
    assert cfg.privacy.dp.delta == 1e-5 and cfg.privacy.dp.target_epsilon is None


def test_design_site_config_example(tmp_path):
    path = write(tmp_path, DESIGN_SITE, "etc/site.yaml")
    cfg = load_site_config(path)
    assert cfg.site == "cleveland"
    assert cfg.coordinator == "coordinator.example.org:8443"
    assert cfg.kit == tmp_path / "etc" / "kits" / "cleveland"
    assert cfg.state_dir == tmp_path / "etc" / "state"
    assert cfg.datasets == {
        "heart-disease": DatasetSpec(kind="csv", path=Path("/data/heart.csv"), label="target"),
    }
    assert cfg.policy == PolicySpec(
        allowed_models=("mlp", "logistic"), require_secure_aggregation=True, max_epsilon=8.0
    )


def test_round_config_defaults():
    cfg = parse_round_config(MINIMAL)
    assert cfg.strategy == StrategySpec(name="fedavg", args={})
    assert cfg.sites == SitesSpec(min=1, deadline_s=300.0)
    assert cfg.train == TrainSpec(
        epochs=1, batch_size=32,
        optimizer=OptimizerSpec(name="sgd", lr=0.01, momentum=0.0, weight_decay=0.0),
    )
    assert cfg.privacy == PrivacySpec(secure_aggregation=False, dp=None)
    assert cfg.seed == 0
    assert cfg.model.args == {}


def test_dataclasses_are_frozen():
    cfg = parse_round_config(MINIMAL)
    with pytest.raises(AttributeError):
        cfg.rounds = 5  # type: ignore[misc]


def test_int_accepted_for_float_fields():
    cfg = parse_round_config(MINIMAL + "sites: {deadline_s: 60}\ntrain: {optimizer: {lr: 1}}\n")
    assert cfg.sites.deadline_s == 60.0 and type(cfg.sites.deadline_s) is float
    assert type(cfg.train.optimizer.lr) is float


def test_unquoted_exponent_accepted_for_float_fields():
    # PyYAML's YAML 1.1 resolver reads `1e-5` as a string; float fields take it anyway.
    cfg = parse_round_config(
        MINIMAL + "sites: {min: 3}\nprivacy: {secure_aggregation: true,\n"
                  "          dp: {mode: distributed, noise_multiplier: 0, clip_norm: 2, delta: 1e-6}}\n"
    )
    assert cfg.privacy.dp.delta == 1e-6


def test_dp_null_allowed():
    assert parse_round_config(MINIMAL + "privacy: {dp: null}\n").privacy.dp is None


def test_scalar_alias_allowed():
    cfg = parse_round_config(MINIMAL + "sites: {min: &n 2}\ntrain: {epochs: *n}\n")
    assert cfg.sites.min == cfg.train.epochs == 2


def test_load_round_config_file(tmp_path):
    path = write(tmp_path, DESIGN_ROUND, "job.yaml")
    assert load_round_config(path) == parse_round_config(DESIGN_ROUND)


# --- round trip --------------------------------------------------------------


def test_dump_is_canonical_and_round_trips():
    cfg = parse_round_config(DESIGN_ROUND)
    text = dump_round_config(cfg)
    assert parse_round_config(text) == cfg
    assert "target_epsilon: null" in text and "weight_decay: 0.0" in text  # defaults explicit
    top_keys = [line.split(":")[0] for line in text.splitlines() if not line.startswith(" ")]
    assert top_keys == sorted(top_keys)
    assert dump_round_config(parse_round_config(text)) == text


def test_sites_retries_is_left_out_of_the_dumped_config_unless_set():
    """A job's config goes to its sites: one without retries dumps as before, so older agents still read it."""
    assert parse_round_config(MINIMAL).sites.retries == 0
    assert "retries" not in dump_round_config(parse_round_config(MINIMAL + "sites: {retries: 0}\n"))
    again = parse_round_config(MINIMAL + "sites: {min: 2, retries: 3}\n")
    assert "retries: 3" in dump_round_config(again) and parse_round_config(dump_round_config(again)) == again


positive = st.floats(min_value=0, exclude_min=True, allow_nan=False, allow_infinity=False)
NOISE = st.just(0.0) | st.floats(min_value=MIN_NOISE, max_value=MAX_NOISE)   # what the accountants can compute
arg_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(alphabet="abcXYZ019 :-_#'\"", max_size=8),
    lambda inner: st.lists(inner, max_size=3),
    max_leaves=6,
)


@st.composite
def round_configs(draw):
    dp = draw(st.none() | st.builds(
        DPSpec,
        mode=st.sampled_from(["central", "distributed"]),
        noise_multiplier=NOISE,
        clip_norm=positive,
        delta=st.floats(min_value=0, max_value=1, exclude_min=True, exclude_max=True),
        target_epsilon=st.none() | positive,
    ))
    secure = draw(st.booleans()) or (dp is not None and dp.mode == "distributed")
    return RoundConfig(
        name=draw(st.from_regex(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}", fullmatch=True)),
        model=ModelSpec(name="mlp", args=draw(st.dictionaries(
            st.text(alphabet="abc_-:1 ", min_size=1, max_size=6), arg_values, max_size=4))),
        data=DataSpec(dataset=draw(st.sampled_from(["heart", "yes", "123", "null"]))),
        rounds=draw(st.integers(1, 100_000)),
        sites=SitesSpec(min=draw(st.integers(3 if secure else 1, 50)),
                        deadline_s=draw(st.floats(min_value=0, max_value=MAX_WAIT_S, exclude_min=True)),
                        retries=draw(st.integers(0, 1000))),
        train=TrainSpec(optimizer=OptimizerSpec(
            name=draw(st.sampled_from(["sgd", "adam"])),
            lr=draw(positive),
            momentum=draw(st.floats(min_value=0, max_value=1, exclude_max=True)),
        )),
        # distributed DP is only valid under secure aggregation
        privacy=PrivacySpec(secure_aggregation=secure,
                            dp=dp, dp_sgd=draw(st.none() | st.builds(
                                DPSGDSpec,
                                noise_multiplier=NOISE,
                                max_grad_norm=positive,
                                delta=st.floats(min_value=0, max_value=1, exclude_min=True, exclude_max=True)))),
        seed=draw(st.integers(0, 2**63 - 1)),
    )


@settings(max_examples=60, deadline=None)
@given(round_configs())
def test_dump_parse_round_trip_property(cfg):
    assert parse_round_config(dump_round_config(cfg)) == cfg


# --- round config errors: key path and line ----------------------------------


@pytest.mark.parametrize(
    ("text", "prefix", "detail"),
    [
        # unknown keys, top level and nested, list the allowed keys
        (MINIMAL + "roundz: 4\n", "job.yaml:5: roundz: unknown key",
         "allowed keys: asynchronous, compression, data, kind, mode, model, name, privacy, rounds, seed, sites, split, "
         "statistics, strategy, train"),
        (MINIMAL + "train:\n  optimizer:\n    lr: 0.1\n    nesterov: true\n",
         "job.yaml:8: train.optimizer.nesterov: unknown key",
         "allowed keys: lr, momentum, name, weight_decay"),
        (MINIMAL + "privacy: {dp: {mode: central, noise_multiplier: 1, clip_norm: 1, eps: 3}}\n",
         "job.yaml:5: privacy.dp.eps: unknown key",
         "allowed keys: clip_norm, delta, mode, noise_multiplier, reproducible_noise, target_epsilon"),
        # wrong types
        ("name: job\nmodel: {name: mlp}\ndata: {dataset: heart}\nrounds: true\n",
         "job.yaml:4: rounds: expected an integer, got a boolean", "whole number"),
        ("name: job\nmodel: {name: mlp}\ndata: {dataset: heart}\nrounds: 2.0\n",
         "job.yaml:4: rounds: expected an integer, got a number", "whole number"),
        (MINIMAL + "sites:\n  deadline_s: fast\n", "job.yaml:6: sites.deadline_s: expected a number, got a string",
         "write a number"),
        (MINIMAL + "train: {optimizer: {lr: '0.1'}}\n", "job.yaml:5: train.optimizer.lr: expected a number", ""),
        ("name: job\nmodel: [mlp]\ndata: {dataset: heart}\nrounds: 3\n",
         "job.yaml:2: model: expected a mapping, got a list", "write a mapping with keys: args, name"),
        ("name: 2024\nmodel: {name: mlp}\ndata: {dataset: heart}\nrounds: 3\n",
         "job.yaml:1: name: expected a string, got an integer", "quote it"),
        (MINIMAL + "privacy: {secure_aggregation: 1}\n",
         "job.yaml:5: privacy.secure_aggregation: expected a boolean", "true or false"),
        (MINIMAL + "model2: x\nprivacy:\n  dp: []\n", "job.yaml:5: model2: unknown key", ""),
        (MINIMAL + "privacy:\n  dp: []\n", "job.yaml:6: privacy.dp: expected a mapping, got a list", ""),
        (MINIMAL + "seed: null\n", "job.yaml:5: seed: expected an integer, got null", ""),
        (MINIMAL + "sites: {deadline_s: .inf}\n", "job.yaml:5: sites.deadline_s: inf is not a finite number", ""),
        # missing required keys: line of the parent mapping
        ("# a job\nname: job\nmodel: {name: mlp}\ndata: {dataset: heart}\n",
         "job.yaml:2: rounds: missing required key", "add 'rounds:' with an integer"),
        (MINIMAL + "privacy:\n  dp:\n    mode: central\n    noise_multiplier: 1.0\n",
         "job.yaml:7: privacy.dp.clip_norm: missing required key", "add 'clip_norm:' with a number"),
        ("name: job\nmodel: {args: {}}\ndata: {dataset: heart}\nrounds: 3\n",
         "job.yaml:2: model.name: missing required key", ""),
        # out of range
        ("name: job\nmodel: {name: mlp}\ndata: {dataset: heart}\nrounds: 0\n",
         "job.yaml:4: rounds: 0 is out of range", "use a value in [1, 100000]"),
        ("name: job\nmodel: {name: mlp}\ndata: {dataset: heart}\nrounds: 100001\n",
         "job.yaml:4: rounds: 100001 is out of range", ""),
        (MINIMAL + "sites: {min: 0}\n", "job.yaml:5: sites.min: 0 is out of range", "use a value in [1, 100000]"),
        (MINIMAL + "sites: {deadline_s: 0}\n", "job.yaml:5: sites.deadline_s: 0.0 is out of range", "(0, 86400.0]"),
        (MINIMAL + "train:\n  optimizer: {momentum: 1}\n",
         "job.yaml:6: train.optimizer.momentum: 1.0 is out of range", "use a value in [0, 1)"),
        (MINIMAL + "train: {optimizer: {name: rmsprop}}\n",
         "job.yaml:5: train.optimizer.name: 'rmsprop' is not allowed", "use one of: adam, sgd"),
        (MINIMAL + "privacy: {dp: {mode: local, noise_multiplier: 1, clip_norm: 1}}\n",
         "job.yaml:5: privacy.dp.mode: 'local' is not allowed", "use one of: central, distributed"),
        (MINIMAL + "privacy: {dp: {mode: central, noise_multiplier: 1, clip_norm: 1, delta: 1}}\n",
         "job.yaml:5: privacy.dp.delta: 1.0 is out of range", "in (0, 1)"),
        (MINIMAL + "privacy: {dp: {mode: central, noise_multiplier: -1, clip_norm: 1}}\n",
         "job.yaml:5: privacy.dp.noise_multiplier: -1.0 is out of range", ""),
        (MINIMAL + "privacy: {dp: {mode: central, noise_multiplier: 1, clip_norm: 1, target_epsilon: 0}}\n",
         "job.yaml:5: privacy.dp.target_epsilon: 0.0 is out of range", ""),
        (MINIMAL + "sites: {retries: -1}\n", "job.yaml:5: sites.retries: -1 is out of range", "[0, 1000]"),
        (MINIMAL + "sites: {retries: 1.5}\n", "job.yaml:5: sites.retries: expected an integer", ""),
        (MINIMAL + "seed: -1\n", "job.yaml:5: seed: -1 is out of range", ""),
        (MINIMAL + f"seed: {2**63}\n", "job.yaml:5: seed: 9223372036854775808 is out of range", ""),
        (MINIMAL + f"seed: {10**40}\n", "job.yaml:5: seed: 100000000000000000000000... (41 characters) is out of "
                                         "range", "at most 9223372036854775807"),
        # numbers YAML 1.1 reads in other bases, and ones too large for a float
        (MINIMAL + "seed: 1:30\n", "job.yaml:5: seed: 1:30 is a base-60 number in YAML 1.1", "write it in decimal"),
        (MINIMAL + "seed: 010\n", "job.yaml:5: seed: 010 is an octal number in YAML 1.1", "write it in decimal"),
        (MINIMAL + "seed: 0x10\n", "job.yaml:5: seed: 0x10 is a hexadecimal number in YAML 1.1", ""),
        ("name: job\nmodel: {name: mlp, args: {hidden: [0b11]}}\ndata: {dataset: heart}\nrounds: 3\n",
         "job.yaml:2: model.args.hidden[0]: 0b11 is a binary number in YAML 1.1", ""),
        (MINIMAL + "sites: {deadline_s: 1" + "0" * 400 + "}\n",
         "job.yaml:5: sites.deadline_s: 100000000000000000000000... (401 characters) is too large for a number", ""),
        # waits and counts a federation cannot mean: gRPC takes a 1e10 s timeout as already expired
        (MINIMAL + "sites: {deadline_s: 1e10}\n", "job.yaml:5: sites.deadline_s: 10000000000.0 is out of range",
         "(0, 86400.0]"),
        (MINIMAL + "train: {epochs: 100000}\n", "job.yaml:5: train.epochs: 100000 is out of range", "[1, 10000]"),
        # bad job names
        ("name: 'bad name'\nmodel: {name: mlp}\ndata: {dataset: heart}\nrounds: 3\n",
         "job.yaml:1: name: 'bad name' is not a valid name", "letters, digits"),
        ("name: -job\nmodel: {name: mlp}\ndata: {dataset: heart}\nrounds: 3\n",
         "job.yaml:1: name: '-job' is not a valid name", ""),
        (f"name: {'a' * 65}\nmodel: {{name: mlp}}\ndata: {{dataset: heart}}\nrounds: 3\n",
         "job.yaml:1: name: 'aaaa", "not a valid name"),
        ("name: ''\nmodel: {name: mlp}\ndata: {dataset: heart}\nrounds: 3\n", "job.yaml:1: name: is empty", ""),
        # duplicate keys, top level and inside free-form args
        (MINIMAL + "rounds: 4\n", "job.yaml:5: rounds: duplicate key (first at line 4)", "keep only one"),
        (MINIMAL.replace("{name: mlp}", "{name: mlp, args: {a: 1, a: 2}}"),
         "job.yaml:2: model.args.a: duplicate key (first at line 2)", ""),
        # free-form args
        (MINIMAL.replace("{name: mlp}", "{name: mlp, args: {1: 2}}"),
         "job.yaml:2: model.args: keys must be strings, got an integer", "quote the key"),
        (MINIMAL.replace("{name: mlp}", "{name: mlp, args: {when: 2024-01-01}}"),
         "job.yaml:2: model.args.when: unsupported value, a date", "quote dates"),
        (MINIMAL.replace("{name: mlp}", "{name: mlp, args: [1]}"),
         "job.yaml:2: model.args: expected a mapping, got a list", ""),
        # document shape and syntax
        ("", "job.yaml:1: (top level): the document is empty",
         "write a mapping with keys: asynchronous, compression, data, kind, mode, model"),
        ("# only a comment\n", "job.yaml:1: (top level): the document is empty", ""),
        ("- name: job\n", "job.yaml:1: (top level): expected a mapping, got a list", ""),
        ("name: job\nmodel: {name: mlp\n", "job.yaml:3: (yaml):", "fix the YAML syntax"),
        ("name: job\n---\nname: other\n", "job.yaml:2: (yaml):", "single document"),
    ],
)
def test_round_config_errors(text, prefix, detail):
    message = round_error(text)
    assert message.startswith(prefix), message
    assert detail in message
    assert "; " in message  # every message says how to fix it


def test_unknown_key_suggests_close_match():
    assert "did you mean 'rounds'?" in round_error(MINIMAL + "roundz: 4\n")


def test_error_is_a_value_error():
    with pytest.raises(ValueError):
        parse_round_config("rounds: nope\n")


def test_default_source_label():
    with pytest.raises(ConfigError, match=r"^<round config>:1: "):
        parse_round_config("")


def test_recursive_alias_rejected():
    text = MINIMAL.replace("{name: mlp}", "{name: mlp, args: {loop: &a [*a]}}")
    assert "model.args.loop[0]: repeats a mapping or list through a YAML alias" in round_error(text)


def test_alias_bomb_rejected_quickly():
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    lines += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]" for i in range(1, 9)]
    text = MINIMAL.replace("{name: mlp}", "{name: mlp, args: {" + ", ".join(lines) + "}}")
    assert "through a YAML alias" in round_error(text)


def test_a_round_config_over_256_kib_is_refused_before_it_is_parsed():
    text = MINIMAL + "# " + "x" * (4_500_000) + "\n"   # the reported 4.5 MB config timed the submit out
    assert round_error(text) == (f"job.yaml: the config is {len(text)} bytes, over the limit of 262144 bytes (256 KiB) "
                       "that is read at all; shorten it (fewer or shorter lists)")


def test_a_site_config_file_over_1_mib_is_refused_unread(tmp_path):
    path = write(tmp_path, DESIGN_SITE + "#" * (1 << 20), "site.yaml")
    with pytest.raises(ConfigError, match=r"site.yaml: the config is 1048\d+ bytes, over the limit of 1048576 bytes"):
        load_site_config(path)


_NUMBERS = ",".join(str(i) for i in range(4097))
_TOO_MANY = {
    "model.args.hidden": ("{name: mlp}", "{name: mlp, args: {hidden: [%s]}}" % _NUMBERS, "4097 items"),
    "data.label.classes": ("{dataset: heart}", "{dataset: heart, label: {column: y, classes: [%s]}}" % _NUMBERS,
                           "4097 items"),
    "data.features[0].categories": ("{dataset: heart}", "{dataset: heart, features: [{name: c, categories: [%s]}]}"
                                    % _NUMBERS, "4097 items"),
    "model.args": ("{name: mlp}", "{name: mlp, args: {%s}}" % ",".join(f"k{i}: 0" for i in range(4097)), "4097 keys"),
}


@pytest.mark.parametrize("where", sorted(_TOO_MANY))
def test_lists_and_mappings_over_4096_entries_are_refused_with_their_key_path(where):
    old, new, count = _TOO_MANY[where]
    message = round_error(MINIMAL.replace(old, new))
    assert re.match(rf"job\.yaml:\d: {re.escape(where)}: has {count}; at most 4096 are allowed, so list fewer$",
                    message)


def test_python_tags_are_never_constructed():
    message = round_error(MINIMAL.replace("{name: mlp}", "{name: mlp, args: {x: !!python/name:os.system ''}}"))
    assert "model.args.x: unsupported value" in message


def test_missing_file(tmp_path):
    path = tmp_path / "nope.yaml"
    with pytest.raises(ConfigError, match="nope.yaml") as info:
        load_round_config(path)
    assert str(path) in str(info.value)


def test_file_errors_name_the_file(tmp_path):
    path = write(tmp_path, "\n\n", "empty.yaml")
    with pytest.raises(ConfigError) as info:
        load_round_config(path)
    assert str(info.value).startswith(f"{path}:1: (top level): the document is empty")


# --- site config -------------------------------------------------------------

SITE = "site: cleveland\ncoordinator: coord.example.org:8443\nkit: kit\n"


def test_site_config_defaults(tmp_path):
    cfg = load_site_config(write(tmp_path, SITE, "site.yaml"))
    assert cfg.kit == tmp_path / "kit"
    assert cfg.state_dir == tmp_path / "state"
    assert cfg.datasets == {}
    assert cfg.policy == PolicySpec(allowed_models=(), require_secure_aggregation=False, max_epsilon=None)
    assert cfg.emulation is None   # off unless written


def test_site_emulation_slowdown(tmp_path):
    cfg = load_site_config(write(tmp_path, SITE + "emulation:\n  slowdown: 5\n", "site.yaml"))
    assert cfg.emulation == EmulationSpec(slowdown=5.0)
    assert load_site_config(write(tmp_path, SITE + "emulation: {slowdown: 1}\n", "one.yaml")).emulation.slowdown == 1.0


def test_site_paths_resolve_against_config_folder(tmp_path):
    text = SITE.replace("kit: kit", "kit: ../kits/site-a") + textwrap.dedent("""\
        state_dir: /var/lib/plexus
        datasets:
          local: {kind: npz, path: data/train.npz}
          absolute: {kind: csv, path: /srv/heart.csv, label: target, features: [age, sex]}
          heart: {kind: heart-disease, hospital: va, test_fraction: 0.25, split_seed: 7}
    """)
    folder = tmp_path / "conf"
    cfg = load_site_config(write(folder, text, "site.yaml"))
    assert cfg.kit == folder / ".." / "kits" / "site-a"
    assert cfg.state_dir == Path("/var/lib/plexus")
    assert cfg.datasets["local"].path == folder / "data" / "train.npz"
    assert cfg.datasets["absolute"].path == Path("/srv/heart.csv")
    assert cfg.datasets["absolute"].features == ("age", "sex")
    assert cfg.datasets["heart"] == DatasetSpec(
        kind="heart-disease", hospital="va", test_fraction=0.25, split_seed=7
    )
    assert cfg.datasets["local"].test_fraction == 0.34 and cfg.datasets["local"].split_seed == 43


def test_site_paths_resolve_when_loaded_by_relative_path(tmp_path, monkeypatch):
    write(tmp_path / "conf", SITE, "site.yaml")
    monkeypatch.chdir(tmp_path)
    assert load_site_config(Path("conf/site.yaml")).kit == tmp_path / "conf" / "kit"


@pytest.mark.parametrize(
    ("text", "prefix", "detail"),
    [
        (SITE.replace("cleveland", "Cleveland"), "1: site: 'Cleveland' is not a valid name", "lowercase"),
        (SITE.replace("cleveland", "a/b"), "1: site: 'a/b' is not a valid name", ""),
        (SITE.replace("coord.example.org:8443", "coord.example.org"),
         "2: coordinator: 'coord.example.org' is not host:port", "'[::1]:8443'"),
        (SITE.replace("coord.example.org:8443", "coord:70000"),
         "2: coordinator: port 70000 in 'coord:70000' is out of range", ""),
        (SITE.replace("coord.example.org:8443", "coord:0"),
         "2: coordinator: port 0 is out of range", "1..65535"),
        (SITE.replace("coord.example.org:8443", "'::1:8443'"), "2: coordinator:", "brackets"),
        (SITE.replace("kit: kit\n", ""), "1: kit: missing required key", "add 'kit:' with a path"),
        (SITE + "policy: {allowed_model: [mlp]}\n", "4: policy.allowed_model: unknown key",
         "allowed keys: allowed_datasets, allowed_models, max_epsilon, max_model_bytes, max_rounds, min_cell_count, "
         "min_dp_noise, min_secure_cohort, plugin_sha256, require_secure_aggregation"),
        (SITE + "policy:\n  allowed_models: mlp\n", "5: policy.allowed_models: expected a list", ""),
        (SITE + "policy:\n  allowed_models: [mlp, 3]\n", "5: policy.allowed_models[1]: expected a string", ""),
        (SITE + "policy: {max_epsilon: 0}\n", "4: policy.max_epsilon: 0.0 is out of range", ""),
        (SITE + "datasets:\n  heart:\n    kind: csv\n    label: target\n",
         "6: datasets.heart.path: required for kind 'csv' but not set", "add 'path: <file path>'"),
        (SITE + "datasets:\n  heart:\n    kind: csv\n    path: heart.csv\n    features: [age]\n",
         "8: datasets.heart.features: lists the columns a training job may use, and without `label` this file "
         "serves statistics jobs only", "add 'label: <label column>' to train on it, or remove `features`"),
        (SITE + "datasets:\n  arrays: {kind: npz}\n",
         "5: datasets.arrays.path: required for kind 'npz' but not set", "add 'path: <file path>'"),
        (SITE + "datasets:\n  heart: {kind: heart-disease}\n",
         "5: datasets.heart.hospital: required for kind 'heart-disease'", "cleveland, hungary, switzerland, va"),
        (SITE + "datasets:\n  heart:\n    kind: heart-disease\n    hospital: mars\n",
         "7: datasets.heart.hospital: 'mars' is not allowed", "use one of: cleveland, hungary, switzerland, va"),
        (SITE + "datasets:\n  heart: {kind: parquet, path: x}\n", "5: datasets.heart.kind: 'parquet' is not allowed",
         "csv, fashion-mnist, heart-disease, npz"),
        (SITE + "datasets:\n  h: {kind: csv, path: x, label: y, test_fraction: 1}\n",
         "5: datasets.h.test_fraction: 1.0 is out of range", "in (0, 1)"),
        (SITE + "datasets:\n  h: {kind: csv, path: x, label: y, features: []}\n",
         "5: datasets.h.features: is empty", ""),
        (SITE + "datasets: [heart]\n", "4: datasets: expected a mapping, got a list", ""),
        (SITE + "kit: other\n", "4: kit: duplicate key (first at line 3)", ""),
        (SITE + "emulation:\n  slowdown: 0.5\n", "5: emulation.slowdown: 0.5 is out of range; use a factor >= 1",
         "1 adds no wait"),
        (SITE + "emulation: {slowdown: 0}\n", "4: emulation.slowdown: 0.0 is out of range; use a factor >= 1", ""),
        (SITE + "emulation: {slowdown: 5000}\n", "4: emulation.slowdown: 5000.0 is out of range", "at most 1000"),
        (SITE + "emulation: {}\n", "4: emulation.slowdown: missing required key", ""),
        (SITE + "emulation: {slow: 2}\n", "4: emulation.slow: unknown key", "allowed keys: slowdown"),
        (SITE + "emulation: 5\n", "4: emulation: expected a mapping", "keys: slowdown"),
    ],
)
def test_site_config_errors(tmp_path, text, prefix, detail):
    message = site_error(tmp_path, text)
    assert message.startswith(prefix), message
    assert detail in message


# --- coordinator and admin configs -------------------------------------------


def test_coordinator_config_defaults_and_paths(tmp_path):
    cfg = load_coordinator_config(write(tmp_path, "listen: '0.0.0.0:0'\nkit: kits/coordinator\ncrl: ca.crl\n"))
    assert cfg == CoordinatorConfig(
        listen="0.0.0.0:0",
        kit=tmp_path / "kits" / "coordinator",
        state_dir=tmp_path / "state",
        crl=tmp_path / "ca.crl",
        poll_timeout_s=20.0,
        chunk_bytes=1048576,
        max_workers=128,
    )
    assert (cfg.stream_window_bytes, cfg.max_transfers) == (1 << 20, 4)
    assert (cfg.max_calls_per_identity, cfg.stream_idle_timeout_s) == (16, 30.0)
    assert (cfg.model_build_timeout_s, cfg.model_build_memory_bytes) == (300.0, 8 << 30)


def test_a_small_pool_takes_a_lower_per_identity_limit(tmp_path):
    cfg = load_coordinator_config(write(tmp_path, "listen: 'h:1'\nkit: k\nmax_workers: 8\nmax_calls_per_identity: 4\n"))
    assert (cfg.max_workers, cfg.max_calls_per_identity) == (8, 4)


def test_a_zero_stream_window_means_grpcs_adaptive_windows(tmp_path):
    cfg = load_coordinator_config(write(tmp_path, "listen: 'h:1'\nkit: k\nstream_window_bytes: 0\n"))
    assert cfg.stream_window_bytes == 0


@pytest.mark.parametrize(
    ("text", "prefix"),
    [
        ("listen: ':8443'\nkit: k\n", "1: listen: ':8443' is not host:port"),
        ("listen: '[::]:8443'\nkit: k\npoll_timeout_s: 301\n", "3: poll_timeout_s: 301.0 is out of range"),
        ("listen: 'h:1'\nkit: k\npoll_timeout_s: 0\n", "3: poll_timeout_s: 0.0 is out of range"),
        ("listen: 'h:1'\nkit: k\nchunk_bytes: 1024\n", "3: chunk_bytes: 1024 is out of range"),
        ("listen: 'h:1'\nkit: k\nmax_workers: 4097\n", "3: max_workers: 4097 is out of range"),
        ("listen: 'h:1'\nkit: k\nworkers: 8\n", "3: workers: unknown key"),
        ("listen: 'h:1'\nkit: k\nstream_window_bytes: 1000\n",
         "3: stream_window_bytes: 1000 is out of range; use 0 (gRPC's adaptive windows) or a size in [16384, "),
        ("listen: 'h:1'\nkit: k\nmax_transfers: 0\n", "3: max_transfers: 0 is out of range"),
        ("listen: 'h:1'\nkit: k\ncrl: ''\n", "3: crl: is empty"),
        ("listen: 'h:1'\nkit: k\nmax_workers: 16\n",
         "1: max_calls_per_identity: 16 is not below max_workers (16), so one certificate's idle calls could hold "
         "every worker thread; lower max_calls_per_identity (default 16) or raise max_workers"),
        ("listen: 'h:1'\nkit: k\nmax_calls_per_identity: 0\n", "3: max_calls_per_identity: 0 is out of range"),
        ("listen: 'h:1'\nkit: k\nstream_idle_timeout_s: 0\n", "3: stream_idle_timeout_s: 0.0 is out of range"),
        ("listen: 'h:1'\nkit: k\nmodel_build_timeout_s: 0\n", "3: model_build_timeout_s: 0.0 is out of range"),
        ("listen: 'h:1'\nkit: k\nmodel_build_memory_bytes: 1000000\n",
         "3: model_build_memory_bytes: 1000000 is out of range; use a value in [1073741824, 1099511627776]"),
    ],
)
def test_coordinator_config_errors(tmp_path, text, prefix):
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        load_coordinator_config(path)
    assert str(info.value).startswith(f"{path}:{prefix}"), str(info.value)


def test_admin_config(tmp_path):
    cfg = load_admin_config(write(tmp_path, "coordinator: '[::1]:8443'\nkit: /etc/plexus/admin\n"))
    assert cfg == AdminConfig(coordinator="[::1]:8443", kit=Path("/etc/plexus/admin"))
    with pytest.raises(ConfigError, match=r"2: kit: missing required key"):
        load_admin_config(write(tmp_path, "# admin\ncoordinator: 'h:443'\n", "bad.yaml"))


# --- split_address -----------------------------------------------------------


@pytest.mark.parametrize(
    ("addr", "expected"),
    [
        ("coordinator.example.org:8443", ("coordinator.example.org", 8443)),
        ("10.0.0.1:1", ("10.0.0.1", 1)),
        ("[::1]:8443", ("::1", 8443)),
        ("[::]:0", ("::", 0)),
        ("localhost:65535", ("localhost", 65535)),
    ],
)
def test_split_address(addr, expected):
    assert split_address(addr) == expected


@pytest.mark.parametrize(
    ("addr", "needle"),
    [
        ("localhost", "is not host:port"),
        (":8443", "is not host:port"),
        ("host:", "is not host:port"),
        ("host:http", "is not host:port"),
        ("host:-1", "is not host:port"),
        ("host:65536", "out of range"),
        ("::1:8443", "brackets"),
        ("[]:8443", "brackets"),
        ("my host:80", "invalid host"),
    ],
)
def test_split_address_rejects(addr, needle):
    with pytest.raises(ValueError, match=needle):
        split_address(addr)


# --- privacy: DP-SGD, distributed DP and the site policy's privacy rules ------


def test_dp_sgd_parsed_with_default_delta():
    cfg = parse_round_config(MINIMAL + "privacy: {dp_sgd: {noise_multiplier: 1.1, max_grad_norm: 1}}\n")
    assert cfg.privacy.dp_sgd == DPSGDSpec(noise_multiplier=1.1, max_grad_norm=1.0, delta=1e-5)
    assert parse_round_config(MINIMAL).privacy.dp_sgd is None


@pytest.mark.parametrize(("text", "prefix", "detail"), [
    ("privacy: {dp_sgd: {noise_multiplier: -1, max_grad_norm: 1}}\n",
     "job.yaml:5: privacy.dp_sgd.noise_multiplier: -1.0 is out of range",
     "use 0 (no noise) or a value in [1e-06, 1e+06]"),
    # the accountant divided by zero after the site had trained (1e-300) or overflowed (1e300)
    ("privacy: {dp_sgd: {noise_multiplier: 1.0e-300, max_grad_norm: 1}}\n",
     "job.yaml:5: privacy.dp_sgd.noise_multiplier: 1e-300 is out of range", "or a value in [1e-06, 1e+06]"),
    ("privacy: {dp: {mode: central, noise_multiplier: 1.0e+300, clip_norm: 1}}\n",
     "job.yaml:5: privacy.dp.noise_multiplier: 1e+300 is out of range", "or a value in [1e-06, 1e+06]"),
    ("privacy: {dp_sgd: {noise_multiplier: 1, max_grad_norm: 0}}\n",
     "job.yaml:5: privacy.dp_sgd.max_grad_norm: 0.0 is out of range", "> 0"),
    ("privacy: {dp_sgd: {noise_multiplier: 1, max_grad_norm: 1, delta: 1}}\n",
     "job.yaml:5: privacy.dp_sgd.delta: 1.0 is out of range", "in (0, 1)"),
    ("privacy: {dp_sgd: {noise_multiplier: 1}}\n",
     "job.yaml:5: privacy.dp_sgd.max_grad_norm: missing required key", "add 'max_grad_norm:'"),
    ("privacy:\n  dp: {mode: distributed, noise_multiplier: 1, clip_norm: 1}\n",
     "job.yaml:6: privacy.dp: mode 'distributed' needs secure_aggregation: true", "or use dp.mode: central"),
])
def test_privacy_errors(text, prefix, detail):
    with pytest.raises(ConfigError) as info:
        parse_round_config(MINIMAL + text, source="job.yaml")
    assert str(info.value).startswith(prefix), str(info.value)
    assert detail in str(info.value)


def test_distributed_dp_with_secure_aggregation_accepted():
    cfg = parse_round_config(MINIMAL + "sites: {min: 3}\nprivacy:\n  secure_aggregation: true\n"
                                       "  dp: {mode: distributed, noise_multiplier: 1, clip_norm: 1}\n")
    assert cfg.privacy.dp.mode == "distributed" and cfg.privacy.secure_aggregation


def test_site_policy_privacy_fields(tmp_path):
    digest = "ab" * 32
    cfg = load_site_config(write(tmp_path, SITE + f"""\
policy:
  allowed_models: [mlp, tiny]
  min_dp_noise: 0.8
  max_rounds: 50
  allowed_datasets: [heart-disease]
  plugin_sha256: {{tiny: {digest}}}
""", "site.yaml"))
    assert cfg.policy == PolicySpec(allowed_models=("mlp", "tiny"), min_dp_noise=0.8, max_rounds=50,
                                    allowed_datasets=("heart-disease",), plugin_sha256={"tiny": digest})
    defaults = load_site_config(write(tmp_path, SITE, "plain.yaml")).policy
    assert (defaults.min_dp_noise, defaults.max_rounds, defaults.allowed_datasets, defaults.plugin_sha256) == (
        None, None, None, {})


@pytest.mark.parametrize(("text", "prefix", "detail"), [
    ("policy: {min_dp_noise: -0.5}\n", "4: policy.min_dp_noise: -0.5 is out of range", ">= 0"),
    ("policy: {max_rounds: 0}\n", "4: policy.max_rounds: 0 is out of range", ">= 1"),
    ("policy: {allowed_datasets: heart}\n", "4: policy.allowed_datasets: expected a list", ""),
    ("policy:\n  plugin_sha256: {tiny: abc}\n", "5: policy.plugin_sha256: tiny: 'abc' is not a SHA-256 hex digest",
     "plexus site pin-model"),
    ("policy:\n  plugin_sha256: {tiny: 3}\n", "5: policy.plugin_sha256.tiny: expected a string", ""),
])
def test_site_policy_privacy_errors(tmp_path, text, prefix, detail):
    message = site_error(tmp_path, SITE + text)
    assert message.startswith(prefix), message
    assert detail in message


def test_strategy_args_are_typed_at_parse_and_dumped_as_written():
    from plexus.config import FedAdamArgs, strategy_args

    text = DESIGN_ROUND.replace("strategy: {name: fedavg}", "strategy: {name: fedadam, args: {tau: 1e-3, eta: 1}}")
    assert "fedadam" in text
    cfg = parse_round_config(text)
    assert strategy_args(cfg.strategy) == FedAdamArgs(eta=1.0, tau=1e-3)
    assert cfg.strategy.args == {"tau": "1e-3", "eta": 1}   # as written (YAML 1.1 reads plain 1e-3 as a string)
    dumped = dump_round_config(cfg)
    assert "typed" not in dumped and parse_round_config(dumped) == cfg
    assert strategy_args(parse_round_config(dumped).strategy) == strategy_args(cfg.strategy)


def test_strategy_args_are_not_a_yaml_key():
    text = DESIGN_ROUND.replace("strategy: {name: fedavg}", "strategy: {name: fedavg, typed: 1}")
    with pytest.raises(ConfigError, match=r":\d+: strategy.typed: unknown key; allowed keys: args, name"):
        parse_round_config(text)


# --- the asynchronous block ---------------------------------------------------


@pytest.mark.parametrize(
    ("text", "prefix", "detail"),
    [
        (MINIMAL + "asynchronous: {bufer: 2}\n", "job.yaml:5: asynchronous.bufer: unknown key",
         "did you mean 'buffer'"),
        (MINIMAL + "asynchronous:\n  buffer: 0\n", "job.yaml:6: asynchronous.buffer: 0 is out of range",
         "use a value in [1, 10000]"),
        (MINIMAL + "asynchronous:\n  staleness: {fn: exponential}\n", "job.yaml:6: asynchronous.staleness.fn:",
         "polynomial"),
        (MINIMAL + "asynchronous:\n  max_staleness: -1\n", "job.yaml:6: asynchronous.max_staleness: -1 is out of range",
         "[0, 10000]"),
        (MINIMAL + "asynchronous: {buffer: 2, mixing: 0.5}\n", "job.yaml:5: asynchronous:", "set buffer: 1"),
        (MINIMAL + "asynchronous: {}\nstrategy: {name: krum}\n", "job.yaml:6: strategy:", "cannot run asynchronously"),
        (MINIMAL + "asynchronous: {}\nsites: {fraction: 0.5}\n", "job.yaml:6: sites:", "every idle site trains"),
        (MINIMAL + "asynchronous: {buffer: 2}\nsites: {min: 3}\nprivacy: {secure_aggregation: true}\n",
         "job.yaml:5: asynchronous:", "set buffer to 3 or more"),
        (MINIMAL + "asynchronous: {buffer: 3}\nsites: {min: 4}\nprivacy: {secure_aggregation: true}\n",
         "job.yaml:6: sites:", "set sites.min to at most 3"),
        (MINIMAL + "asynchronous: {buffer: 3, max_per_buffer: 2}\nsites: {min: 3}\n"
         "privacy: {secure_aggregation: true}\n", "job.yaml:5: asynchronous:", "a site takes part once"),
        (MINIMAL + "asynchronous: {max_per_buffer: 2}\n"
         "privacy: {dp: {mode: central, noise_multiplier: 1.0, clip_norm: 1.0}}\n",
         "job.yaml:5: asynchronous:", "set max_per_buffer: 1"),
        (MINIMAL + "asynchronous:\n  target: {value: 0.8}\n", "job.yaml:6: asynchronous.target", "metric"),
    ],
)
def test_asynchronous_config_errors(text, prefix, detail):
    message = round_error(text)
    assert message.startswith(prefix), message
    assert detail in message, message


def test_an_asynchronous_block_round_trips_and_a_synchronous_config_dumps_without_it():
    cfg = parse_round_config(MINIMAL + "asynchronous:\n  buffer: 4\n  staleness: {fn: hinge, a: 10, b: 2}\n"
                             "  target: {metric: accuracy, value: 0.8}\n")
    assert cfg.asynchronous.buffer == 4 and cfg.asynchronous.staleness.fn == "hinge"
    assert parse_round_config(dump_round_config(cfg)) == cfg
    assert "asynchronous" not in dump_round_config(parse_round_config(MINIMAL))


# --- the compression block ---------------------------------------------------


@pytest.mark.parametrize(
    ("text", "prefix", "detail"),
    [
        (MINIMAL + "compression: {uplink: {codec: zip}}\n", "job.yaml:5: compression.uplink.codec:", "topk"),
        (MINIMAL + "compression:\n  uplink: {codec: int8, fraction: 0.1}\n", "job.yaml:6: compression.uplink.fraction:",
         "only topk and randk"),
        (MINIMAL + "compression:\n  uplink: {codec: topk}\n", "job.yaml:6: compression.uplink.codec:",
         "exactly one of fraction"),
        (MINIMAL + "compression:\n  uplink: {codec: randk, fraction: 0.1, k: 5}\n", "job.yaml:6: compression.uplink",
         "exactly one of fraction"),
        (MINIMAL + "compression:\n  uplink: {codec: topk, fraction: 0}\n", "job.yaml:6: compression.uplink.fraction:",
         "out of range"),
        (MINIMAL + "compression:\n  uplink: {codec: int8, block: 8}\n", "job.yaml:6: compression.uplink.block:",
         "out of range"),
        (MINIMAL + "compression:\n  uplink: {codec: adacomp, error_feedback: false}\n",
         "job.yaml:6: compression.uplink.error_feedback:", "only topk and randk"),
        (MINIMAL + "compression:\n  downlink: {codec: fp16, block: 64}\n", "job.yaml:6: compression.downlink.block:",
         "only delta8"),
        (MINIMAL + "compression:\n  downlink: {codec: delta2}\n", "job.yaml:6: compression.downlink.codec:",
         "delta4"),
        (MINIMAL + "compression:\n  uplink: {codec: int4, fraction: 0.1}\n", "job.yaml:6: compression.uplink.fraction:",
         "codec 'int4' does not take fraction (only topk and randk do); remove it"),
        (MINIMAL + "compression:\n  uplink: {codec: int4, block: 70000}\n", "job.yaml:6: compression.uplink.block:",
         "out of range"),
        (MINIMAL + "compression:\n  uplink: {codec: fp16, block: 64}\n", "job.yaml:6: compression.uplink.block:",
         "codec 'fp16' does not take block (only int8 and int4 do); remove it"),
        (MINIMAL + "compression:\n  downlink: {codec: none, block: 64}\n", "job.yaml:6: compression.downlink.block:",
         "codec 'none' does not take block (only delta8 and delta4 do); remove it"),
        (MINIMAL + "compression:\n  downlink: {codec: delta4, block: 8}\n", "job.yaml:6: compression.downlink.block:",
         "out of range"),
        (MINIMAL + "compression: {uplink: {codec: int4}}\nsites: {min: 3}\nprivacy: {secure_aggregation: true}\n",
         "job.yaml:5: compression:", "uplink codec 'int4' cannot be masked: a 4-bit field leaves no room for a sum "
         "over sites (its 7 levels a side, less one for each site summed, are fewer than the 16 a public grid needs "
         "even for one site); under privacy.secure_aggregation use int8, fp16 or randk"),
        (MINIMAL + "compression: {uplink: {codec: int4, block: 64}}\nstrategy: {name: krum}\n",
         "job.yaml:5: compression:", "judge each site's whole update"),
        (MINIMAL + "compression: {downlink: {codec: delta4}}\nasynchronous: {buffer: 2}\n",
         "job.yaml:5: compression:", "asynchronous jobs do not take compression yet"),
        (MINIMAL + "compression: {uplink: {codec: topk, k: 10}}\nsites: {min: 3}\n"
         "privacy: {secure_aggregation: true}\n",
         "job.yaml:5: compression:", "use randk"),
        (MINIMAL + "compression: {uplink: {codec: adacomp}}\nsites: {min: 3}\n"
         "privacy: {secure_aggregation: true}\n",
         "job.yaml:5: compression:", "same coordinates at every site"),
        (MINIMAL + "compression: {uplink: {codec: int8}}\nstrategy: {name: krum}\n", "job.yaml:5: compression:",
         "judge each site's whole update"),
        (MINIMAL + "compression: {uplink: {codec: int8}}\nstrategy: {name: scaffold}\n", "job.yaml:5: compression:",
         "Δc"),
        (MINIMAL + "compression: {downlink: {codec: fp16}}\nasynchronous: {buffer: 2}\n", "job.yaml:5: compression:",
         "asynchronous jobs do not take compression yet"),
        (MINIMAL + "compression: {uplink: {codec: randk, k: 3, error_feedback: true}}\nsites: {min: 3}\n"
         "privacy: {secure_aggregation: true}\n", "job.yaml:5: compression:", "without error feedback"),
        (MINIMAL + "compression: {uplink: {codec: int8, block: 64}}\nsites: {min: 3}\n"
         "privacy: {secure_aggregation: true}\n", "job.yaml:5: compression:", "no per-block scales"),
        (MINIMAL + "compression: {uplink: {codec: int8}}\nsites: {min: 112}\nprivacy: {secure_aggregation: true}\n",
         "job.yaml:6: sites:", "at most 111 sites per round"),
        (MINIMAL + "compression: {uplink: {codec: int8}}\nsites: {min: 3, count: 200}\n"
         "privacy: {secure_aggregation: true}\n", "job.yaml:6: sites:", "set sites.count to 111 or fewer, or use fp16"),
    ],
)
def test_compression_config_errors(text, prefix, detail):
    message = round_error(text)
    assert message.startswith(prefix), message
    assert detail in message, message


def test_a_compression_block_round_trips_and_a_config_without_it_dumps_without_it():
    cfg = parse_round_config(MINIMAL + "compression:\n  uplink: {codec: topk, fraction: 0.01}\n"
                             "  downlink: {codec: delta8, block: 128}\n")
    assert (cfg.compression.uplink.codec, cfg.compression.uplink.fraction) == ("topk", 0.01)
    assert cfg.compression.uplink.k is None and cfg.compression.uplink.error_feedback is None
    assert (cfg.compression.downlink.codec, cfg.compression.downlink.block) == ("delta8", 128)
    assert parse_round_config(dump_round_config(cfg)) == cfg
    assert "compression" not in dump_round_config(parse_round_config(MINIMAL))
    # secure aggregation takes the codecs whose coordinates every site shares
    for codec in ("int8", "fp16", "randk, k: 3", "randk, k: 3, error_feedback: false"):
        ok = parse_round_config(MINIMAL + f"compression: {{uplink: {{codec: {codec}}}}}\nsites: {{min: 3}}\n"
                                "privacy: {secure_aggregation: true}\n")
        assert ok.privacy.secure_aggregation
    cfg = parse_round_config(MINIMAL + "compression:\n  uplink: {codec: int4, block: 64}\n"
                             "  downlink: {codec: delta4, block: 128}\n")
    assert (cfg.compression.uplink.codec, cfg.compression.uplink.block) == ("int4", 64)
    assert (cfg.compression.downlink.codec, cfg.compression.downlink.block) == ("delta4", 128)
    assert parse_round_config(dump_round_config(cfg)) == cfg
    assert parse_round_config(MINIMAL + "compression: {uplink: {codec: int4}, downlink: {codec: delta4}}\n"
                              "sites: {min: 200}\n").compression.uplink.block is None   # the codec's default
    # a compressed downlink goes with secure aggregation whatever it is: it is no masked input
    assert parse_round_config(MINIMAL + "compression: {uplink: {codec: int8}, downlink: {codec: delta4}}\n"
                              "sites: {min: 3}\nprivacy: {secure_aggregation: true}\n").privacy.secure_aggregation
    # without secure aggregation nothing bounds an int8 job's sites
    assert parse_round_config(MINIMAL + "compression: {uplink: {codec: int8}}\nsites: {min: 200}\n").sites.min == 200
