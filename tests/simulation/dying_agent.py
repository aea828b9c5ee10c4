"""A site agent whose worker process dies at its first training task (tests/simulation/test_worker_death.py)."""

import os

from plexus.proto.plexus.v1 import federation_pb2 as fpb
from site_agent.agent import SiteAgent


class DyingAgent(SiteAgent):
    def handle(self, stub, task):
        if task.kind == fpb.TASK_TRAIN:
            os._exit(3)   # the whole worker, mid-task, as a crash or the OOM killer would end it
        return super().handle(stub, task)
