"""ServerApp: FedAvg over all virtual clients every round, no client evaluation; stamps each round to a file.

After the last round it writes a JSON result: for `trivial`, how far every parameter moved against the exact
expected shift; for `fmnist`, the final global model's accuracy on the t10k test set.
"""

import json
import os
import time
from pathlib import Path

import numpy as np
from flwr.app import ArrayRecord, Context, MetricRecord
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg

from plexussim.client_app import DELTA

app = ServerApp()


def vector_model(size: int, chunks: int) -> list:
    """`chunks` float32 tensors totalling `size`, as Plexus' `vector` model (random: see client_app)."""
    rng = np.random.default_rng(0)
    bounds = [size * i // chunks for i in range(chunks + 1)]
    return [rng.standard_normal(b - a, dtype=np.float32) for a, b in zip(bounds, bounds[1:])]


@app.main()
def main(grid: Grid, context: Context) -> None:
    cfg = context.run_config
    task, rounds, sites = str(cfg["task"]), int(cfg["num-server-rounds"]), int(cfg["num-sites"])
    stamp_file = str(cfg["stamp-file"])

    def stamp(server_round: int, arrays: ArrayRecord) -> MetricRecord:
        # Strategy.start calls this before round 1 (server_round 0) and after each round's aggregation.
        if stamp_file:
            with open(stamp_file, "a") as fh:
                fh.write(json.dumps({"round": server_round, "t": time.time()}) + "\n")
        return MetricRecord({})

    strategy = FedAvg(fraction_train=1.0, fraction_evaluate=0.0, min_train_nodes=sites,
                      min_evaluate_nodes=0, min_available_nodes=sites)
    if task == "fmnist":
        import torch

        from plexussim.cnn import CNN

        torch.manual_seed(int(cfg["seed"]))
        model = CNN(width=int(cfg["width"]))
        initial = ArrayRecord(model.state_dict())
    else:
        initial = ArrayRecord(vector_model(int(cfg["size"]), int(cfg["chunks"])))
    result = strategy.start(grid=grid, initial_arrays=initial, num_rounds=rounds, evaluate_fn=stamp)
    t_end = time.time()
    out = {"task": task, "rounds": rounds, "sites": sites, "server_pid": os.getpid(),
           "train_metrics": {str(k): dict(v) for k, v in result.train_metrics_clientapp.items()}}
    if task == "fmnist":
        out.update(_evaluate_fmnist(model, result.arrays, Path(str(cfg["data-dir"]))))
    else:
        out.update(_check_trivial(result.arrays, int(cfg["size"]), int(cfg["chunks"]), rounds, sites))
    out["evaluation_s"] = time.time() - t_end
    if cfg["result-file"]:
        Path(str(cfg["result-file"])).write_text(json.dumps(out))


def _check_trivial(arrays: ArrayRecord, size: int, chunks: int, rounds: int, sites: int) -> dict:
    """Every parameter must have moved by rounds x the mean of the clients' constants (equal weights)."""
    expected = rounds * DELTA * (sites + 1) / 2
    final = arrays.to_numpy_ndarrays()
    start = vector_model(size, chunks)
    moved = [f.astype(np.float64) - s for f, s in zip(final, start)]
    return {"expected_shift": expected,
            "shift_min": float(min(m.min() for m in moved)), "shift_max": float(max(m.max() for m in moved)),
            "max_abs_error": float(max(np.abs(m - expected).max() for m in moved)),
            "parameters": int(sum(f.size for f in final)), "dtype": str(final[0].dtype)}


def _evaluate_fmnist(model, arrays: ArrayRecord, data_dir: Path) -> dict:
    import torch

    model.load_state_dict(arrays.to_torch_state_dict())
    model.eval()
    with np.load(data_dir / "test.npz") as data:
        x, y = torch.from_numpy(data["x"]), torch.from_numpy(data["y"])
    correct, loss = 0, 0.0
    with torch.no_grad():
        for start in range(0, len(y), 1000):
            logits = model(x[start:start + 1000])
            loss += torch.nn.functional.cross_entropy(logits, y[start:start + 1000], reduction="sum").item()
            correct += int((logits.argmax(1) == y[start:start + 1000]).sum())
    return {"test_accuracy": correct / len(y), "test_loss": loss / len(y), "test_rows": len(y),
            "parameters": int(sum(p.numel() for p in model.parameters()))}
