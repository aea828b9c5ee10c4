"""ClientApp: `trivial` adds a site-specific constant to the arrays; `fmnist` trains Plexus' cnn one local pass."""

import json
import os
import time
from pathlib import Path

import numpy as np
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

app = ClientApp()

DELTA = 0.001        # virtual client i adds DELTA * (i + 1), as bench/flower_app and Plexus' bench site do
NUM_EXAMPLES = 100


def client_seed(seed: int, server_round: int, partition: int) -> int:
    """Each client's shuffling seed for one round: reproducible, different per round and client."""
    return (seed * 1_000_003 + server_round * 1_009 + partition) % (2**63)


@app.train()
def train(msg: Message, context: Context) -> Message:
    start = time.time()
    partition = int(context.node_config["partition-id"])
    if str(context.run_config["task"]) == "fmnist":
        content = _train_fmnist(msg, context, partition)
    else:
        content = _train_trivial(msg, partition)
    if log := str(context.run_config.get("client-log", "")):
        # Where a round's time goes: the clients' own work against the round's period (bench/flower_sim.py).
        with open(log, "a") as fh:
            fh.write(json.dumps({"round": int(msg.content["config"]["server-round"]), "partition": partition,
                                 "start": start, "end": time.time(), "pid": os.getpid()}) + "\n")
    return Message(content=content, reply_to=msg)


def _train_trivial(msg: Message, partition: int) -> RecordDict:
    arrays = msg.content["arrays"].to_numpy_ndarrays()
    # Site-specific constants: Flower's object store addresses content by hash, so identical updates from
    # several clients would be deduplicated, which a real federation's updates never are.
    delta = np.float32(DELTA * (partition + 1))
    for a in arrays:
        a += delta
    return RecordDict({"arrays": ArrayRecord(arrays), "metrics": MetricRecord({"num-examples": NUM_EXAMPLES})})


def _train_fmnist(msg: Message, context: Context, partition: int) -> RecordDict:
    # torch is imported here so that the trivial task runs in a venv without it.
    import torch
    import torch.nn.functional as F

    from plexussim.cnn import CNN

    cfg = context.run_config
    with np.load(Path(str(cfg["data-dir"])) / f"site-{partition}.npz") as data:
        x, y = torch.from_numpy(data["x"]), torch.from_numpy(data["y"])
    model = CNN(width=int(cfg["width"]))
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    optimizer = torch.optim.SGD(model.parameters(), lr=float(cfg["lr"]))
    batch, n = int(cfg["batch-size"]), len(y)
    order_rng = torch.Generator().manual_seed(
        client_seed(int(cfg["seed"]), int(msg.content["config"]["server-round"]), partition))
    model.train()
    loss_sum = 0.0
    # As Plexus' train_local: one seeded permutation per pass, the pass's last batch may be short.
    for _ in range(int(cfg["epochs"])):
        loss_sum = 0.0
        order = torch.randperm(n, generator=order_rng)
        for start in range(0, n, batch):
            rows = order[start:start + batch]
            loss = F.cross_entropy(model(x[rows]), y[rows])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            loss_sum += loss.item() * len(rows)
    metrics = {"num-examples": n, "train-loss": loss_sum / n, "torch-threads": torch.get_num_threads()}
    return RecordDict({"arrays": ArrayRecord(model.state_dict()), "metrics": MetricRecord(metrics)})
