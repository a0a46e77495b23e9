"""A request's latency split into phases from the endpoints' own stamps, and their chart.

``compute_phases`` takes one request's ``RequestTimes`` from every rank (as the rank
processes return them) and follows the critical path: the decode rank that finished last,
its part that landed last, and that part's counterpart on its writer. The phases are
consecutive, so they add up to the latency (start → decode Succeeded):

staged::

    pickup          start → the writer's worker made the part (command queue, worker wake)
    prepare         → AllocRequest sent (or the RequestKV's pre-grant taken) and gather
                      enqueued (host work, either order)
    grant wait      → the Grant handled (decode's turn-around and two messages; 0 for a
                      pre-granted part)
    gather          → the gather seen complete, where it outlasted the grant wait
    post            → the WRITE posted
    post → notification  → decode handled the StagedPart (the WRITE and its notification)
    scatter         → the scatter seen complete
    completion      → decode's request Succeeded (the other writers, the checks)

contiguous: pickup, post (descriptors computed and posted), post → notification,
completion. With thousands of descriptors NIXL's post call can itself progress the whole
WRITE, and decode may handle the notification before the call returns: "post" then ends
at the notification and "post → notification" is 0.

Also kept, not part of the sum: each overlapped step's own duration (gather from enqueue to
seen complete, the grant round trip, the WRITE from post to DONE as prefill saw it, scatter)
and every stamp relative to the start. Pure functions over plain dicts, apart
from ``write_phase_chart`` (matplotlib, imported there).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pd_transfer.common.phases import Stamp

__all__ = ["DIRECT_PHASES", "STAGED_PHASES", "compute_phases", "write_phase_chart"]

STAGED_PHASES = ("pickup", "prepare", "grant wait", "gather", "post",
                 "post → notification", "scatter", "completion")
DIRECT_PHASES = ("pickup", "post", "post → notification", "completion")

Times = Mapping[str, Any]  # a rank's RequestTimes as a dict (``bench._ranks._times_dict``)


def compute_phases(start: float, prefill: Mapping[int, Times], decode: Mapping[int, Times],
                   agents: Mapping[tuple[str, int], str]) -> dict[str, Any]:
    """The critical path's phase split of one request (module docstring). ``prefill`` and
    ``decode`` map TP ranks to their times; ``agents`` maps (role, rank) to agent names."""
    rank_of = {name: key for key, name in agents.items()}
    decode_rank = max(decode, key=lambda r: decode[r]["finished"])
    finished = decode[decode_rank]["finished"]
    last = max(decode[decode_rank]["parts"],
               key=lambda p: p["stamps"].get(Stamp.SCATTERED, p["stamps"][Stamp.NOTIFIED]))
    _, prefill_rank = rank_of[last["peer"]]
    me = agents[("decode", decode_rank)]
    ours = next(p for p in prefill[prefill_rank]["parts"]
                if p["peer"] == me and p["part"] == last["part"])
    pre, dec = ours["stamps"], last["stamps"]
    if last["path"] == "staged":
        ready_to_post = max(pre[Stamp.GRANTED], pre[Stamp.GATHERED])
        asked = pre.get(Stamp.ALLOC_SENT, pre.get(Stamp.PREGRANT_TAKEN, 0.0))
        prepared = max(asked, pre.get(Stamp.GATHER_ENQUEUED, 0.0))
        granted = max(pre[Stamp.GRANTED], prepared)  # a pre-grant is taken before the gather
        split = {
            "pickup": pre[Stamp.PICKED] - start,
            "prepare": prepared - pre[Stamp.PICKED],
            "grant wait": granted - prepared,
            "gather": max(0.0, pre[Stamp.GATHERED] - granted),
            "post": pre[Stamp.POSTED] - ready_to_post,
            "post → notification": dec[Stamp.NOTIFIED] - pre[Stamp.POSTED],
            "scatter": dec[Stamp.SCATTERED] - dec[Stamp.NOTIFIED],
            "completion": finished - dec[Stamp.SCATTERED],
        }
        overlapped = {
            "gather": pre[Stamp.GATHERED] - pre[Stamp.GATHER_QUEUED],
            "gather enqueue": pre.get(Stamp.GATHER_ENQUEUED, asked) - pre[Stamp.GATHER_QUEUED],
            "write (post → DONE)": pre[Stamp.WRITTEN] - pre[Stamp.POSTED],
            "scatter enqueue": dec[Stamp.SCATTER_QUEUED] - dec[Stamp.NOTIFIED],
        }
        if Stamp.ALLOC_SENT in pre and Stamp.GRANT_SENT in dec:  # asked, not pre-granted
            overlapped["grant round trip"] = pre[Stamp.GRANTED] - pre[Stamp.ALLOC_SENT]
            overlapped["decode grant turn-around"] = (dec[Stamp.GRANT_SENT]
                                                      - dec[Stamp.ALLOC_RECEIVED])
    else:
        posted = min(pre[Stamp.POSTED], dec[Stamp.NOTIFIED])
        split = {
            "pickup": pre[Stamp.PICKED] - start,
            "post": posted - pre[Stamp.PICKED],
            "post → notification": dec[Stamp.NOTIFIED] - posted,
            "completion": finished - dec[Stamp.NOTIFIED],
        }
        overlapped = {"write (post → DONE)": pre[Stamp.WRITTEN] - pre[Stamp.POSTED]}
    return {
        "path": last["path"],
        "critical": {"decode_rank": decode_rank, "prefill_rank": prefill_rank,
                     "part": last["part"], "size_bytes": last["size_bytes"]},
        "split_s": split,
        "overlapped_s": overlapped,
        "stamps_s": {"prefill": {k: v - start for k, v in pre.items()},
                     "decode": {k: v - start for k, v in dec.items()},
                     "decode_finished": finished - start,
                     "prefill_finished": max(t["finished"] for t in prefill.values()) - start},
    }


def median_request(requests: list[dict[str, Any]]) -> dict[str, Any]:
    """The request of median latency (the upper one of an even count)."""
    ordered = sorted(requests, key=lambda r: r["latency_s"])
    return ordered[len(ordered) // 2]


def write_phase_chart(report: Mapping[str, Any], path: Path) -> None:
    """One bar per (combo, length, path) at 1 in flight (the median request): each phase's
    share of the latency, labelled with the latency and the raw WRITE's time."""
    import matplotlib  # noqa: PLC0415 - optional (the bench extra)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    bars: list[tuple[str, dict[str, float], float, float | None]] = []
    for row in report["results"]:
        combo = row["combo"]
        raw = row["paths"].get("raw")
        raw_s = raw["one_in_flight"]["latency_s"] if raw is not None else None
        for name, entry in row["paths"].items():
            if name == "raw":
                continue
            request = median_request(entry["requests"])
            label = (f"{combo['prefill_tp']}->{combo['decode_tp']} h{combo['kv_heads']} "
                     f"{row['tokens']} tok {name}")
            bars.append((label, request["phases"]["split_s"], request["latency_s"], raw_s))
    phases = list(STAGED_PHASES) + [p for p in DIRECT_PHASES if p not in STAGED_PHASES]
    colors = dict(zip(phases, plt.get_cmap("tab10").colors, strict=False))
    figure, axis = plt.subplots(figsize=(13, 0.32 * len(bars) + 1.8))
    for y, (_, split, latency, raw_s) in enumerate(reversed(bars)):
        left = 0.0
        # Shares of the phases' sum (= the latency; records made before "post" was clipped
        # at the notification may hold a small negative "post → notification", drawn as 0).
        total = sum(max(0.0, v) for v in split.values()) or 1.0
        for phase in phases:
            share = max(0.0, split.get(phase, 0.0)) / total * 100
            if share > 0:
                axis.barh(y, share, left=left, color=colors[phase], height=0.75)
                left += share
        note = f"{latency * 1e3:.3f} ms" + ("" if raw_s is None else f" (raw {raw_s * 1e3:.3f})")
        axis.text(101, y, note, va="center", fontsize=7)
    axis.set_yticks(range(len(bars)), [b[0] for b in reversed(bars)], fontsize=7)
    axis.set_xlim(0, 125)
    axis.set_xlabel("share of the request's latency (%), 1 in flight, median request")
    axis.set_title(f"bench transfer: {report['device']}, {report['link']}", fontsize=9,
                   pad=24)
    axis.legend(handles=[plt.Rectangle((0, 0), 1, 1, color=colors[p]) for p in phases],
                labels=phases, fontsize=7, loc="lower center", bbox_to_anchor=(0.5, 1.0),
                ncols=len(phases), frameon=False)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)
