"""Split learning's compute worker: the server part in its own process, over framed pipes (raw tensor bytes, no
JSON for tensors, no pickle), gives what plexus.split's ServerStep gives in process; malformed batches are
refused and the worker goes on; the coordinator's side never imports torch."""

from __future__ import annotations

import io
import os
import shlex
import shutil
import signal
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from coordinator.split_worker import SHM_DIR, Segment, SplitWorker, read_frame, write_frame
from plexus.errors import ConfigError, IntegrityError
from plexus.models import build_model
from plexus.split import ServerStep, split

from integration.harness import wait_until

ROOT = str(Path(__file__).resolve().parents[2])

MLP = {"in_features": 13, "hidden": [32, 16]}


@pytest.fixture(scope="module", params=[True, False], ids=["shared-memory", "pipe"])
def worker(request):   # one process per transport; every test `load`s its own model into it
    w = SplitWorker(shared_memory=request.param)
    yield w
    w.close()


def load(worker, variant, cuts, row_shape):
    worker.call("load", model="mlp", args=MLP, seed=3, variant=variant, cuts=cuts,
                max_rows=256, lr=0.1)
    parts = split(build_model("mlp", MLP, seed=3), variant, cuts)
    return parts, ServerStep(parts, torch.optim.SGD(parts.middle.parameters(), lr=0.1))


def batch(rows=16, width=32, seed=0):
    g = np.random.default_rng(seed)
    return g.normal(size=(rows, width)).astype(np.float32), g.integers(0, 2, rows)


def test_vanilla_batches_through_the_worker_match_the_server_step_in_process(worker):
    _, local = load(worker, "vanilla", ["hidden1"], [32])
    for seed in range(3):   # the optimizer steps carry over from batch to batch, on both sides
        a, y = batch(seed=seed)
        header, (grad,) = worker.call("vanilla", [a, y])
        expected, loss = local.vanilla(torch.from_numpy(a), torch.from_numpy(y))
        assert header["loss"] == pytest.approx(loss, rel=1e-6)
        np.testing.assert_allclose(grad, expected.numpy(), rtol=1e-5, atol=1e-7)
        assert worker.compute_s > 0


def test_u_shaped_forward_and_backward_through_the_worker(worker):
    _, local = load(worker, "u-shaped", ["hidden1", "hidden2"], [32])
    a, _ = batch()
    _, (out,) = worker.call("forward", [a])
    np.testing.assert_allclose(out, local.forward(torch.from_numpy(a)).numpy(), rtol=1e-5, atol=1e-7)
    g = np.random.default_rng(1).normal(size=out.shape).astype(np.float32)
    _, (grad,) = worker.call("backward", [g])
    np.testing.assert_allclose(grad, local.backward(torch.from_numpy(g)).numpy(), rtol=1e-5, atol=1e-7)


def test_malformed_batches_are_refused_and_the_worker_goes_on(worker):
    load(worker, "vanilla", ["hidden1"], [32])
    a, y = batch()
    bad = [([a[:, :31], y], "activations of shape"), ([a.astype(np.float64), y], None),
           ([np.where(np.arange(a.size).reshape(a.shape) == 5, np.nan, a).astype(np.float32), y], "NaN or Inf"),
           ([a, y + 5], "class indices"), ([a, y[:3]], "class indices"),
           ([np.zeros((300, 32), np.float32), np.zeros(300, np.int64)], "1 <= n <= 256")]
    for tensors, message in bad:
        if message is None:   # float64 travels as float32 frames: the worker sees float32 and takes it
            worker.call("vanilla", tensors)
            continue
        with pytest.raises(IntegrityError, match=message):
            worker.call("vanilla", tensors)
    header, _ = worker.call("vanilla", [a, y])
    assert np.isfinite(header["loss"])


def test_the_server_part_s_state_round_trips(worker):
    load(worker, "vanilla", ["hidden1"], [32])
    header, tensors = worker.call("state")
    # the middle (Linear, ReLU, Linear) under the whole model's names, as checkpoints keep them
    assert header["names"] == ["layers.2.bias", "layers.2.weight", "layers.4.bias", "layers.4.weight"]
    worker.call("vanilla", list(batch()))
    _, changed = worker.call("state")
    assert any(not np.array_equal(a, b) for a, b in zip(tensors, changed))
    worker.call("load_state", tensors, names=header["names"])
    _, back = worker.call("state")
    assert all(np.array_equal(a, b) for a, b in zip(tensors, back))


def test_a_state_larger_than_the_shared_segment_comes_back_through_the_pipe():
    w = SplitWorker()
    try:
        w.call("load", model="mlp", args={"in_features": 13, "hidden": [8, 100_000]}, seed=0, variant="vanilla",
               cuts=["hidden1"])
        header, tensors = w.call("state")   # 1.1M floats: beyond the 1 MiB segment, so through the pipe
        assert sum(t.nbytes for t in tensors) == 4 * (8 * 100_000 + 100_000 + 100_000 * 2 + 2)
        assert header["names"] == ["layers.2.bias", "layers.2.weight", "layers.4.bias", "layers.4.weight"]
    finally:
        w.close()
    assert not list(SHM_DIR.glob(f"plexus-split-{os.getpid()}-*"))


def test_the_segment_has_no_name_once_the_worker_holds_it_so_a_killed_coordinator_leaves_none():
    """A coordinator SIGKILLed mid-job (no close) leaves nothing in /dev/shm, and its worker ends on its own."""
    code = (
        "import os, sys, time\n"
        "import numpy as np\n"
        "from coordinator.split_worker import SHM_DIR, Segment, SplitWorker, read_frame, write_frame\n"
        "w = SplitWorker()\n"
        "header, _ = w.call('load', model='cnn', args={'width': 16}, seed=0, variant='vanilla', cuts=['block1'])\n"
        "for rows in (2, 64):   # the second batch outgrows the first segment: a new one\n"
        "    w.call('vanilla', [np.zeros((rows, *header['row_shape']), np.float32), np.zeros(rows, np.int64)])\n"
        "print(w.pid, len(list(SHM_DIR.glob(f'plexus-split-{os.getpid()}-*'))), flush=True)\n"
        "time.sleep(60)\n")
    coordinator = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        worker_pid, named = map(int, coordinator.stdout.readline().split())
        assert named == 0   # in use by both processes, yet unlinked
        os.kill(coordinator.pid, signal.SIGKILL)
        coordinator.wait(timeout=10)
        assert not list(SHM_DIR.glob(f"plexus-split-{coordinator.pid}-*"))
        wait_until(lambda: not _alive(worker_pid), 10, "the orphaned worker to end")
    finally:
        if coordinator.poll() is None:
            coordinator.kill()
        coordinator.stdout.close()


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


SMALL_SHM = """
import logging, sys
import numpy as np
from coordinator.split_worker import SplitWorker
logging.basicConfig(stream=sys.stderr, level=logging.WARNING)
batch = [np.random.default_rng(0).normal(size=(64, 16, 14, 14)).astype(np.float32), np.arange(64) % 10]
grads = []
for shared in (True, False):
    w = SplitWorker(shared_memory=shared)
    w.call('load', model='cnn', args={'width': 16}, seed=0, variant='vanilla', cuts=['block1'], lr=0.1)
    _, (grad,) = w.call('vanilla', batch)
    grads.append(grad)
    if shared:
        print('shared after the batch:', w._shared)
    w.close()
print('same gradient:', grads[0].tobytes() == grads[1].tobytes())
"""


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None,
                    reason="mounts a small /dev/shm in a mount namespace of its own: needs root and unshare")
def test_a_dev_shm_too_small_for_the_segment_falls_back_to_the_pipe_with_a_warning():
    """As in a container with docker's default 64 MB /dev/shm and a large batch: here a 512 KiB /dev/shm, a 0.8 MB
    batch and a 3.2 MB segment. Without the fallback the coordinator died of SIGBUS at its first write past the
    space."""
    python = f"{shlex.quote(sys.executable)} -c {shlex.quote(SMALL_SHM)}"
    script = f"mount -t tmpfs -o size=512k tmpfs /dev/shm && exec {python}"
    run = subprocess.run(["unshare", "-m", "sh", "-c", script], capture_output=True, text=True, timeout=120,
                         cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT))
    assert run.returncode == 0, run.stderr[-2000:]
    assert "shared after the batch: False" in run.stdout and "same gradient: True" in run.stdout, run.stdout
    assert "takes its tensors through its pipe from now on" in run.stderr and "No space left" in run.stderr, \
        run.stderr[-2000:]


def test_load_names_each_side_s_tensors_and_the_shapes_at_the_cuts():
    w = SplitWorker()
    try:
        header, _ = w.call("load", model="cnn", args={}, seed=0, variant="u-shaped", cuts=["block1", "features"])
        assert header["site"] == ["features.0.bias", "features.0.weight", "head.bias", "head.weight"]
        assert header["server"] == ["features.3.bias", "features.3.weight"]
        assert header["row_shape"] == [16, 14, 14] and header["out_shape"] == [1568] and header["classes"] == 10
        with pytest.raises(ConfigError, match="not among this model's: block1, block2, features"):
            w.call("load", model="cnn", args={}, seed=0, variant="vanilla", cuts=["block3"])
    finally:
        w.close()


def test_evaluation_ops_leave_the_server_part_unchanged(worker):
    load(worker, "vanilla", ["hidden1"], [32])
    _, before = worker.call("state")
    a, y = batch()
    header, _ = worker.call("evaluate", [a, y])
    assert header["loss"] > 0 and 0 <= header["correct"] <= len(y)
    _, after = worker.call("state")
    assert all(np.array_equal(p, q) for p, q in zip(before, after))


def test_a_gradient_of_the_wrong_shape_or_without_a_forward_is_refused(worker):
    load(worker, "u-shaped", ["hidden1", "hidden2"], [32])
    a, _ = batch()
    with pytest.raises(IntegrityError, match="did not run forward"):
        worker.call("backward", [np.zeros((16, 16), np.float32)])
    _, (out,) = worker.call("forward", [a])
    with pytest.raises(IntegrityError, match="must be float32"):
        worker.call("backward", [np.zeros((16, 15), np.float32)])
    _, (grad,) = worker.call("backward", [np.ones_like(out)])
    assert grad.shape == a.shape


def test_the_server_optimizer_s_momentum_round_trips(worker):
    def fresh():
        worker.call("load", model="mlp", args=MLP, seed=3, variant="vanilla", cuts=["hidden1"], lr=0.1, momentum=0.9)

    fresh()
    worker.call("vanilla", list(batch(seed=0)))
    header, buffers = worker.call("optimizer")
    assert header["names"] == ["momentum/layers.2.bias", "momentum/layers.2.weight", "momentum/layers.4.bias",
                               "momentum/layers.4.weight"]
    names, state = worker.call("state")
    worker.call("vanilla", list(batch(seed=1)))
    _, expected = worker.call("state")   # after a step that used the momentum of the first
    for momentum in (False, True):   # as after a restart: the checkpointed part (and its momentum) put back
        fresh()
        worker.call("load_state", state, names=names["names"])
        if momentum:
            worker.call("load_optimizer", buffers, names=header["names"])
        worker.call("vanilla", list(batch(seed=1)))
        _, again = worker.call("state")
        assert all(np.array_equal(a, b) for a, b in zip(again, expected)) == momentum
    with pytest.raises(IntegrityError, match="no momentum buffer"):
        worker.call("load_optimizer", buffers[:1], names=["momentum/layers.0.weight"])


def test_the_shared_segment_grows_for_a_larger_batch(worker):
    """The request's views into the segment are gone by the time a larger batch replaces it (a 2-row batch, then a
    32-row one of Fashion-MNIST-sized activations: 1.6 MB, beyond the first 1 MiB segment)."""
    header, _ = worker.call("load", model="cnn", args={"width": 16}, seed=0, variant="vanilla", cuts=["block1"])
    for rows in (2, 32, 64, 8):
        _, (grad,) = worker.call("vanilla", [np.zeros((rows, *header["row_shape"]), np.float32),
                                             np.zeros(rows, np.int64)])
        assert grad.shape == (rows, *header["row_shape"])


def test_the_coordinator_side_never_imports_torch():
    code = "import sys, coordinator.split_worker; print('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip() \
        == "False"


def test_a_forward_s_activations_stay_in_place_while_other_calls_use_the_segment(worker):
    """In shared memory the worker computes a forward on its activations where they lie, in the segment's upper
    half, until their backward; requests and replies in between keep to the lower half. Were they anywhere else, the
    `infer` between them would overwrite them and the backward's gradients would be wrong."""
    _, local = load(worker, "u-shaped", ["hidden1", "hidden2"], [32])
    a, _ = batch(seed=4)
    _, (out,) = worker.call("forward", [a])
    expected_out = local.forward(torch.from_numpy(a)).numpy()
    other, _ = batch(rows=64, seed=5)
    worker.call("infer", [other])
    worker.call("infer", [other[:7]])
    g = np.random.default_rng(6).normal(size=out.shape).astype(np.float32)
    _, (grad,) = worker.call("backward", [g])
    np.testing.assert_allclose(out, expected_out, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(grad, local.backward(torch.from_numpy(g)).numpy(), rtol=1e-5, atol=1e-7)
    # The step: its first layer's weight gradient is the activations' (the gradient at the cut is not).
    header, state = worker.call("state")
    mine = {local.parts.names[id(p)]: p.detach().numpy() for p in local.parts.middle.parameters()}
    assert sorted(mine) == header["names"]
    for name, tensor in zip(header["names"], state):
        np.testing.assert_allclose(tensor, mine[name], rtol=1e-5, atol=1e-7, err_msg=name)


def _affinity(pid: int) -> set[int]:
    return os.sched_getaffinity(pid)


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="one CPU: nothing to hold the worker to")
def test_a_single_threaded_worker_is_held_to_its_caller_s_cpu_and_the_caller_gets_its_cpus_back():
    mine = _affinity(0)
    held, free = SplitWorker(), SplitWorker(colocate=False)
    threaded = SplitWorker()
    try:
        for w in (held, free, threaded):
            w.call("load", model="mlp", args=MLP, seed=3, variant="vanilla", cuts=["hidden1"],
                   threads=2 if w is threaded else 1)
            w.call("vanilla", list(batch()))
        assert len(_affinity(held.pid)) == 1 and _affinity(held.pid) <= mine   # the CPU its caller was on
        assert _affinity(free.pid) == mine and _affinity(threaded.pid) == mine   # never held
        assert _affinity(0) == mine   # the calling thread, after each call
        # A caller on another CPU takes the worker with it.
        for cpu in sorted(mine)[:2]:
            os.sched_setaffinity(0, {cpu})
            try:
                held.call("vanilla", list(batch()))
            finally:
                os.sched_setaffinity(0, mine)
            assert _affinity(held.pid) == {cpu}
    finally:
        for w in (held, free, threaded):
            w.close()


def _frame(header, tensors=(), shm=None, at=0):
    out = io.BytesIO()
    write_frame(out, header, tensors, shm, at=at)
    return out.getvalue()


@pytest.mark.parametrize("header", [{"op": "forward"}, {"op": "vanilla", "compute_s": 0.25},
                                    {"compute_s": 0.003, "loss": float("nan")}, {"loss": 2.5, "correct": 7},
                                    {"op": "no-such-op", "lr": 0.1, "names": ["a", "b"]}, {}])
def test_frames_carry_their_fields_and_tensors_through_the_pipe_and_the_segment(header):
    tensors = [np.arange(24, dtype=np.float32).reshape(2, 3, 4), np.arange(5, dtype=np.int64),
               np.float32(1.5) * np.ones((), np.float32), np.arange(6, dtype=np.float64).reshape(3, 2)[:, 0]]
    seg = Segment.create(1 << 16)
    try:
        for shm, at in ((None, 0), (seg, 0), (seg, 1 << 15)):
            got, back = read_frame(io.BufferedReader(io.BytesIO(_frame(header, tensors, shm, at))),
                                   lambda name: seg if name == seg.name else None)
            assert got.keys() == header.keys()
            for key, value in header.items():
                assert got[key] == value or (value != value and got[key] != got[key]), key   # NaN stays NaN
            assert [t.dtype for t in back] == [np.float32, np.int64, np.float32, np.float32]
            for sent, came in zip(tensors, back):
                np.testing.assert_array_equal(came, sent)
    finally:
        seg.close(unlink=True)


def test_malformed_frames_are_refused_as_out_of_step():
    good = _frame({"op": "forward"}, [np.zeros((2, 3), np.float32)])
    (size,) = struct.unpack(">I", good[:4])
    tensor_at = 4 + 21   # after the length, and the fixed part (21 bytes) and an empty segment name
    bare = _frame({"op": "forward"})
    bad = {
        "is over 1048576": struct.pack(">I", (1 << 20) + 1) + good[4:],
        "does not parse": struct.pack(">I", 10) + good[4:14],   # cut short
        "dtype code 7": good[:tensor_at] + b"\x07" + good[tensor_at + 1:],
        "rank 9": good[:tensor_at + 1] + b"\x09" + good[tensor_at + 2:],
        "op code 238": good[:4 + 3] + b"\xee" + good[4 + 4:],
        "not a JSON object": struct.pack(">I", len(bare) - 4 + 3) + bare[4:] + b"[1]",
        "a shared segment this side does not take": _frame({}, [], _FakeSegment("plexus-split-1-00"), 0),
    }
    assert size < len(good) - 4   # the tensor's bytes follow the header in the pipe
    for message, frame in bad.items():
        with pytest.raises(IntegrityError, match=message):
            read_frame(io.BufferedReader(io.BytesIO(frame)), lambda name: None)
    seg = Segment.create(1 << 12)
    try:   # a tensor said to lie past the segment's end
        frame = _frame({}, [np.zeros(64, np.float32)], seg, at=(1 << 12) - 256)   # its 256 bytes end the segment
        frame = frame.replace(struct.pack("<Q", (1 << 12) - 256), struct.pack("<Q", (1 << 12) - 128), 1)
        with pytest.raises(IntegrityError, match="overruns the shared segment"):
            read_frame(io.BufferedReader(io.BytesIO(frame)), lambda name: seg)
    finally:
        seg.close(unlink=True)


class _FakeSegment:
    def __init__(self, name):
        self.name, self.size, self.buf = name, 0, memoryview(b"")


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="one CPU: nothing to hold the worker to")
def test_a_refused_affinity_call_lets_the_worker_go_and_the_calls_go_on(monkeypatch):
    mine = _affinity(0)
    w = SplitWorker()
    try:
        w.call("load", model="mlp", args=MLP, seed=3, variant="vanilla", cuts=["hidden1"])
        w.call("vanilla", list(batch()))
        assert len(_affinity(w.pid)) == 1   # held
        real = os.sched_setaffinity

        def refuse_for_the_caller(pid, cpus):
            if pid == 0:
                raise PermissionError(1, "Operation not permitted")
            real(pid, cpus)

        monkeypatch.setattr(os, "sched_setaffinity", refuse_for_the_caller)
        header, (grad,) = w.call("vanilla", list(batch(seed=2)))
        assert np.isfinite(header["loss"]) and grad.shape == (16, 32)
        assert _affinity(w.pid) == mine and _affinity(0) == mine   # let go; the caller never held
        w.call("vanilla", list(batch(seed=3)))
        assert _affinity(w.pid) == mine   # and unheld from then on
    finally:
        w.close()
