"""compression.downlink over real gRPC + mTLS: a dense, an fp16 and a delta8 job run one after another on the same
sites; the sites decode exactly the model the coordinator serves, checkpoints keep the exact model, and the model
bytes the coordinator streams shrink as the codec says. Under delta8 every site's first fetch is the chain's compact
start from zeros, and a site that joins later gets the chain in full once."""

from __future__ import annotations

import hashlib
import threading

import numpy as np

from coordinator.downlink import Downlink
from coordinator.engine import Engine
from coordinator.served import Held
from plexus.compression import downlink_decode, downlink_encode, zero_base
from plexus.config import DownlinkSpec
from plexus.wire import Layout, encode
from site_agent.agent import SiteAgent

from integration.harness import heart_job, scaled, wait_until

ROUNDS = 3
FETCHES = 2 * (ROUNDS + 1)   # two sites, each round and the final evaluation


def bits(state) -> bytes:
    return bytes(encode(state)[1])


def test_fp16_and_delta8_downlinks_serve_the_chain_bit_for_bit_at_a_fraction_of_the_bytes(federation, monkeypatch):
    decoded, served = {}, []   # (job, site, model round) -> what the site trains from; (round, exact, base)
    fetch, prepare = SiteAgent._fetch, Downlink.prepare

    def recording_fetch(self, stub, task, expected, job):
        state = fetch(self, stub, task, expected, job)
        decoded[(task.job_id, self.config.site, task.model_round)] = {k: np.array(v) for k, v in state.items()}
        return state

    def recording_prepare(self, round_, state):
        step = prepare(self, round_, state)
        served.append((round_, {k: np.array(v) for k, v in state.items()}, {k: v.copy() for k, v in step.base.items()}))
        return step

    monkeypatch.setattr(SiteAgent, "_fetch", recording_fetch)
    monkeypatch.setattr(Downlink, "prepare", recording_prepare)
    federation.start_site("a")
    federation.start_site("b")
    federation.wait_online("a", "b")
    admin, registry = federation.admin(), federation.coordinator.metrics.registry
    sent, chains = {}, {}
    for codec in ("none", "fp16", "delta8"):
        served.clear()
        before = registry.get_sample_value("plexus_model_bytes_total", {"direction": "out"})
        yaml = heart_job(name=f"down-{codec}", model="mlp", rounds=ROUNDS, seed=3)
        job_id = admin.submit(yaml + f"compression: {{downlink: {{codec: {codec}}}}}\n").job_id
        assert federation.wait_job(job_id) == "completed"
        sent[codec] = registry.get_sample_value("plexus_model_bytes_total", {"direction": "out"}) - before
        checkpoints = [federation.store.load_checkpoint(job_id, r) for r in range(ROUNDS + 1)]
        if codec == "none":
            assert served == []
            for (job, _, round_), state in decoded.items():
                if job == job_id:
                    assert bits(state) == bits(checkpoints[round_])
            continue
        chains[codec] = expected_chain(codec, checkpoints)
        assert [r for r, _, _ in served] == list(range(ROUNDS + 1))
        for round_, exact, base in served:
            assert bits(exact) == bits(checkpoints[round_])           # the checkpoint is the exact model
            assert bits(base) == bits(chains[codec][round_])
            assert bits(base) != bits(exact)                           # delta8 too: chain_0 is Q8(model_0 - 0)
            for site in "ab":
                assert bits(decoded[(job_id, site, round_)]) == bits(base)   # bit for bit what it served
    layout = Layout.of(checkpoints[0])
    dense = layout.total_bytes
    scales = sum(-(-t.numel // 256) for t in layout.tensors)
    assert sent["none"] == FETCHES * dense
    assert sent["fp16"] == FETCHES * dense // 2
    # delta8: every fetch 1 byte per value and one F32 scale per 256 values, the first (from zeros) too
    assert sent["delta8"] == FETCHES * (layout.total_elements + 4 * scales)


def expected_chain(codec: str, checkpoints: list[dict]) -> list[dict]:
    """What every site should hold after each round, recomputed from the exact checkpoints with the codec itself."""
    spec = DownlinkSpec(codec=codec)
    layout = Layout.of(checkpoints[0])
    if codec == "fp16":
        return [downlink_decode(spec, layout, downlink_encode(spec, model, None), None) for model in checkpoints]
    chain = [downlink_decode(spec, layout, downlink_encode(spec, checkpoints[0], zero_base(layout)), zero_base(layout))]
    for model in checkpoints[1:]:
        chain.append(downlink_decode(spec, layout, downlink_encode(spec, model, chain[-1]), chain[-1]))
    return chain


def test_delta8_first_fetches_are_the_compact_start_and_a_late_site_gets_the_chain_in_full(federation, monkeypatch):
    served, decoded = [], {}   # (site, model round, encoding, zero_base, bytes, held) as served; what sites decoded
    chains = {}                # model round -> the chain the coordinator serves
    waiting, go = threading.Event(), threading.Event()
    model_for, fetch, prepare = Engine.model_for, SiteAgent._fetch, Downlink.prepare

    def recording_model_for(self, site, task_id, held=None, **kwargs):
        model, job_id, round_ = model_for(self, site, task_id, held, **kwargs)
        served.append((site, round_, model.encoding, model.zero_base, model.layout.total_bytes, held))
        return model, job_id, round_

    def gated_fetch(self, stub, task, expected, job):
        if self.config.site == "a" and task.model_round == 1 and not go.is_set():   # round 2 waits for c to join
            waiting.set()
            assert go.wait(scaled(30)), "site c never came online"
        state = fetch(self, stub, task, expected, job)
        decoded[(self.config.site, task.model_round)] = bits(state)
        return state

    def recording_prepare(self, round_, state):
        step = prepare(self, round_, state)
        chains[round_] = bits(step.base)
        return step

    monkeypatch.setattr(Engine, "model_for", recording_model_for)
    monkeypatch.setattr(SiteAgent, "_fetch", gated_fetch)
    monkeypatch.setattr(Downlink, "prepare", recording_prepare)
    federation.start_site("a")
    federation.start_site("b")
    federation.wait_online("a", "b")
    yaml = heart_job(name="down-late", model="mlp", rounds=ROUNDS, seed=3)
    job_id = federation.admin().submit(yaml + "compression: {downlink: {codec: delta8}}\n").job_id
    wait_until(waiting.is_set, what="site a to hold round 2 until c joins")
    federation.start_site("c")
    federation.wait_online("c")
    go.set()
    assert federation.wait_job(job_id) == "completed"

    layout = Layout.of(federation.store.load_checkpoint(job_id, 0))
    compact = layout.total_elements + 4 * sum(-(-t.numel // 256) for t in layout.tensors)
    first = {}
    for site, round_, encoding, zero, size, held in served:
        first.setdefault(site, (round_, encoding, zero, size, held))
        assert decoded[(site, round_)] == chains[round_]   # each fetch decoded to the coordinator's chain, bit for bit
    # a and b start with the chain's start, compact, holding nothing; then they name it by its SHA-256.
    assert first["a"] == first["b"] == (0, "delta8", True, compact, None)
    sha_0 = hashlib.sha256(chains[0]).digest()
    assert [held for site, round_, *_, held in served if site == "a" and round_ == 1] == [Held(0, sha_0)]
    # c, joining for round 3, holds nothing the delta applies to: chain_2 in full float32, then deltas.
    assert first["c"] == (2, "dense", False, layout.total_bytes, None)
    assert [(e, z) for site, r, e, z, *_ in served if site == "c" and r == 3] == [("delta8", False)]
