"""Answers through a worker's shared memory (simulation/arena.py): placed, read in place, and reused only
once the simulator is done with them."""

from __future__ import annotations

import itertools
import math
import os
import queue
import threading
import time

import numpy as np
import pytest
from google.protobuf.message import DecodeError

from plexus.config import DatasetSpec, PolicySpec, SiteConfig
from plexus.inproc import LocalRpcError
from plexus.proto.plexus.v1 import federation_pb2 as fpb, tensor_pb2
from plexus.wire import Layout
from simulation import arena as shared
from simulation.arena import END_ALIGN, MIN_BYTES, ArenaError, ArenaReader, ArenaWriter, create, owned
from simulation.inplace import chunk_in_place
from simulation.pool import ProcessPool
from simulation.simulator import Simulator, _Parsed, final_model
from simulation.worker import ANSWERING, SiteHost, _Calls

BIG = MIN_BYTES + 12345


@pytest.fixture
def arena():
    fd = create("plexus-test-arena")
    writer, reader = ArenaWriter(fd), ArenaReader(os.dup(fd))
    yield writer, reader
    reader.close()
    os.close(fd)


def messages(seed: int, sizes=(BIG // 2, BIG - BIG // 2, 7)) -> list[bytes]:
    return [bytes([(seed + i) % 251]) * n for i, n in enumerate(sizes)]


def test_placed_messages_read_back_in_place_and_small_ones_stay_in_their_frame(arena):
    writer, reader = arena
    assert writer.place(1, [b"x" * (MIN_BYTES - 1)]) is None
    sent = messages(3)
    where = writer.place(2, sent)
    views = reader.views(where)
    assert [bytes(v) for v in views] == sent
    assert reader.read == sum(map(len, sent))
    assert owned(views) == sent and all(type(m) is bytes for m in owned(views))


def chunk(offset: int, data: bytes) -> bytes:
    return fpb.UpdateMessage(chunk=tensor_pb2.Chunk(offset=offset, data=data)).SerializeToString()


def test_each_message_ends_aligned_so_a_chunks_data_is_read_aligned_and_in_place(arena):
    writer, reader = arena
    sent = [(0, bytes(range(256)) * 1024), (1 << 20, b"\x01" * 8 * 40001), (2 ** 40 + 3, b"\x02" * 8)]
    views = reader.views(writer.place(1, [chunk(offset, data) for offset, data in sent]))
    for view, (offset, data) in zip(views, sent):
        message = chunk_in_place(view)
        assert (message.chunk.offset, bytes(message.chunk.data)) == (offset, data)
        assert message.chunk.data.obj is view.obj   # a view of the shared file, not a copy
        values = np.frombuffer(message.chunk.data, dtype=np.float64)
        assert values.flags.aligned and values.ctypes.data % math.gcd(len(data), END_ALIGN) == 0


@pytest.mark.parametrize("message", [
    fpb.UpdateMessage(chunk=tensor_pb2.Chunk(offset=0, data=b"abcd")),
    fpb.UpdateMessage(chunk=tensor_pb2.Chunk(offset=300, data=b"")),
    fpb.UpdateMessage(chunk=tensor_pb2.Chunk(offset=2 ** 64 - 1, data=b"x" * 200)),
    fpb.UpdateMessage(chunk=tensor_pb2.Chunk()),
])
def test_a_chunk_read_in_place_is_the_chunk_protobuf_parses(message):
    read = chunk_in_place(message.SerializeToString())
    assert read.WhichOneof("body") == "chunk"
    assert (read.chunk.offset, bytes(read.chunk.data)) == (message.chunk.offset, message.chunk.data)
    parsed = _Parsed(fpb.UpdateMessage, [message.SerializeToString()])[0]
    assert (parsed.chunk.offset, bytes(parsed.chunk.data)) == (message.chunk.offset, message.chunk.data)


def data_then_offset() -> bytes:   # valid protobuf, but not as protobuf writes it
    inner = b"\x12\x02hi" + b"\x08\x05"
    return b"\x12" + bytes([len(inner)]) + inner


@pytest.mark.parametrize("serialized", [
    fpb.UpdateMessage(header=fpb.UpdateHeader(job_id="j", round=3)).SerializeToString(),
    data_then_offset(),
    chunk(7, b"abc") + b"\x18\x01",                 # a field after the chunk
    b"\x12\x06\x08\x01\x12\x02ab\x20\x01",          # an unknown field inside it
    b"\x12\x05\x08\x01\x12\x09ab",                  # data longer than the message
    b"\x12\x03\x08\x80\x80",                        # a varint cut short
    b"\x12\x0b\x08" + b"\xff" * 10,                  # a varint of more than 64 bits
    b"\x12",
])
def test_anything_else_is_left_to_protobuf_which_parses_or_refuses_it(serialized):
    assert chunk_in_place(serialized) is None
    try:
        expected = fpb.UpdateMessage.FromString(serialized)
    except DecodeError as exc:
        with pytest.raises(DecodeError, match=str(exc)):
            _Parsed(fpb.UpdateMessage, [serialized])[0]
    else:
        assert _Parsed(fpb.UpdateMessage, [serialized])[0] == expected


def test_a_region_is_reused_only_once_released(arena):
    writer, reader = arena
    first = writer.place(1, messages(1))
    second = writer.place(2, messages(2))
    assert second["offset"] >= first["offset"] + sum(first["sizes"])   # both lent: apart
    assert [bytes(v) for v in reader.views(first)] == messages(1)       # the second did not overwrite the first
    writer.release(1)
    third = writer.place(3, messages(3))
    assert third["offset"] == first["offset"]
    assert [bytes(v) for v in reader.views(second)] == messages(2)


def test_the_file_grows_for_a_larger_answer_and_the_reader_maps_it_again(arena):
    writer, reader = arena
    small = writer.place(1, messages(1))
    reader.views(small)
    large = writer.place(2, messages(2, sizes=(4 * BIG, 3 * BIG)))
    assert [bytes(v) for v in reader.views(large)] == messages(2, sizes=(4 * BIG, 3 * BIG))
    assert [bytes(v) for v in reader.views(small)] == messages(1)
    writer.release(1)
    writer.release(2)
    again = writer.place(3, messages(3, sizes=(5 * BIG,)))   # the freed regions, merged, hold it
    assert again["offset"] == 0


def test_calls_placing_at_once_get_regions_apart(arena):
    writer, reader = arena
    placed: dict[int, dict] = {}

    def place(call: int) -> None:
        placed[call] = writer.place(call, messages(call))

    threads = [threading.Thread(target=place, args=(call,)) for call in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    spans = sorted((w["offset"], w["offset"] + sum(w["sizes"]) + sum(w["skips"])) for w in placed.values())
    assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:]))
    assert all([bytes(v) for v in reader.views(placed[call])] == messages(call) for call in range(8))


@pytest.mark.parametrize("spec, said", [
    ({"offset": 0, "sizes": [10 ** 9]}, "past the .*shared file"),
    ({"offset": -4096, "sizes": [1]}, "negative"),
    ({"offset": 0, "sizes": [-1, 5]}, "negative"),
    ({"offset": "here"}, "must be {offset, sizes, skips}"),
    (["not", "a", "dict"], "must be {offset, sizes, skips}"),
    ({"offset": 0, "sizes": [1, 2], "skips": [0]}, "one skip .* per message"),
    ({"offset": 0, "sizes": [1], "skips": [END_ALIGN]}, "one skip .* per message"),
    ({"offset": 0, "sizes": [1], "skips": [-1]}, "one skip .* per message"),
])
def test_a_region_the_file_does_not_hold_is_refused(arena, spec, said):
    writer, reader = arena
    writer.place(1, messages(1))
    with pytest.raises(ArenaError, match=said):
        reader.views(spec)


@pytest.mark.parametrize("foreseen", [10 ** 6, 1000])   # enough, and too little: the region moves as it fills
def test_a_streamed_region_holds_what_was_added_and_frees_what_it_did_not_use(arena, foreseen):
    writer, reader = arena
    sent = messages(4) + [b"z" * 100_000]
    placing = writer.stream(1, foreseen)
    for message in sent:
        placing.add(message)
    where = placing.done()
    assert [bytes(v) for v in reader.views(where)] == sent
    ends = list(itertools.accumulate(size + skip for size, skip in zip(where["sizes"], where["skips"])))
    assert all((where["offset"] + end) % END_ALIGN == 0 for end in ends)   # each message ends aligned
    end = where["offset"] + sum(where["sizes"]) + sum(where["skips"])
    after = writer.place(2, messages(5))
    if foreseen >= end - where["offset"]:
        assert after["offset"] == -(-end // shared.ALIGN) * shared.ALIGN   # the unused end was free again
    assert after["offset"] >= end or after["offset"] + sum(after["sizes"]) + sum(after["skips"]) <= where["offset"]
    assert [bytes(v) for v in reader.views(where)] == sent                  # ... and the messages still intact
    writer.release(1)
    writer.release(2)
    assert writer.place(3, messages(6))["offset"] == 0


def update(seed: int, chunks: int = 3, size: int = 200_000) -> list:
    layout = Layout.build([("w", "F32", (chunks * size // 4,))])
    head = fpb.UpdateMessage(header=fpb.UpdateHeader(task_id=f"t{seed}", manifest=layout.to_proto()))
    return [head, *(fpb.UpdateMessage(chunk=tensor_pb2.Chunk(offset=i * size, data=bytes([seed + i]) * size))
                    for i in range(chunks))]


def test_a_worker_streams_an_update_into_its_arena_as_the_agent_yields_it(arena):
    writer, reader = arena
    host = SiteHost(writer)
    sent = update(1)
    made: list = []

    def agent_stream():   # messages made one by one, as an agent's generator makes them
        for message in sent:
            made.append(message)
            yield message

    def submit() -> None:
        host._compute.acquire()
        host._holding.value = True
        host.call("site-a", "SubmitUpdate", agent_stream())

    thread = threading.Thread(target=submit)
    thread.start()
    header, inline = host.outgoing(timeout=10)
    assert inline == [] and len(made) == len(sent)
    assert [bytes(v) for v in reader.views(header["arena"])] == [m.SerializeToString() for m in sent]
    host.receive({"op": "reply", "call": header["call"]}, [])
    thread.join(timeout=10)
    assert writer.place(9, messages(2))["offset"] == header["arena"]["offset"]   # free again


def test_an_update_whose_agent_fails_part_way_leaves_nothing_lent(arena):
    writer, _ = arena
    host = SiteHost(writer)

    def failing():
        yield from update(2)[:2]
        raise OSError("the site's disk failed while it encoded its update")

    host._compute.acquire()
    host._holding.value = True
    with pytest.raises(OSError, match="disk failed"):
        host.call("site-a", "SubmitUpdate", failing())
    assert host._waiting == {} and writer.place(9, messages(2))["offset"] == 0   # the region is free again
    assert all(host._answering.acquire(timeout=1) for _ in range(ANSWERING))   # every slot is back


@pytest.mark.parametrize("settles", ["reply", "held"])
def test_a_worker_lends_an_answers_region_until_the_simulator_replies_or_holds_it(arena, settles):
    """SiteHost puts an update's messages in the arena, sends only where they lie, and reuses the region once
    the simulator has replied to the call or said that it holds it (having copied it)."""
    writer, reader = arena
    host = SiteHost(writer)
    result: list = []

    def submit(seed: int) -> None:   # as a task's thread does: it computes, then answers
        host._compute.acquire()
        host._holding.value = True
        result.append(host.call("site-a", "SubmitUpdate", messages(seed)))

    first = threading.Thread(target=submit, args=(0,))
    first.start()
    header, inline = host.outgoing(timeout=10)
    assert inline == [] and header["method"] == "SubmitUpdate"
    assert [bytes(v) for v in reader.views(header["arena"])] == messages(0)
    second = threading.Thread(target=submit, args=(1,))
    second.start()
    header2, _ = host.outgoing(timeout=10)
    assert header2["arena"]["offset"] != header["arena"]["offset"]   # the first is still lent
    if settles == "held":
        host.receive({"op": "held", "call": header["call"]}, [])
    host.receive({"op": "reply", "call": header["call"]}, [])
    host.receive({"op": "reply", "call": header2["call"]}, [])
    first.join(timeout=10)
    second.join(timeout=10)
    assert len(result) == 2
    third = writer.place(99, messages(2))
    assert third["offset"] == header["arena"]["offset"]   # both regions free again, merged


def test_a_reply_read_from_the_down_arena_is_freed_once_nothing_uses_it(arena):
    """The simulator places a served model in the worker's down arena; the worker's sites read its chunks there, in
    place and aligned, and the worker says `free` once none of them is in use: only then may the simulator place
    the next one there."""
    writer, reader = arena   # here the simulator writes and the worker reads
    host = SiteHost()
    model = [fpb.ModelMessage(chunk=tensor_pb2.Chunk(offset=i * BIG, data=bytes([i]) * BIG)).SerializeToString()
             for i in range(2)]
    got: list = []

    def fetch() -> None:
        host._compute.acquire()
        host._holding.value = True
        got.extend(_Calls(host, "site-a").FetchModel(fpb.FetchModelRequest()))

    thread = threading.Thread(target=fetch)
    thread.start()
    header, _ = host.outgoing(timeout=10)
    where = writer.place(header["call"], model)
    host.receive({"op": "reply", "call": header["call"], "shared": True}, reader.views(where))
    thread.join(timeout=10)
    assert [bytes(m.chunk.data) for m in got] == [bytes([i]) * BIG for i in range(2)]
    assert all(isinstance(m.chunk.data, memoryview) and m.chunk.data.readonly for m in got)
    assert all((np.frombuffer(m.chunk.data, np.uint8).ctypes.data + BIG) % END_ALIGN == 0 for m in got)
    with pytest.raises(queue.Empty):
        host.outgoing(timeout=0.2)   # its chunks are in use: no `free`
    del got[1:]
    with pytest.raises(queue.Empty):
        host.outgoing(timeout=0.2)   # one still is
    got.clear()
    assert host.outgoing(timeout=10) == ({"op": "free", "call": header["call"]}, [])
    assert writer.place(-1, model)["offset"] != where["offset"]   # not freed yet on the simulator's side
    writer.release(header["call"])
    writer.release(-1)
    assert writer.place(-2, model)["offset"] == where["offset"]


def test_while_a_task_waits_for_its_model_another_task_of_the_worker_computes():
    host = SiteHost()
    fetched: list = []

    def fetch() -> None:   # a task: it computes (holds the worker's one compute slot) until it must wait
        host._compute.acquire()
        host._holding.value = True
        fetched.extend(_Calls(host, "site-a").FetchModel(fpb.FetchModelRequest()))
        fetched.append(host._compute.acquire(blocking=False))   # False: it holds the slot again

    thread = threading.Thread(target=fetch)
    thread.start()
    header, _ = host.outgoing(timeout=10)            # its FetchModel is on its way to the simulator
    assert host._compute.acquire(timeout=10)         # ... and the slot is free for another task meanwhile
    model = [fpb.ModelMessage(chunk=tensor_pb2.Chunk(offset=0, data=b"m" * 8)).SerializeToString()]
    host.receive({"op": "reply", "call": header["call"]}, model)
    time.sleep(0.2)
    assert thread.is_alive() and not fetched         # it waits for the slot before it goes on
    host._compute.release()
    thread.join(timeout=10)
    assert [bytes(m.chunk.data) for m in fetched[:1]] == [b"m" * 8] and fetched[1] is False


def test_a_served_model_is_parsed_as_it_arrives_so_a_task_told_it_is_cached_finds_it():
    """Tasks wait for their models without computing, and whichever takes the compute slot first goes on: the
    task whose reply says `cached` may go before the one that brought the model."""
    host = SiteHost()
    got: dict = {}

    def fetch(site: str) -> None:
        host._compute.acquire()
        host._holding.value = True
        got[site] = [bytes(m.SerializeToString() if hasattr(m, "SerializeToString") else m.chunk.data)
                     for m in _Calls(host, site).FetchModel(fpb.FetchModelRequest())]
        host._compute.release()

    threads = [threading.Thread(target=fetch, args=(site,)) for site in ("site-a", "site-b")]
    for thread in threads:
        thread.start()
    calls = {h["site"]: h["call"] for h, _ in (host.outgoing(timeout=10), host.outgoing(timeout=10))}
    assert host._compute.acquire(timeout=10)   # neither task goes on yet
    head = fpb.ModelMessage(header=fpb.ModelHeader(round=4)).SerializeToString()
    chunk = fpb.ModelMessage(chunk=tensor_pb2.Chunk(offset=0, data=b"w" * 16)).SerializeToString()
    host.receive({"op": "reply", "call": calls["site-a"], "cache": "k"}, [head, chunk])
    assert host._model[0] == "k"              # parsed on arrival, while its task still waits
    host.receive({"op": "reply", "call": calls["site-b"], "cached": "k"}, [head])
    host._compute.release()
    for thread in threads:
        thread.join(timeout=10)
    assert got["site-a"] == got["site-b"] == [head, b"w" * 16]


def test_a_served_model_that_cannot_be_parsed_fails_its_call_not_the_worker():
    host = SiteHost()
    failed: list = []

    def fetch() -> None:
        host._compute.acquire()
        host._holding.value = True
        try:
            _Calls(host, "site-a").FetchModel(fpb.FetchModelRequest())
        except LocalRpcError as exc:
            failed.append(exc.details())
        host._compute.release()

    thread = threading.Thread(target=fetch)
    thread.start()
    header, _ = host.outgoing(timeout=10)
    host.receive({"op": "reply", "call": header["call"], "cache": "k"}, [b"\x0a\xff"])   # cut short
    thread.join(timeout=10)
    assert len(failed) == 1 and "DecodeError" in failed[0]
    assert host._model == ("", [])   # nothing half-parsed is kept


WIDE_JOB = """\
name: wide
model: {name: mlp, args: {in_features: 13, num_classes: 2, hidden: [256, 256]}}
data: {dataset: heart-disease}
rounds: 2
strategy: {name: fedavg}
sites: {min: 2, deadline_s: 60}
train: {epochs: 1, batch_size: 16, optimizer: {name: sgd, lr: 0.05}}
seed: 3
"""


def test_without_shared_memory_every_message_travels_in_its_frame_and_the_bits_are_the_same(tmp_path, monkeypatch):
    """Where memfd_create is missing (not Linux) the pool gives its workers no arenas: the same job ends with the
    same model, its 280 KB updates and models all in the pipes' frames."""
    sites = {h: SiteConfig(site=h, coordinator="unused.invalid:1", kit=tmp_path / "unused",
                           datasets={"heart-disease": DatasetSpec(kind="heart-disease", hospital=h)},
                           policy=PolicySpec(allowed_models=("mlp",))) for h in ("cleveland", "hungary")}
    models, moved = {}, {}
    for supported in (True, False):
        monkeypatch.setattr(shared, "SUPPORTED", supported)
        pools = []

        def pool(*args, **kwargs):
            pools.append(ProcessPool(*args, **kwargs))
            return pools[-1]

        state = tmp_path / f"shared-{supported}"
        outcome = Simulator([WIDE_JOB], sites, state, workers=2, pool=pool, threads=1).run()
        assert outcome.status == "completed"
        models[supported], moved[supported] = final_model(state, outcome.job_id), pools[0].shared_bytes
    assert moved[True]["up"] > 0 and moved[True]["down"] > 0
    assert moved[False] == {"up": 0, "down": 0}
    assert all(models[True][k].tobytes() == models[False][k].tobytes() for k in models[True])
