"""ServerApp: FedAvg over the bench's float32 vector model; timestamps each round to a file."""

import json
import time

import numpy as np
from flwr.app import ArrayRecord, Context, MetricRecord
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg

app = ServerApp()


def vector_model(size: int, chunks: int) -> list:
    """The same shapes as Plexus' built-in `vector` model: `chunks` float32 tensors totalling `size`.

    Random values, not zeros: Flower's object store addresses content by hash, so constant arrays (or
    identical updates from several sites) would be deduplicated and under-count the bytes a real model
    moves. (Plexus sends raw bytes without dedup or compression, so its numbers do not depend on content.)
    """
    rng = np.random.default_rng(0)
    bounds = [size * i // chunks for i in range(chunks + 1)]
    return [rng.standard_normal(b - a, dtype=np.float32) for a, b in zip(bounds, bounds[1:])]


@app.main()
def main(grid: Grid, context: Context) -> None:
    cfg = context.run_config
    rounds, sites = int(cfg["num-server-rounds"]), int(cfg["num-sites"])
    stamp_file = str(cfg["stamp-file"])

    def stamp(server_round: int, arrays: ArrayRecord):
        # Called by Strategy.start before round 1 (server_round 0) and after each round's aggregation.
        if stamp_file:
            with open(stamp_file, "a") as fh:
                fh.write(json.dumps({"round": server_round, "t": time.time()}) + "\n")
        return MetricRecord({})

    strategy = FedAvg(fraction_train=1.0, fraction_evaluate=0.0, min_train_nodes=sites,
                      min_evaluate_nodes=0, min_available_nodes=sites)
    strategy.start(grid=grid, initial_arrays=ArrayRecord(vector_model(int(cfg["size"]), int(cfg["chunks"]))),
                   num_rounds=rounds, evaluate_fn=stamp)
