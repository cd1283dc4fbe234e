"""`roundpipe timeline TRACE --png FILE`: draw any roundpipe trace, simulated or measured.

One row per worker (in natural order: "GPU 2" before "GPU 10"), one box per event,
coloured by its shared category (roundpipe.trace.category: the engine's "F" / "B"
are drawn as the simulator's "forward" / "backward", so a simulated and a recorded
iteration use the same colours and legend entries).  Categories outside
`trace.CATEGORIES` get a colour from a fixed cycle chosen by their name, so they
too keep one colour in every picture.  The legend sits to the right of the plot,
outside it.  Times are drawn in ms from the trace's first event.

Labels are fitted to the space: an event wide enough for its text shows its stage
and microbatch ("F2" over "3"); where events are too narrow (many stages or
microbatches: at 40 stages x 16 microbatches a box is a few pixels wide) each run
of consecutive events of one stage on one worker shows the stage name once, when
the run is wide enough.  matplotlib is imported only here, with the Agg backend.
"""
from __future__ import annotations

import argparse
import os
import re
import zlib

from roundpipe.trace import CATEGORIES, Event, Trace, category

COLOURS = {"forward": "#4C72B0", "fused": "#C44E52", "recompute": "#8FB3E0", "backward": "#DD8452",
           "copy": "#55A868", "optimizer": "#8172B3", "": "#937860"}
_CYCLE = ["#DA8BC3", "#8C8C8C", "#CCB974", "#64B5CD", "#2F4B7C", "#A05195"]
_FONT = 7            # points, box labels
_CHAR_IN = 0.6 * _FONT / 72   # approximate width of one label character, inches
_ROW_IN = 0.32       # inches per worker row: two label lines of 7 pt fit in a box


def _natural(worker: str) -> list:
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", worker)]


def colour(cat: str) -> str:
    """The colour of a category: fixed for the shared ones, by name for any other."""
    cat = category(cat)
    if cat in COLOURS:
        return COLOURS[cat]
    return _CYCLE[zlib.crc32(cat.encode()) % len(_CYCLE)]


def _stage(e: Event) -> str:
    """The stage label of an event without its layer range: "F2", "B1" ("F0[0-1]" -> "F0")."""
    stage = str(e.args.get("stage", e.name.split(" ", 1)[0]))
    return re.sub(r"\[.*?\]", "", stage)


def _mb(e: Event) -> str:
    if "mb" in e.args:
        return str(e.args["mb"])
    found = re.search(r"\bmb(\d+)", e.name)
    return found.group(1) if found else ""


def _runs(events: list[Event]) -> list[list[Event]]:
    """Maximal runs of consecutive events of one stage (and iteration) on one worker."""
    runs: list[list[Event]] = []
    for e in sorted(events, key=lambda e: (e.start, e.end)):
        key = (e.args.get("iteration"), _stage(e))
        if runs and (runs[-1][-1].args.get("iteration"), _stage(runs[-1][-1])) == key:
            runs[-1].append(e)
        else:
            runs.append([e])
    return runs


def _legend_order(cats) -> list[str]:
    shared = [c for c in CATEGORIES if c in cats]
    return shared + sorted(c for c in cats if c not in CATEGORIES)


def figure(trace: Trace, title: str | None = None, labels: bool | None = None):
    """The timeline of `trace` as a matplotlib Figure (the caller closes it).

    `labels`: None fits labels to the space (per event, else per run of a stage), True
    labels every event that is not a sliver, False draws no labels."""
    if not trace.events:
        raise ValueError("trace has no events: nothing to draw")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    workers = sorted(trace.workers(), key=_natural)
    row = {w: i for i, w in enumerate(workers)}
    t0 = min(e.start for e in trace.events)
    span = max(max(e.end for e in trace.events) - t0, 1e-12) * 1e3   # ms
    width = min(24.0, 6 + len(trace.events) / 25)
    fig, ax = plt.subplots(figsize=(width, 1.2 + _ROW_IN * len(workers)))
    in_per_ms = width * (fig.subplotpars.right - fig.subplotpars.left) / span   # axes inches per ms
    for e in trace.events:
        x, w = (e.start - t0) * 1e3, e.duration * 1e3
        ax.broken_barh([(x, w)], (row[e.worker] - 0.4, 0.8), facecolors=colour(e.cat), edgecolor="white",
                       linewidth=0.3)
    if labels is not False:
        per_worker: dict[str, list[Event]] = {}
        for e in trace.events:
            per_worker.setdefault(e.worker, []).append(e)
        for worker, events in per_worker.items():
            for run in _runs(events):
                stage = _stage(run[0])
                texts = [(e, f"{stage}\n{_mb(e)}" if _mb(e) else stage) for e in run]
                fits = [len(max(t.split("\n"), key=len)) * _CHAR_IN + 0.04 <= e.duration * 1e3 * in_per_ms
                        for e, t in texts]
                if labels or all(fits):
                    for (e, text), ok in zip(texts, fits):
                        if ok or (labels and e.duration * 1e3 * in_per_ms > _CHAR_IN):
                            ax.text((e.start - t0 + e.duration / 2) * 1e3, row[worker], text, ha="center",
                                    va="center", fontsize=_FONT, clip_on=True)
                    continue
                start, end = run[0].start, max(e.end for e in run)
                if len(stage) * _CHAR_IN + 0.04 <= (end - start) * 1e3 * in_per_ms:
                    ax.text((start + end - 2 * t0) / 2 * 1e3, row[worker], stage, ha="center", va="center",
                            fontsize=_FONT, fontweight="bold", clip_on=True,
                            bbox=dict(boxstyle="square,pad=0.1", facecolor="white", edgecolor="none", alpha=0.75))
    ax.set_yticks(range(len(workers)))
    ax.set_yticklabels(workers, fontsize=8)
    ax.set_ylim(len(workers) - 0.5, -0.5)
    ax.set_xlim(0, span)
    ax.set_xlabel("time (ms)")
    ax.set_title(title or trace.metadata.get("schedule", "timeline"))
    cats = _legend_order({category(e.cat) for e in trace.events})
    ax.legend(handles=[Patch(color=colour(c), label=c or "other") for c in cats], loc="upper left",
              bbox_to_anchor=(1.005, 1.0), borderaxespad=0.0, fontsize=9, frameon=False)
    return fig


def draw(trace: Trace, path: str | os.PathLike, title: str | None = None, labels: bool | None = None) -> None:
    """Renders `trace` to a PNG at `path` (see `figure`); the legend is kept in the picture."""
    fig = figure(trace, title, labels)   # selects the Agg backend before pyplot is imported here
    import matplotlib.pyplot as plt

    try:
        fig.savefig(path, dpi=120, bbox_inches="tight")
    finally:
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
