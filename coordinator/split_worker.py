"""Split learning's server part in a compute worker process, so the coordinator process stays free of torch.

The coordinator (`SplitWorker`, numpy only) and the worker (`python -m coordinator.split_worker`, torch) talk over
the worker's stdin and stdout in frames: a 4-byte big-endian length, a small binary header (the operation, each
tensor's dtype and shape; any further fields as JSON), then the tensors' raw bytes, little-endian, in order. With
`shared_memory` (the default) the tensors travel instead through a shared-memory segment the coordinator creates
(0600, its own user): the header names the segment and each tensor's offset, and each side makes one copy of a
tensor, not three through a pipe. A forward's activations go to the segment's upper half, where the worker
computes on them in place until their backward; every other request, and every reply, keeps to its lower half.
No tensor is ever written as JSON, and nothing is pickled.

Operations (plexus.split's ServerStep, one batch at a time):
- `load`: the job's model (a registry name and its arguments, built from the job seed), the variant, the cuts,
  the optimizer; replies with the model's state names each side holds, the site parts' parameters (name -> shape)
  and the shapes at the cuts;
- `vanilla` (activations, labels) -> (gradient at the cut,) and the loss;
- `forward` (activations,) -> (the middle's output,), then `backward` (its gradient,) -> (gradient at the cut,);
  `drop` forgets a forward whose gradient will not come;
- `evaluate` (activations, labels) -> the summed loss and the correct count (vanilla); `infer` (activations,) ->
  (the middle's output,) (u-shaped); neither steps the optimizer;
- `state` -> the server part's tensors, by the model's names (for checkpoints); `load_state` puts them back;
  `optimizer` -> SGD's momentum buffers ("momentum/<name>"); `load_optimizer` puts them back.

Every reply also says how long the worker computed (`compute_s`: the batch's checks and the server part's compute,
not the copy a forward's activations take out of the segment where they are not in place), so the hop's own cost
is measured apart.

    python -m coordinator.split_worker        (started by SplitWorker; not run by hand)
"""

from __future__ import annotations

import ctypes
import json
import logging
import math
import mmap
import os
import re
import secrets
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

from coordinator.model_worker import end_child, end_child_later
from plexus.errors import ConfigError, IntegrityError, Reason
from plexus.memory import keep_freed_memory
from plexus.shutdown import exit_now

log = logging.getLogger("plexus.split")

_DTYPES = {"F32": np.dtype("<f4"), "I64": np.dtype("<i8")}
MAX_HEADER = 1 << 20
MAX_TENSOR_BYTES = 1 << 31
SHM_DIR = Path("/dev/shm")


def _libc_getcpu():
    """glibc's sched_getcpu (the CPU the calling thread runs on), or None where there is none."""
    try:
        return ctypes.CDLL(None).sched_getcpu
    except (OSError, AttributeError):
        return None


_getcpu = _libc_getcpu() if hasattr(os, "sched_setaffinity") else None


# A frame's header: a fixed part (the tensor count, the shared segment name's length, the operation's code, which of
# `compute_s` and `loss` it carries, and their values), the segment's name, each tensor's record (dtype code, rank,
# offset in the segment, then its dimensions), then any other fields as JSON. A batch's requests and replies have no
# other fields: their header costs a few struct calls a side, not JSON's dumps and parse (docs/performance.md,
# "Split learning's compute-worker hop").
_HEAD = struct.Struct("<HBBBdd")          # tensor count, name's length, op code, has (1: compute_s, 2: loss), both
_OPS = ("", "load", "vanilla", "forward", "backward", "drop", "evaluate", "infer", "state", "optimizer",
        "load_optimizer", "load_state")   # code 0: no operation (a reply); an op not here travels in the JSON
_OP_CODES = {op: code for code, op in enumerate(_OPS) if op}
_TENSOR = struct.Struct("<BBQ")           # dtype code, rank, offset
_BY_CODE = list(_DTYPES.values())          # a tensor's dtype code: its place here
_CODE_OF = {dtype: code for code, dtype in enumerate(_BY_CODE)}
_DIMS = [struct.Struct(f"<{n}Q") for n in range(9)]   # a tensor's dimensions, by rank
MAX_RANK = len(_DIMS) - 1


def write_frame(stream, header: dict, tensors: list[np.ndarray] = (), shm=None, *, at: int = 0) -> None:
    """Send a frame; with `shm` (a Segment) the tensors go into it, one after another from offset `at`, instead of
    the stream."""
    arrays = [t if isinstance(t, np.ndarray) and t.dtype in _CODE_OF and t.flags.c_contiguous
              else np.ascontiguousarray(t, dtype=_DTYPES[_name(np.asarray(t))]) for t in tensors]
    name = shm.name.encode() if shm is not None else b""
    rest = dict(header)
    op = _OP_CODES.get(rest.get("op"), 0)
    if op:
        del rest["op"]
    compute, loss = rest.pop("compute_s", None), rest.pop("loss", None)
    has = (compute is not None) | (loss is not None) << 1
    parts = [b"", _HEAD.pack(len(arrays), len(name), op, has, compute or 0.0, loss or 0.0), name]
    offset = at if shm is not None else 0
    for a in arrays:
        if a.ndim > MAX_RANK:
            raise ValueError(f"a split-worker tensor has {a.ndim} dimensions; at most {MAX_RANK} travel")
        parts += (_TENSOR.pack(_CODE_OF[a.dtype], a.ndim, offset), _DIMS[a.ndim].pack(*a.shape))
        offset += a.nbytes
    if shm is not None:
        if offset > shm.size:
            raise ValueError(f"{offset} bytes of tensors do not fit the {shm.size}-byte shared segment")
        for a in arrays:
            shm.buf[at:at + a.nbytes] = memoryview(a).cast("B")
            at += a.nbytes
    if rest:
        parts.append(json.dumps(rest).encode())
    parts[0] = struct.pack(">I", sum(map(len, parts)))
    stream.write(b"".join(parts))
    if shm is None:
        for a in arrays:
            stream.write(memoryview(a).cast("B"))
    stream.flush()


def read_frame(stream, attach=None, *, copy: bool = True) -> tuple[dict, list[np.ndarray]]:
    """Read a frame; tensors in a shared segment are copied out of it (`attach(name)` gives the segment), or with
    `copy=False` are views into it, valid until the segment is written again."""
    (size,) = struct.unpack(">I", _read_exactly(stream, 4))
    if size > MAX_HEADER:
        raise IntegrityError(f"a split-worker frame header of {size} bytes is over {MAX_HEADER}: out of step")
    head = _read_exactly(stream, size)
    try:
        count, length, op, has, compute, loss = _HEAD.unpack_from(head)
        at = _HEAD.size + length
        name = head[_HEAD.size:at].decode("ascii")
        specs = []
        for _ in range(count):
            code, rank, offset = _TENSOR.unpack_from(head, at)
            if code >= len(_BY_CODE) or rank > MAX_RANK:
                raise IntegrityError(f"a split-worker frame names a tensor of dtype code {code} and rank {rank}: not "
                                     f"F32 or I64 of rank at most {MAX_RANK}")
            at += _TENSOR.size
            specs.append((_BY_CODE[code], _DIMS[rank].unpack_from(head, at), offset))
            at += _DIMS[rank].size
        header = json.loads(head[at:]) if at < size else {}
        if not isinstance(header, dict) or op >= len(_OPS) or has > 3:
            raise ValueError("not a JSON object" if not isinstance(header, dict) else f"op code {op}, has {has}")
    except (struct.error, UnicodeDecodeError, ValueError) as exc:
        raise IntegrityError(f"a split-worker frame header does not parse ({exc}): out of step") from None
    if op:
        header["op"] = _OPS[op]
    if has & 1:
        header["compute_s"] = compute
    if has & 2:
        header["loss"] = loss
    shm = attach(name) if name and attach is not None else None
    if name and shm is None:
        raise IntegrityError("a split-worker frame names a shared segment this side does not take")
    tensors = []
    for dtype, shape, offset in specs:
        count = math.prod(shape)
        nbytes = count * dtype.itemsize
        if nbytes > MAX_TENSOR_BYTES:
            raise IntegrityError(f"a split-worker tensor of {nbytes} bytes is over {MAX_TENSOR_BYTES}")
        if shm is not None:
            if offset > shm.size - nbytes:
                raise IntegrityError(f"a split-worker tensor at offset {offset} overruns the shared segment")
            view = np.frombuffer(shm.buf, dtype=dtype, count=count, offset=offset).reshape(shape)
            tensors.append(view.copy() if copy else view)
        else:
            tensors.append(np.frombuffer(bytearray(_read_exactly(stream, nbytes)), dtype=dtype).reshape(shape))
    return header, tensors   # each its own writable memory


def _name(a: np.ndarray) -> str:
    kind = a.dtype.kind
    if kind == "f":
        return "F32"
    if kind in "iu":
        return "I64"
    raise TypeError(f"a split-worker tensor is float32 or int64, not {a.dtype}")


def _read_exactly(stream, n: int) -> bytes:
    data = stream.read(n)
    if data is None or len(data) != n:
        raise EOFError(f"the split worker's stream ended after {0 if data is None else len(data)} of {n} bytes")
    return data


def check_batch(activations: np.ndarray, row_shape: tuple[int, ...], *, max_rows: int,
                labels: np.ndarray | None = None, classes: int = 0) -> None:
    """Refuse a batch whose activations are not (n, *row_shape) finite float32 with 1 <= n <= max_rows, or whose
    labels are not n class indices in [0, classes)."""
    if activations.dtype != np.float32 or activations.ndim != len(row_shape) + 1 \
            or tuple(activations.shape[1:]) != tuple(row_shape) or not 1 <= activations.shape[0] <= max_rows:
        raise IntegrityError(f"activations of shape {activations.shape} ({activations.dtype}); the cut takes float32 "
                             f"(n, {', '.join(map(str, row_shape))}) with 1 <= n <= {max_rows}", reason=Reason.LAYOUT)
    if not np.isfinite(activations).all():
        raise IntegrityError("activations contain NaN or Inf; refusing the batch", reason=Reason.NON_FINITE)
    if labels is not None:
        if labels.shape != (activations.shape[0],) or labels.dtype.kind not in "iu" \
                or (labels.size and not (0 <= labels.min() and labels.max() < classes)):
            raise IntegrityError(f"labels must be {activations.shape[0]} class indices in [0, {classes}); got shape "
                                 f"{labels.shape}", reason=Reason.LAYOUT)


class Segment:
    """A shared-memory segment: a file in /dev/shm (mode 0600) mapped by both processes. The coordinator creates
    it, the worker maps it by name, and the coordinator unlinks the name once the worker has answered a call made
    with it (`forget_name`): the memory lives as long as either mapping, so a coordinator killed mid-job leaves no
    file behind. (multiprocessing.shared_memory would start a resource-tracker process in the coordinator.)"""

    PREFIX = "plexus-split-"

    def __init__(self, path: Path, fd: int, size: int):
        self.path, self.name, self.size = path, path.name, size
        self._named = True
        self._map = mmap.mmap(fd, size)
        os.close(fd)
        self.buf = memoryview(self._map)
        self.upper = size // 2   # a forward's activations go from here on; all else keeps below (SplitWorker.call)
        self.address = np.frombuffer(self.buf, np.uint8, 1).__array_interface__["data"][0]   # where it is mapped

    @classmethod
    def create(cls, size: int) -> Segment:
        path = SHM_DIR / f"{cls.PREFIX}{os.getpid()}-{secrets.token_hex(8)}"
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            # Its pages now: a /dev/shm too small for them fails here (ENOSPC), where a sparse file would let the
            # first write past the space left kill the process with SIGBUS.
            os.posix_fallocate(fd, 0, size)
        except BaseException:
            os.close(fd)
            path.unlink(missing_ok=True)
            raise
        return cls(path, fd, size)

    @classmethod
    def attach(cls, name: str) -> Segment:
        if not re.fullmatch(re.escape(cls.PREFIX) + r"\d+-[0-9a-f]{16}", name):
            raise IntegrityError(f"{name!r} is not a split worker's shared segment")
        path = SHM_DIR / name
        fd = os.open(path, os.O_RDWR)
        return cls(path, fd, os.fstat(fd).st_size)

    def forget_name(self) -> None:
        """Remove the segment's name from /dev/shm (once); both mappings stay valid."""
        if self._named:
            self.path.unlink(missing_ok=True)
            self._named = False

    def close(self, *, unlink: bool = False) -> None:
        """Unmap (and with `unlink`, remove) the segment. Should a view of it still be alive (a tensor read with
        copy=False), the mapping stays until that view goes: numpy keeps it alive, and unmaps it then."""
        if unlink:
            self.path.unlink(missing_ok=True)
        try:
            self.buf.release()
            self._map.close()
        except BufferError:
            pass


class SplitWorker:
    """The coordinator's handle on one compute worker process (thread-safe: one call at a time). With
    `shared_memory`, tensors travel through a segment that grows to the largest call's tensors.

    With `colocate` (the default, on Linux) and a single-threaded server part, each call runs on one CPU: the
    calling thread stays, for the call, on the CPU it is on, and the worker is moved there (while it waits, so
    nothing migrates mid-compute). The request then wakes the worker and the reply wakes the caller by a switch on
    that CPU, where an idle CPU would take its wake-up from its idle state, a VM's halted vCPU or a C-state's exit
    latency on bare metal (docs/performance.md, "Split learning's compute-worker hop"). The caller waits while the
    worker computes, so the two never compete for that CPU; the coordinator's other threads run on the others."""

    def __init__(self, *, shared_memory: bool = True, colocate: bool = True):
        self._proc = subprocess.Popen([sys.executable, "-m", "coordinator.split_worker"], stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE)
        self._lock = threading.Lock()
        self._shared = shared_memory
        self._shm = None
        self._colocate = colocate and _getcpu is not None
        self._single = False    # the server part computes on one thread (known from `load`)
        self._cpu = -1          # the CPU the worker is held to
        self.compute_s = 0.0    # the worker's own time in the last call

    def _segment(self, tensors) -> Segment | None:
        """The shared segment, large enough for `tensors` and for a reply of at least as many bytes; None (and the
        pipe from then on) where /dev/shm cannot hold one."""
        need = max(1 << 20, 2 * sum(np.asarray(t).size * 8 for t in tensors))
        if self._shm is None or self._shm.size < need:
            if self._shm is not None:
                self._shm.close(unlink=True)
                self._shm = None
            try:
                self._shm = Segment.create(need)
            except OSError as exc:
                log.warning("the split compute worker (PID %d) takes its tensors through its pipe from now on, not "
                            "shared memory: a %d-byte segment in %s failed (%s). Give the coordinator a larger "
                            "/dev/shm (docker run --shm-size, a memory-backed emptyDir on Kubernetes) for the faster "
                            "path", self._proc.pid, need, SHM_DIR, exc.strerror or exc)
                self._shared = False
        return self._shm

    @property
    def pid(self) -> int:
        return self._proc.pid

    def call(self, op: str, tensors: list[np.ndarray] = (), *, consume=None, **fields):
        """Run `op` on `tensors`: (the reply's header, its tensors). With `consume(header, tensors)`, the tensors are
        views into the shared segment instead of copies, and what `consume` returns (while the call still holds the
        worker, so nothing overwrites them) is the call's result: one copy fewer where the caller copies anyway."""
        with self._lock:
            mask = self._to_one_cpu() if self._single else None
            try:
                shm = self._segment(tensors) if self._shared else None
                # A forward's activations go to the segment's upper half, where the worker computes on them in
                # place until their backward: every other request and every reply keeps to the lower half.
                write_frame(self._proc.stdin, {"op": op, **fields}, tensors, shm,
                            at=shm.upper if shm is not None and op == "forward" else 0)
                header, out = read_frame(self._proc.stdout, lambda name: shm if shm is not None and name == shm.name
                                         else None, copy=consume is None)
                if shm is not None:
                    shm.forget_name()   # the worker has it mapped
            except (BrokenPipeError, EOFError) as exc:
                raise ConfigError(f"the split compute worker (PID {self._proc.pid}) ended: {exc}; see the "
                                  "coordinator's log") from None
            finally:
                if mask is not None:
                    self._restore(mask)
            if op == "load" and not header.get("error"):
                # Held to one CPU only with one torch thread: threads the worker starts inherit its CPU.
                self._single = self._colocate and int(fields.get("threads", 1)) == 1
            if header.get("error"):
                raise (IntegrityError if header.get("kind") == "integrity" else ConfigError)(header["error"])
            self.compute_s = float(header.get("compute_s", 0.0))
            return consume(header, out) if consume is not None else (header, out)

    def _to_one_cpu(self) -> set[int] | None:
        """Hold the calling thread, for this call, to the CPU it runs on, and the worker to the same one; the
        thread's own CPUs to give back after the call (None: nothing changed)."""
        mask = None
        try:
            cpu, mask = _getcpu(), os.sched_getaffinity(0)
            if cpu not in mask:
                return None
            if cpu != self._cpu:
                os.sched_setaffinity(self._proc.pid, {cpu})
                self._cpu = cpu
            os.sched_setaffinity(0, {cpu})
            return mask
        except OSError as exc:   # a cpuset that changed under us, a sandbox refusing the call: go on unheld
            log.info("the split compute worker (PID %d) runs unheld from now on: %s", self._proc.pid, exc)
            self._single = False
            if self._cpu >= 0 and mask is not None:
                try:   # where it was held, let it go
                    os.sched_setaffinity(self._proc.pid, mask)
                except OSError:
                    pass
            return None

    @staticmethod
    def _restore(mask: set[int]) -> None:
        try:
            os.sched_setaffinity(0, mask)
        except OSError as exc:
            log.warning("a coordinator thread stays held to one CPU: giving its CPUs back failed (%s)", exc)

    def close(self, *, wait: bool = True) -> None:
        """End the worker; with wait=False its end (which waits for the operation it is in) runs on a thread of its
        own (model_worker.end_child_later): for a caller holding the engine lock."""
        if self._shm is not None:
            self._shm.close(unlink=True)
            self._shm = None
        if wait:
            end_child(self._proc)
            self._proc.stdout.close()
        else:
            end_child_later(self._proc, then=self._proc.stdout.close)


# The worker process --------------------------------------------------------------------------------------------
class _Server:
    def __init__(self):
        self.step = None
        self.row_shape: tuple[int, ...] = ()
        self.classes = 0
        self.max_rows = 0
        self.device = "cpu"

    def load(self, header: dict) -> tuple[dict, list]:
        import torch

        from plexus.models import build_model
        from plexus.split import ServerStep, cut_shapes, num_classes, part_names, split

        torch.set_num_threads(int(header.get("threads", 1)))
        model = build_model(header["model"], header.get("args", {}), seed=int(header.get("seed", 0)))
        parts = split(model, header["variant"], list(header["cuts"]))
        self.row_shape, out_shape = cut_shapes(model, parts)   # ConfigError without input_shape()
        self.classes = num_classes(model)
        self.max_rows = int(header.get("max_rows", 4096))
        self.device = str(header.get("device", "cpu"))
        if self.device == "cuda" and not torch.cuda.is_available():
            raise ConfigError("split.device is cuda, and this coordinator's machine has no CUDA device torch can use; "
                              "set split.device: cpu")
        model.to(self.device)
        self.model, self.parts = model, parts
        self.site_names, self.server_names = part_names(model, parts)
        optimizer = torch.optim.SGD(parts.middle.parameters(), lr=float(header.get("lr", 0.01)),
                                    momentum=float(header.get("momentum", 0.0)),
                                    weight_decay=float(header.get("weight_decay", 0.0)))
        self.step = ServerStep(parts, optimizer)
        site_params = {parts.names[id(p)]: list(p.shape) for m in parts.site_modules for p in m.parameters()}
        return {"site": self.site_names, "server": self.server_names, "row_shape": list(self.row_shape),
                "site_params": site_params,
                "out_shape": list(out_shape) if out_shape is not None else None,
                "classes": self.classes}, []

    def _momentum(self) -> dict:
        names = {id(p): n for n, p in self.model.named_parameters()}
        return {f"momentum/{names[id(p)]}": s["momentum_buffer"] for p, s in self.step.optimizer.state.items()
                if s.get("momentum_buffer") is not None}

    def _in(self, array: np.ndarray):
        import torch

        return torch.from_numpy(array).to(self.device)

    def handle(self, header: dict, tensors: list[np.ndarray]) -> tuple[dict, list]:
        import torch

        op = header.get("op")
        if op == "load":
            return self.load(header)
        if self.step is None:
            raise ConfigError("the split worker has no model yet: send `load` first")
        if op in ("vanilla", "evaluate"):
            activations, labels = tensors
            check_batch(activations, self.row_shape, max_rows=self.max_rows, labels=labels, classes=self.classes)
            a, y = self._in(activations), self._in(labels)
            if op == "vanilla":
                grad, loss = self.step.vanilla(a, y)
                return {"loss": loss}, [grad.cpu().numpy()]
            with torch.no_grad():
                self.parts.middle.eval()
                logits = self.parts.middle(a)
                self.parts.middle.train()
                loss = float(torch.nn.functional.cross_entropy(logits, y, reduction="sum"))
                return {"loss": loss, "correct": int((logits.argmax(1) == y).sum())}, []
        if op in ("forward", "infer"):
            check_batch(tensors[0], self.row_shape, max_rows=self.max_rows)
            if op == "forward":   # its activations (in place in the segment's upper half, or a copy: main) outlive it
                return {}, [self.step.forward(self._in(tensors[0])).cpu().numpy()]
            with torch.no_grad():
                self.parts.middle.eval()
                out = self.parts.middle(self._in(tensors[0]))
                self.parts.middle.train()
            return {}, [out.cpu().numpy()]
        if op == "backward":
            grad = tensors[0]
            expected = self.step.waiting
            if expected is None:
                raise IntegrityError("a gradient for a batch the server did not run forward; send its activations "
                                     "first", reason=Reason.LAYOUT)
            if grad.dtype != np.float32 or grad.shape != expected:
                raise IntegrityError(f"the gradient of the server part's output must be float32 {expected}; got "
                                     f"{grad.dtype} {grad.shape}", reason=Reason.LAYOUT)
            if not np.isfinite(grad).all():
                raise IntegrityError("the gradient contains NaN or Inf; refusing it", reason=Reason.NON_FINITE)
            return {}, [self.step.backward(self._in(grad)).cpu().numpy()]
        if op == "drop":   # a u-shaped batch whose gradient will not come (its site dropped): forget its forward
            self.step.forget()
            return {}, []
        if op == "state":
            state = self.model.state_dict()
            return {"names": self.server_names}, [state[n].detach().cpu().numpy() for n in self.server_names]
        if op == "optimizer":   # SGD's momentum buffers, by parameter name (for checkpoints)
            buffers = self._momentum()
            return {"names": sorted(buffers)}, [buffers[n].detach().cpu().numpy() for n in sorted(buffers)]
        if op == "load_optimizer":
            params = dict(self.model.named_parameters())
            state = self.step.optimizer.state
            for name, array in zip(header["names"], tensors):
                param = params.get(name.removeprefix("momentum/"))
                if not name.startswith("momentum/") or param is None or tuple(array.shape) != tuple(param.shape):
                    raise IntegrityError(f"{name!r} {array.shape} is no momentum buffer of the server part")
                state[param]["momentum_buffer"] = torch.from_numpy(array.copy()).to(self.device)
            return {}, []
        if op == "load_state":
            state = self.model.state_dict()
            names = list(header["names"])
            if sorted(names) != self.server_names or len(names) != len(tensors):
                raise IntegrityError(f"load_state names {names} are not the server part's {self.server_names}")
            with torch.no_grad():
                for name, array in zip(names, tensors):
                    if tuple(array.shape) != tuple(state[name].shape):
                        raise IntegrityError(f"{name}: shape {array.shape}, the server part's is "
                                             f"{tuple(state[name].shape)}")
                    state[name].copy_(torch.from_numpy(array.copy()))
            return {}, []
        raise ConfigError(f"the split worker does not know operation {op!r}")


class _Segments:
    """The worker's side of the shared segments: attached by name, the newest one kept."""

    def __init__(self):
        self.current: Segment | None = None
        self.used = False   # the last request came through the segment (its reply goes back that way)

    def held(self, view: np.ndarray) -> bool:
        """Whether `view` lies in the current segment's upper half (where a forward's activations go)."""
        seg = self.current
        if seg is None:
            return False
        start = view.__array_interface__["data"][0] - seg.address
        return seg.upper <= start and start + view.nbytes <= seg.size

    def attach(self, name: str) -> Segment:
        self.used = True
        if self.current is None or self.current.name != name:
            if self.current is not None:
                self.current.close()
            self.current = Segment.attach(name)
        return self.current


def main() -> int:
    # A batch's tensors are the same sizes batch after batch: from the heap each time, not fresh pages faulted in.
    keep_freed_memory()
    server, segments = _Server(), _Segments()
    # Frames go to the original stdout; anything a model plug-in or library prints goes to stderr (the
    # coordinator's log), so it cannot break the frames.
    stdin, stdout = sys.stdin.buffer, os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    while True:
        try:
            # Views into the segment: each operation uses its tensors before the reply overwrites them (a forward's
            # activations outlive the call: below).
            segments.used = False
            header, tensors = read_frame(stdin, segments.attach, copy=False)
        except EOFError:
            return 0
        if header.get("op") == "forward" and segments.used and not all(segments.held(t) for t in tensors):
            # Its activations outlive the call (backward needs them). In the segment's upper half they stay as they
            # are until the next forward; anywhere else in it, the next request overwrites them: a copy out (before
            # the clock starts, so counted as the hop's).
            tensors = [np.array(t) for t in tensors]
        started = time.perf_counter()
        try:
            reply, out = server.handle(header, tensors)
        except IntegrityError as exc:
            reply, out = {"error": str(exc), "kind": "integrity"}, []
        except ConfigError as exc:
            reply, out = {"error": str(exc)}, []
        except (ValueError, KeyError, TypeError) as exc:
            reply, out = {"error": f"{type(exc).__name__}: {exc}"}, []
        reply["compute_s"] = time.perf_counter() - started
        shm = segments.current if segments.used else None
        if shm is not None and sum(np.asarray(t).size * 8 for t in out) > shm.upper:
            shm = None   # a reply larger than the segment's lower half (a model's state) goes through the pipe
        write_frame(stdout, reply, out, shm)
        tensors = out = None   # the request's views into the segment go before the next request may replace it


if __name__ == "__main__":
    exit_now(main())   # not sys.exit: torch's teardown would keep the parent waiting
