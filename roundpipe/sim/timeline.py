"""`roundpipe timeline TRACE --png FILE`: draw any roundpipe trace, simulated or measured.

One row per worker (in natural order: "GPU 2" before "GPU 10"), one box per event,
coloured by category (forward, recompute, backward, fused, copy, optimizer, ...;
unknown categories get the next colour of a fixed cycle so two traces drawn
separately use the same colours for the same categories).  Times are drawn in ms
from the trace's first event, so a simulated and a measured iteration line up.
matplotlib is imported only here, with the Agg backend (no display needed).
"""
from __future__ import annotations

import argparse
import os
import re

from roundpipe.trace import Trace

COLOURS = {"forward": "#4C72B0", "recompute": "#8FB3E0", "backward": "#DD8452", "fused": "#C44E52",
           "copy": "#55A868", "optimizer": "#8172B3", "": "#937860"}
_CYCLE = ["#DA8BC3", "#8C8C8C", "#CCB974", "#64B5CD", "#2F4B7C", "#A05195"]


def _natural(worker: str) -> list:
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", worker)]


def colour(cat: str) -> str:
    if cat not in COLOURS:
        COLOURS[cat] = _CYCLE[(len(COLOURS) - 7) % len(_CYCLE)]
    return COLOURS[cat]


def draw(trace: Trace, path: str | os.PathLike, title: str | None = None, labels: bool | None = None) -> None:
    """Renders `trace` to a PNG at `path`; `labels` writes event names in boxes (default: when few)."""
    if not trace.events:
        raise ValueError("trace has no events: nothing to draw")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    workers = sorted(trace.workers(), key=_natural)
    row = {w: i for i, w in enumerate(workers)}
    t0 = min(e.start for e in trace.events)
    t1 = max(e.end for e in trace.events)
    labels = len(trace.events) <= 200 if labels is None else labels
    fig, ax = plt.subplots(figsize=(min(24, 6 + len(trace.events) / 25), 1 + 0.45 * len(workers)))
    cats: dict[str, None] = {}
    for e in trace.events:
        cats[e.cat] = None
        x, w = (e.start - t0) * 1e3, e.duration * 1e3
        ax.broken_barh([(x, w)], (row[e.worker] - 0.4, 0.8), facecolors=colour(e.cat), edgecolor="white",
                       linewidth=0.3)
        if labels and w > 0.03 * (t1 - t0) * 1e3:
            ax.text(x + w / 2, row[e.worker], e.name.replace(" mb", "\n"), ha="center", va="center", fontsize=6)
    ax.set_yticks(range(len(workers)))
    ax.set_yticklabels(workers)
    ax.invert_yaxis()
    ax.set_xlim(0, (t1 - t0) * 1e3)
    ax.set_xlabel("time (ms)")
    ax.set_title(title or trace.metadata.get("schedule", "timeline"))
    ax.legend(handles=[Patch(color=colour(c), label=c or "other") for c in cats], loc="upper center",
              bbox_to_anchor=(0.5, -0.25 - 0.5 / len(workers)), ncol=len(cats), fontsize=8, frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="roundpipe timeline", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("trace", help="Chrome/Perfetto trace JSON written by roundpipe (simulated or measured)")
    parser.add_argument("--png", required=True, help="output PNG file")
    parser.add_argument("--title", default=None)
    args = parser.parse_args(argv)
    try:
        trace = Trace.load(args.trace)
        draw(trace, args.png, title=args.title)
    except (OSError, ValueError) as exc:
        parser.error(f"{args.trace}: {exc}")
    print(f"wrote {args.png} ({len(trace.events)} events, {len(trace.workers())} workers)")
    return 0
