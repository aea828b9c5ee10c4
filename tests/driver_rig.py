"""A driver on its own, as the driver tests run it: a real Store in a temp dir, an injected clock, no gRPC and
no engine thread. Each test module subclasses `DriverRig` with its driver class and job."""

from __future__ import annotations

import threading
import uuid

import numpy as np

from coordinator.drivers import Context
from coordinator.store import Store
from coordinator.tasks import Binding, Presence, TaskGrant, UpdateHeader
from plexus.config import dump_round_config, parse_round_config
from plexus.wire import encode, iter_chunks


class DriverRig:
    """A driver over a real store, with a clock (`now`) that moves only when told. `store_clock`: the store's
    timestamps follow it too."""

    driver_class: type = None

    def __init__(self, path, job_yaml: str, *, store_clock: bool = False, model: dict | None = None):
        self.now = 1000.0
        self.store = Store(path / "state", **({"clock": lambda: self.now} if store_clock else {}))
        self.presence = Presence(threading.RLock(), online_window_s=50.0, monotonic=lambda: self.now)
        self.ctx = Context(store=self.store, presence=self.presence, clock=lambda: self.now, monotonic=lambda: self.now,
                           notify=lambda: None, models=None, model_limits=None)
        cfg = parse_round_config(job_yaml, source="test job")
        self.job_id = f"job-{uuid.uuid4().hex[:8]}"
        self.store.save_checkpoint(self.job_id, 0, model or {"w": np.zeros(4, np.float32)})
        self.store.add_job(self.job_id, cfg.name, dump_round_config(cfg), cfg.strategy.name, cfg.rounds, "test")
        self.driver = self.take_up()

    def take_up(self):
        return self.driver_class.take_up(self.ctx, self.store.job(self.job_id))

    def join(self, *sites: str, rows: int = 1000) -> None:
        for site in sites:
            self.store.site_seen(site, agent_version="test", models=["vector"], datasets=["heart-disease"],
                                 policy_digest="")
            self.presence.joined(site, {"heart-disease": rows})

    def header(self, grant: TaskGrant, values, num_samples: int, **fields) -> tuple[UpdateHeader, bytearray]:
        """The update header for `values` (the model "w") and its wire blob; `fields`: metrics, eval_metrics."""
        layout, blob = encode({"w": np.asarray(values, np.float32)})
        return UpdateHeader(task=Binding(grant.task_id, grant.job_id, grant.round, grant.nonce),
                            num_samples=num_samples, layout=layout, **fields), blob

    def send(self, site: str, grant: TaskGrant, values, *, num_samples: int = 100, chunks=None, **fields) -> str:
        """What Engine.submit_update does with the driver; `chunks(blob, cuts)` gives the stream as (offset, data)
        chunks (default: 4 bytes each), `cuts` what the driver asked to cut it with."""
        header, blob = self.header(grant, values, num_samples, **fields)
        return self.stream(site, grant, header, blob, chunks=chunks)

    def stream(self, site: str, grant: TaskGrant, header: UpdateHeader, blob, *, chunks=None) -> str:
        """Stream an update's blob under its header as Engine.submit_update does; the driver's reply."""
        cuts = []
        upload = self.driver.upload(site, grant, header, cuts.append)
        try:
            try:
                upload.receive(chunks(blob, cuts) if chunks else ((o, bytes(d)) for o, d in iter_chunks(blob, 4)))
            except BaseException as exc:
                self.driver.refused(site, grant, upload, exc)
                raise
            return self.driver.accepted(site, grant, header, upload)
        finally:
            self.driver.ended_upload(site, upload)


def rigs(tmp_path, make):
    """A fixture's body: `make(path, **kwargs)` rigs, each in its own folder, their stores closed at the end."""
    made = []

    def build(**kwargs):
        made.append(make(tmp_path / str(len(made)), **kwargs))
        return made[-1]
    yield build
    for r in made:
        r.store.close()
