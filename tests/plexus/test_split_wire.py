"""Split learning's wire tensors: each side reads a TensorData through array_of, which refuses a dtype, shape or
byte count that is off and anything not finite; a site's parts come whole and only under their own names."""

from __future__ import annotations

import re

import numpy as np
import pytest

from plexus.config import parse_round_config
from plexus.errors import ConfigError, IntegrityError
from plexus.proto.plexus.v1 import federation_pb2 as fpb
from plexus.split_wire import array_of, tensor_message, weights_of


def test_a_tensor_round_trips_exactly():
    a = np.random.default_rng(0).normal(size=(4, 3, 2)).astype(np.float32)
    back = array_of(tensor_message(a), dtype="F32", what="x", shape=(4, 3, 2))
    assert back.dtype == np.float32 and back.tobytes() == a.tobytes()
    labels = array_of(tensor_message(np.array([0, 1, 1])), dtype="I64", what="y", shape=(3,))
    assert labels.tolist() == [0, 1, 1]


@pytest.mark.parametrize("message,kwargs,error", [
    (tensor_message(np.zeros((2, 3), np.int64)), {}, "dtype 'I64', expected F32"),
    (tensor_message(np.zeros((2, 3), np.float32)), {"shape": (2, 4)}, "shape [2, 3], expected [2, 4]"),
    (tensor_message(np.zeros((9, 3), np.float32)), {"rows": (1, 8)}, "9 rows, expected 1 to 8"),
    (fpb.TensorData(dtype="F32", shape=[2, 3], data=b"\0" * 20), {}, "20 bytes of data for shape [2, 3]"),
    (fpb.TensorData(dtype="F32", shape=[], data=b""), {}, "is not a tensor"),
    (fpb.TensorData(dtype="F32", shape=[2, -3], data=b""), {}, "is not a tensor"),
    (fpb.TensorData(dtype="F32", shape=[2**32, 2**32], data=b""), {}, "0 bytes of data for shape [4294967296, "),
    (tensor_message(np.array([[1.0, np.nan]], np.float32)), {}, "NaN or Inf"),
    (tensor_message(np.array([[np.inf]], np.float32)), {}, "NaN or Inf"),
])
def test_malformed_tensors_are_refused(message, kwargs, error):
    with pytest.raises(IntegrityError, match=re.escape(error)):
        array_of(message, dtype="F32", what="x", **kwargs)


def test_a_site_s_parts_come_whole_under_their_names():
    shapes = {"w": (2, 2), "b": (2,)}
    ok = [tensor_message(np.ones((2, 2), np.float32), "w"), tensor_message(np.zeros(2, np.float32), "b")]
    assert sorted(weights_of(ok, shapes, what="parts")) == ["b", "w"]
    for bad, error in ((ok[:1], "missing b"), (ok + ok[:1], "'w' is sent twice"),
                       (ok + [tensor_message(np.zeros(1, np.float32), "server.w")], "'server.w' is not a tensor"),
                       ([ok[0], tensor_message(np.zeros(3, np.float32), "b")], "shape [3], expected [2]")):
        with pytest.raises(IntegrityError, match=re.escape(error)):
            weights_of(bad, shapes, what="parts")


BASE = """\
name: s
model: {name: mlp, args: {in_features: 13, hidden: [32, 16]}}
data: {dataset: heart-disease}
rounds: 2
"""


@pytest.mark.parametrize("extra,error", [
    ("mode: split\n", "mode: is split, and the job has no `split:` block"),
    ("split: {variant: vanilla, cuts: [hidden1]}\n", "split: configures split learning, but mode is federated"),
    ("mode: split\nsplit: {variant: vanilla, cuts: [hidden1, hidden2]}\n", "a vanilla split takes 1"),
    ("mode: split\nsplit: {variant: u-shaped, cuts: [hidden1]}\n", "a u-shaped split takes 2"),
    ("mode: split\nsplit: {variant: sideways, cuts: [hidden1]}\n", "variant"),
    ("mode: split\nsplit: {variant: vanilla, cuts: [hidden1]}\nstrategy: {name: fedprox, args: {mu: 0.1}}\n",
     "a split job has no updates for a server rule"),
    ("mode: split\nsplit: {variant: vanilla, cuts: [hidden1]}\nprivacy: {secure_aggregation: true}\n",
     "a split job's site sends activations"),
    ("mode: split\nsplit: {variant: vanilla, cuts: [hidden1]}\ntrain: {epochs: 3}\n", "set `rounds` to the number"),
    ("mode: split\nsplit: {variant: vanilla, cuts: [hidden1]}\ntrain: {optimizer: {name: adam}}\n",
     "step with SGD"),
    ("mode: split\nsplit: {variant: vanilla, cuts: [hidden1]}\nsites: {fraction: 0.5}\n",
     "every online site takes part"),
    ("mode: split\nsplit: {variant: vanilla, cuts: [hidden1], logit_adjustment: 1}\n",
     "split.logit_adjustment: applies to u-shaped splits"),
    ("mode: split\nsplit: {variant: u-shaped, cuts: [hidden1, hidden2], logit_adjustment: -1}\n",
     "logit_adjustment"),
])
def test_split_configs_that_cannot_work_are_refused_with_the_fix(extra, error):
    with pytest.raises(ConfigError, match=re.escape(error)):
        parse_round_config(BASE + extra)
