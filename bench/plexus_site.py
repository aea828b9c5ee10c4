"""Bench-only Plexus site: the real SiteAgent connection loop (mTLS, Join, NextTask long-poll, chunked
FetchModel / SubmitUpdate), with local training replaced by "add a constant to every parameter,
num_samples 100". Runs only the built-in `vector` model.

    python -m bench.plexus_site --config site.yaml
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
from pathlib import Path

import numpy as np

from plexus.config import load_site_config
from plexus.models import build_model, installed_models
from plexus.proto.plexus.v1 import federation_pb2 as fpb
from plexus.wire import DEFAULT_CHUNK_BYTES, Layout, assemble, chunk_size, dtype_name, iter_chunks
from site_agent.agent import SiteAgent, call_timeout, round_config
from site_agent.local import LocalResult
from site_agent.policy import refusal
from site_agent.training import TrainResult

log = logging.getLogger("plexus.site")

DELTA = 0.001
NUM_SAMPLES = 100


class BenchSiteAgent(SiteAgent):
    """SiteAgent whose 'training' adds DELTA in place to the fetched model and sends it back."""

    _layouts: dict = {}
    _buffers: dict = {}   # layout -> the blob this site fetches into, round after round (its "model")

    @property
    def delta(self) -> float:
        """A site-specific constant (site-NN adds 0.001 × (NN+1)), the same rule as the Flower ClientApp."""
        digits = "".join(ch for ch in self.config.site if ch.isdigit())
        return DELTA * (int(digits or 0) + 1)

    def _layout(self, job) -> Layout:
        key = (job.model.name, repr(sorted(job.model.args.items())))
        if key not in self._layouts:  # the registry's model on torch's meta device: shapes, no memory
            import torch

            with torch.device("meta"):
                state = build_model(job.model.name, job.model.args, seed=0).state_dict()
            self._layouts[key] = Layout.build([(name, dtype_name(np.dtype(str(t.dtype).removeprefix("torch."))),
                                                tuple(t.shape)) for name, t in state.items()])
        return self._layouts[key]

    def handle(self, stub, task: fpb.Task) -> None:
        try:
            job = round_config(task.config_yaml, task.job_id)
        except ValueError as exc:
            return self.report(stub, task, fpb.RESULT_FAILED, f"cannot read the job's round config: {exc}")
        reason = refusal(self.config.policy, job, installed_models())
        if reason is None and job.model.name != "vector":
            reason = "the bench site only runs the 'vector' model"
        if reason:
            return self.report(stub, task, fpb.RESULT_DECLINED, reason)
        if task.kind == fpb.TASK_EVALUATE:   # nothing to evaluate on a bare vector
            return self.report(stub, task, fpb.RESULT_EVALUATED, "", {})
        if task.kind != fpb.TASK_TRAIN or getattr(job, "compression", None) is not None:
            # Secure aggregation, update compression (issue #15): the stock code, with trivial training
            return super().handle(stub, task)
        layout = self._layout(job)
        stream = stub.FetchModel(fpb.FetchModelRequest(task_id=task.task_id), timeout=call_timeout(task))
        first = next(stream)
        got = Layout.from_proto(first.header.manifest)
        layout.require_same(got, what="the coordinator's model")
        if layout not in self._buffers:
            self._buffers[layout] = bytearray(layout.total_bytes)
        blob = assemble(layout, (message.chunk for message in stream), into=self._buffers[layout])  # validated
        for t in layout.tensors:                                           # "training": in place
            view = memoryview(blob)[t.offset:t.offset + t.nbytes].cast("B")
            np.frombuffer(view, dtype=np.float32)[...] += self.delta
        header = fpb.UpdateHeader(task_id=task.task_id, job_id=task.job_id, round=task.round, nonce=task.nonce,
                                  num_samples=NUM_SAMPLES, manifest=layout.to_proto())

        def messages():
            yield fpb.UpdateMessage(header=header)
            for offset, piece in iter_chunks(blob, chunk_size(len(blob), self.chunk_bytes)):
                yield fpb.UpdateMessage(chunk={"offset": offset, "data": bytes(piece)})

        reply = stub.SubmitUpdate(messages(), timeout=call_timeout(task))
        log.info("job %s round %d: %s", task.job_id, task.round, reply.message)


    # Hooks the stock handler uses on the secure-aggregation path.
    def load_data(self, data):
        return None

    def advertised_rows(self) -> dict:
        return {name: NUM_SAMPLES for name in self.config.datasets}   # an update weighs at most these rows

    def evaluate(self, model, data) -> dict:
        return {}

    def local_update(self, job, model, served, data, task) -> LocalResult:
        import torch

        with torch.no_grad():
            for parameter in model.parameters():
                parameter.add_(self.delta)
        return LocalResult(TrainResult(num_samples=NUM_SAMPLES, steps=1, metrics={}), {}, lambda: None)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--config", type=Path, required=True)
    p.add_argument("--chunk-bytes", type=int, default=DEFAULT_CHUNK_BYTES,
                   help="update chunk size (as the coordinator's)")
    args = p.parse_args()
    logging.basicConfig(level=os.environ.get("PLEXUS_LOG", "INFO").upper(),
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    from plexus.memory import limit_malloc_arenas
    limit_malloc_arenas()   # as `plexus site run` does
    import torch
    torch.set_num_threads(1)
    agent = BenchSiteAgent(load_site_config(args.config), chunk_bytes=args.chunk_bytes)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: agent.stop.set())
    worker = threading.Thread(target=agent.run, name="plexus-bench-site", daemon=True)
    worker.start()
    agent.stop.wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
