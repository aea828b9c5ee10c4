"""compression.downlink over real gRPC + mTLS: a dense, an fp16 and a delta8 job run one after another on the same
sites; the sites decode exactly the model the coordinator serves, checkpoints keep the exact model, and the model
bytes the coordinator streams shrink as the codec says."""

from __future__ import annotations

import numpy as np

from coordinator.downlink import Downlink
from plexus.compression import downlink_decode, downlink_encode, zero_base
from plexus.config import DownlinkSpec
from plexus.wire import Layout, encode
from site_agent.agent import SiteAgent

from integration.harness import heart_job

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
