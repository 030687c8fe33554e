"""``shardkit train --plot run.png``: one figure of a finished run, drawn on rank 0.

Left, the loss curves: this rank's training loss per step and the eval loss at each estimate.
Right, each rank's measured bytes by category (params, grads, optimizer state) with the
planner's figure for the same layout beside them, when the run has one. matplotlib is an
optional dependency (``pip install 'shardkit[plot]'``); :func:`check_plot_path` says so before
any training starts.
"""

from __future__ import annotations

import os
from typing import Any

__all__ = ["check_plot_path", "plot_run"]

_CATEGORIES = (("param_bytes", "params"), ("grad_bytes", "grads"), ("optim_state_bytes", "optimizer state"))


def check_plot_path(path: str) -> None:
    """Raise ``ValueError`` (naming ``--plot``) when ``path`` cannot be drawn: no matplotlib, or
    another extension than ``.png``/``.svg``/``.pdf`` (``TrainConfig.validate`` checks its directory)."""
    if os.path.splitext(path)[1].lower() not in (".png", ".svg", ".pdf"):
        raise ValueError(f"--plot {path!r}: give a .png, .svg or .pdf file name")
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ValueError("--plot needs matplotlib: pip install 'shardkit[plot]'") from None


def plot_run(
    path: str, *, title: str, train_loss: list[float], evals: list[tuple[int, float]], ranks: list[dict[str, Any]]
) -> None:
    """Write the run's figure to ``path`` (see the module docstring).

    Args:
        path: output file (.png, .svg or .pdf).
        title: the figure's title (model, layout, steps).
        train_loss: rank 0's loss at steps 1..N.
        evals: ``(step, eval loss)`` pairs.
        ranks: every rank's summary (``param_bytes``, ``grad_bytes``, ``optim_state_bytes`` and an
            optional ``plan`` dict with the same keys).

    Example:
        >>> plot_run("run.png", title="tinygpt zero2", train_loss=[4.0, 3.5], evals=[(2, 3.6)],
        ...          ranks=[{"param_bytes": 2**20, "grad_bytes": 2**19, "optim_state_bytes": 2**21}])
    """
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    fig, (loss_ax, mem_ax) = plt.subplots(1, 2, figsize=(11, 4))
    loss_ax.plot(range(1, len(train_loss) + 1), train_loss, label="train (rank 0)", lw=1)
    if evals:
        loss_ax.plot([s for s, _ in evals], [v for _, v in evals], "o-", label="eval")
    loss_ax.set(xlabel="step", ylabel="loss (nats/token)", title="loss")
    loss_ax.legend()

    has_plan = any(r.get("plan") for r in ranks)
    width = 0.4 if has_plan else 0.8
    ticks, labels = [], []
    for k, (key, name) in enumerate(_CATEGORIES):
        for r, s in enumerate(ranks):
            x = k * (len(ranks) + 1) + r
            ticks.append(x)
            labels.append(f"{name}\nrank {r}")
            mem_ax.bar(x - width / 2 if has_plan else x, s[key] / 2**20, width, color=f"C{k}")
            planned = (s.get("plan") or {}).get(key)
            if planned is not None:
                mem_ax.bar(x + width / 2, planned / 2**20, width, color=f"C{k}", alpha=0.35, hatch="//")
    mem_ax.set_xticks(ticks, labels, fontsize=7)
    mem_ax.set(ylabel="MiB per rank", title="memory per rank: measured (solid), planner (hatched)")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
