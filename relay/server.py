"""`plexus relay run`: a relay's tier (a coordinator serving its children, its jobs run by RelayRounds) and its
upstream client (one site of its parent), in one process."""

from __future__ import annotations

import logging
import threading

from coordinator.model_worker import ModelWorker
from coordinator.server import Coordinator
from plexus.config import RelayConfig
from plexus.identity import kit_identity, load_kit
from plexus.shutdown import StopSignals
from relay.driver import Mailbox, RelayRounds
from relay.upstream import Upstream

log = logging.getLogger("plexus.relay")

REFUSE_JOBS = ("this is a relay: it runs the jobs of its parent; submit jobs to the federation's coordinator "
               "(admin.yaml coordinator:)")


class Relay:
    """A running relay; `port` is where its children dial (useful with listen port 0)."""

    def __init__(self, config: RelayConfig, *, models: ModelWorker | None = None):
        kit = load_kit(config.kit)
        self.name = kit_identity(kit, "relay", "`plexus pki add-relay DIR NAME --host HOST` where the federation's "
                                 "CA is").name
        self.mailbox = Mailbox()
        self.tier = Coordinator(config.serving(), models=models, take_up=RelayRounds.factory(self.mailbox, config.tier),
                                refuse_jobs=REFUSE_JOBS, kit_kind="relay")
        self.upstream = Upstream(config, kit, self.tier.engine, self.tier.store, self.mailbox)
        self._thread = threading.Thread(target=self.upstream.run, name="plexus-relay-upstream", daemon=True)

    @property
    def port(self) -> int:
        return self.tier.port

    def start(self) -> None:
        self.tier.start()
        self._thread.start()

    def stop(self) -> None:
        self.upstream.shutdown()
        self._thread.join(timeout=30)
        self.tier.stop()


def run(config: RelayConfig) -> int:
    relay = Relay(config)
    signals = StopSignals()
    relay.start()
    print(f"plexus relay {relay.name!r} listening on port {relay.port} (mTLS) for its children; parent "
          f"{config.parent}; state in {config.state_dir}", flush=True)
    signals.wait()
    relay.stop()
    return 0
