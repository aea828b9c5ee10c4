"""A site agent's stub answered in process: what a task calls, recorded, with the job's initial model served."""

from __future__ import annotations

import grpc
import numpy as np

from plexus.models import build_job_model, state_to_numpy
from plexus.proto.plexus.v1 import federation_pb2 as fpb
from plexus.wire import decode, encode, iter_chunks


class Refused(grpc.RpcError):
    """What a real stub raises when the coordinator refuses an update."""

    def code(self):
        return grpc.StatusCode.INVALID_ARGUMENT

    def details(self):
        return "update refused"


class FakeCoordinator:
    """The stub's calls a task makes, answered and recorded; `refuse` makes SubmitUpdate refuse the update."""

    def __init__(self, job):
        self.layout, self.blob = encode(state_to_numpy(build_job_model(job)))
        self.updates, self.secagg, self.results = [], [], []
        self.refuse = False

    def served(self) -> dict[str, np.ndarray]:
        return decode(self.layout, self.blob)

    def FetchModel(self, request, timeout):
        yield fpb.ModelMessage(header=fpb.ModelHeader(manifest=self.layout.to_proto()))
        for offset, data in iter_chunks(self.blob, 1 << 16):
            yield fpb.ModelMessage(chunk={"offset": offset, "data": bytes(data)})

    def SubmitUpdate(self, messages, timeout):
        self.updates.append(list(messages))
        if self.refuse:
            raise Refused()
        return fpb.SubmitReply(accepted=True, message="accepted")

    def SecAgg(self, message, timeout):
        self.secagg.append(message)
        return fpb.ResultReply()

    def ReportResult(self, result, timeout):
        self.results.append(result)
        return fpb.ResultReply()
