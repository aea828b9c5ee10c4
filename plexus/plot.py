"""`plexus job plot`: a job's metrics per round as one PNG (headless; no display needed).

Rows are the coordinator's metric rows (round, site, kind, name, value). Eval rows
are keyed by the model round that was evaluated (0 is the initial model), train
rows by the round that trained.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from pathlib import Path

from plexus.errors import PlexusError

_GLOBAL = ("accuracy", "auc")   # shown on the global panel when present; other eval names go there too


def weighted_by_round(rows: list[tuple], kind: str, name: str) -> dict[int, float]:
    """Per round, `name` averaged over sites, each weighted by its num_samples row (1 when missing)."""
    values: dict[int, dict[str, float]] = defaultdict(dict)
    weights: dict[int, dict[str, float]] = defaultdict(dict)
    for round_, site, k, n, v in rows:
        if k == kind and n == name:
            values[round_][site] = v
        elif k == kind and n == "num_samples":
            weights[round_][site] = v
    out = {}
    for round_, per_site in sorted(values.items()):
        w = {s: weights[round_].get(s, 1.0) for s in per_site}
        total = sum(w.values())
        out[round_] = sum(per_site[s] * w[s] for s in per_site) / total if total else float("nan")
    return out


def per_site(rows: list[tuple], kind: str, name: str) -> dict[str, dict[int, float]]:
    out: dict[str, dict[int, float]] = defaultdict(dict)
    for round_, site, k, n, v in rows:
        if k == kind and n == name:
            out[site][round_] = v
    return {s: dict(sorted(c.items())) for s, c in sorted(out.items())}


def plot_metrics(rows: Iterable[tuple], path: Path, *, title: str = "") -> list[str]:
    """Write the PNG; returns the titles of the panels drawn."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    rows = [tuple(r) for r in rows]
    if not rows:
        raise PlexusError("the job has no metrics yet; plot it after its first round has closed")
    eval_names = sorted({n for _, _, k, n, _ in rows if k == "eval" and n not in ("num_samples", "loss")})
    global_names = [n for n in _GLOBAL if n in eval_names] or eval_names
    site_metric = global_names[0] if global_names else None
    has_epsilon = any(n == "epsilon" for _, _, _, n, _ in rows)

    panels = [("global model (held-out rows, all sites)", _draw_global, global_names),
              ("loss", _draw_loss, None)]
    if site_metric:
        panels.append((f"per-site held-out {site_metric}", _draw_sites, site_metric))
    if has_epsilon:
        panels.append(("privacy budget ε", _draw_epsilon, None))

    fig = Figure(figsize=(6.5 * min(len(panels), 2), 4.2 * ((len(panels) + 1) // 2)), dpi=100)
    FigureCanvasAgg(fig)
    axes = fig.subplots((len(panels) + 1) // 2, min(len(panels), 2), squeeze=False).ravel()
    for ax, (panel_title, draw, arg) in zip(axes, panels):
        draw(ax, rows, arg)
        ax.set_title(panel_title)
        ax.set_xlabel("round")
        ax.grid(True, alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    for ax in axes[len(panels):]:
        ax.set_visible(False)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, format="png")
    return [p[0] for p in panels]


def _draw_global(ax, rows, names) -> None:
    for name in names:
        curve = weighted_by_round(rows, "eval", name)
        ax.plot(list(curve), list(curve.values()), marker="o", markersize=3, label=name)
    ax.set_ylabel("value (round r = model after r rounds)")


def _draw_loss(ax, rows, _) -> None:
    for kind, name, label in (("eval", "loss", "held-out loss (global model)"),
                              ("train", "train_loss", "training loss (sites' mean)")):
        curve = weighted_by_round(rows, kind, name)
        if curve:
            ax.plot(list(curve), list(curve.values()), marker="o", markersize=3, label=label)
    ax.set_ylabel("cross-entropy")


def _draw_sites(ax, rows, name) -> None:
    for site, curve in per_site(rows, "eval", name).items():
        ax.plot(list(curve), list(curve.values()), marker=".", label=site or "(coordinator)")
    ax.set_ylabel(name)


def _draw_epsilon(ax, rows, _) -> None:
    for site, curve in per_site(rows, *_epsilon_key(rows)).items():
        ax.plot(list(curve), list(curve.values()), marker="o", markersize=3, label=site or "global")
    ax.set_ylabel("ε (spent so far)")


def _epsilon_key(rows) -> tuple[str, str]:
    kinds = sorted({k for _, _, k, n, _ in rows if n == "epsilon"})
    return kinds[0], "epsilon"
