"""The pipeline benchmark's PNG timeline: per length, per mode, a compute row and a
transfer row of per-group bars on one time axis, and a tick where decode's KV is ready.

matplotlib is imported here only (the optional ``bench`` extra); nothing else needs it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["write_timeline"]

_COLORS = {"compute": ("#3b6fb6", "#8fb3e3"), "transfer": ("#d9822b", "#f2c18f")}


def write_timeline(report: dict[str, Any], path: Path) -> None:
    """Draw ``report`` (``bench.pipeline.run_bench``'s) into ``path`` (PNG)."""
    import matplotlib  # noqa: PLC0415 - optional dependency, loaded only when drawing

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    results = report["results"]
    fig, axes = plt.subplots(len(results), 1, figsize=(11, 2.3 * len(results) + 0.8),
                             squeeze=False)
    for ax, row in zip(axes[:, 0], results, strict=True):
        labels: list[str] = []
        y = 0
        for mode, data in reversed(list(row["modes"].items())):
            timeline = data["timeline"]
            for kind in ("transfer", "compute"):
                spans = timeline[kind]
                bars = [(a * 1e3, max(b - a, 0.0) * 1e3) for a, b in spans]
                colors = [_COLORS[kind][i % 2] for i in range(len(bars))]
                ax.broken_barh(bars, (y - 0.35, 0.7), facecolors=colors, edgecolor="white",
                               linewidth=0.3)
                labels.append(f"{mode} {kind}")
                y += 1
            ready = timeline["ready_s"] * 1e3
            ax.plot([ready, ready], [y - 2.45, y - 0.55], color="black", linewidth=1.5)
            ax.text(ready, y - 1.5, f" ready {ready:.1f} ms (N={data['groups']})",
                    va="center", fontsize=7)
        ax.set_yticks(range(len(labels)), labels, fontsize=7)
        ax.set_title(f"{row['tokens']} tokens: C {row['compute_s'] * 1e3:.1f} ms, "
                     f"T {row['transfer_s'] * 1e3:.1f} ms", fontsize=9, loc="left")
        ax.set_xlabel("ms since prefill start", fontsize=7)
        ax.tick_params(axis="x", labelsize=7)
        ax.grid(axis="x", alpha=0.3)
    fig.suptitle(f"Layer pipeline: prefill {report['device']} → decode "
                 f"{report['decode_device']}, link {report['link']} (median runs; "
                 f"alternating shades = groups)", fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
