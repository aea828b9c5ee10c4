"""A synchronous secure round under distributed DP: each site draws its noise share for sites.min survivors, so it
never reveals its shares for fewer (the sum would carry too little noise for the ε its policy checked)."""

from __future__ import annotations

import time

import pytest

from plexus import pki
from plexus.config import DatasetSpec, PolicySpec, SiteConfig, parse_round_config
from plexus.identity import load_kit
from plexus.proto.plexus.v1 import federation_pb2 as fpb
from plexus.secagg import SiteSession, advert_from_proto, advert_to_proto
from plexus.secagg.fixed_point import frac_bits
from site_agent.agent import SiteAgent

from fake_coordinator import FakeCoordinator

JOB_ID = "floor-0123abcd"
JOB = """\
name: floor
model: {name: logistic, args: {in_features: 13, num_classes: 2}}
data: {dataset: heart-disease}
rounds: 1
sites: {min: 5}
privacy: {secure_aggregation: true, dp: {mode: distributed, noise_multiplier: 1.0, clip_norm: 1.0}}
"""


def _task(kind, **payload) -> fpb.Task:
    return fpb.Task(kind=kind, task_id=f"t{kind}", job_id=JOB_ID, round=1, model_round=0, config_yaml=JOB,
                    nonce=b"n" * 16, deadline_unix_s=time.time() + 600, seed=1,
                    secagg=fpb.SecAggPayload(**payload) if payload else None)


@pytest.mark.parametrize("survivors, reveals", [("abc", False), ("abcde", True)])
def test_a_site_never_unmasks_fewer_survivors_than_its_noise_was_drawn_for(tmp_path, survivors, reveals):
    root = tmp_path / "pki"
    pki.init_federation(root, "floor", hosts=["127.0.0.1"])
    for name in "abcde":
        pki.add_site(root, name)
    agent = SiteAgent(SiteConfig(site="a", coordinator="127.0.0.1:1", kit=root / "sites" / "a",
                                 state_dir=tmp_path / "state",
                                 datasets={"heart-disease": DatasetSpec(kind="heart-disease", hospital="cleveland")},
                                 policy=PolicySpec(allowed_models=("logistic",), require_secure_aggregation=True)))
    stub = FakeCoordinator(parse_round_config(JOB))
    try:
        agent.handle(stub, _task(fpb.TASK_SECAGG_ADVERTISE))
        mine = advert_from_proto(stub.secagg[-1].advert)
        others = [n for n in survivors if n != "a"]
        kits = {n: load_kit(root / "sites" / n) for n in others}
        sessions = {n: SiteSession(JOB_ID, 1, n) for n in others}
        adverts = [mine] + [sessions[n].advertise(mine.num_samples, kits[n].key_pem, kits[n].cert_pem) for n in others]
        total, clip, threshold = sum(a.num_samples for a in adverts), 4.0, len(survivors) // 2 + 1
        common = dict(threshold=threshold, total_weight=total, clip=clip, frac_bits=frac_bits(clip))
        agent.handle(stub, _task(fpb.TASK_SECAGG_SHARE, adverts=[advert_to_proto(a) for a in adverts], **common))
        outbox = {n: sessions[n].share(adverts, threshold=threshold, total_weight=total, ca_pem=kits[n].ca_pem)
                  for n in others}
        agent.handle(stub, _task(fpb.TASK_SECAGG_MASKED_INPUT, shares_for_you={n: outbox[n]["a"] for n in others},
                                 u2=list(survivors), **common))
        assert len(stub.updates) == 1   # the masked input went
        agent.handle(stub, _task(fpb.TASK_SECAGG_UNMASK, u2=list(survivors), u3=list(survivors), **common))
        revealed = [m for m in stub.secagg if m.WhichOneof("body") == "reveal"]
        if reveals:
            assert len(revealed) == 1 and not stub.results
        else:
            assert not revealed
            (result,) = stub.results
            assert result.status == fpb.RESULT_FAILED
            assert "only 3 sites survived to be unmasked, fewer than the 5" in result.reason, result.reason
    finally:
        agent.audit.close()
