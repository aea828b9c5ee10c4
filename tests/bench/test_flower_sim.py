"""bench.flower_sim's bookkeeping (no Flower needed): round stamps, client fit times, the run log, the CPU
accounting, and that the Flower app's CNN is Plexus' `cnn` layer for layer."""

from __future__ import annotations

import json

import pytest

from bench.flower_sim import _client_times, _config_args, _cpu_share, _read_run_log, _stamps, contention


def _lines(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def test_config_args_quote_strings_only():
    assert _config_args({"task": "fmnist", "num-server-rounds": 20, "lr": 0.05, "data-dir": "/tmp/x y"}) == \
        'task="fmnist" num-server-rounds=20 lr=0.05 data-dir="/tmp/x y"'


def test_client_times_split_each_round_into_fits_and_the_rest(tmp_path):
    stamps = tmp_path / "stamps.jsonl"
    _lines(stamps, [{"round": 0, "t": 100.0}, {"round": 1, "t": 110.0}, {"round": 2, "t": 113.0},
                    {"round": 3, "t": 117.0}])
    fits = tmp_path / "clients.jsonl"
    # Two clients a round, one after the other (one actor): round, first start, each fit's length.
    rounds = ((1, 104.0, 2.0), (2, 110.5, 1.0), (3, 113.5, 1.5))
    _lines(fits, [{"round": r, "partition": p, "start": s0 + p * d, "end": s0 + (p + 1) * d, "pid": 7}
                  for r, s0, d in rounds for p in (0, 1)])
    out = _client_times(fits, _stamps(stamps))
    assert out["actor_pids"] == [7]
    assert [row["fits"] for row in out["per_round"]] == [2, 2, 2]
    assert [row["fit_sum_s"] for row in out["per_round"]] == [4.0, 2.0, 3.0]
    assert [row["outside_fits_s"] for row in out["per_round"]] == [6.0, 1.0, 1.0]
    assert out["median_fit_sum_s"] == 2.5 and out["median_outside_fits_s"] == 1.0   # rounds 2..R only


def test_client_times_without_a_log(tmp_path):
    assert _client_times(tmp_path / "missing.jsonl", {}) == {}


def test_run_log_counts_replies_and_keeps_each_warning_once(tmp_path):
    log = tmp_path / "flwr-run.log"
    log.write_text("\x1b[92mINFO \x1b[0m:      aggregate_train: Received 8 results and 0 failures\n"
                   "\x1b[93mWARNING \x1b[0m:   careful\n"
                   "\x1b[92mINFO \x1b[0m:      aggregate_train: Received 7 results and 1 failures\n"
                   "\x1b[93mWARNING \x1b[0m:   careful\n")
    assert _read_run_log(log) == {"replies_failures_per_round": [[8, 0], [7, 1]], "warnings": ["WARNING :   careful"]}


def test_cpu_share_and_contention():
    spent = _cpu_share([0] * 8, [100, 50, 50, 200, 0, 0, 0, 0])   # ticks: user nice system idle ...
    assert spent["busy_share"] == pytest.approx(0.5)
    case = {"cpu_s": {"other_processes": 3.0, "cores_x_wall": 30.0}}
    assert contention(case) == pytest.approx(0.1)
    assert contention({}) == 0.0


def test_the_flower_apps_cnn_is_plexus_cnn():
    torch = pytest.importorskip("torch")
    from bench.flower_sim_app.plexussim.cnn import CNN
    from plexus.models import build_model

    ours, plexus = CNN(width=16), build_model("cnn", {"width": 16}, seed=0)
    shapes = [[(k, v.shape) for k, v in m.state_dict().items()] for m in (ours, plexus)]
    assert shapes[0] == shapes[1]
    ours.load_state_dict(plexus.state_dict())
    x = torch.rand(3, 1, 28, 28)
    assert torch.equal(ours(x), plexus(x))
