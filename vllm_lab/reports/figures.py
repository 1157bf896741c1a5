"""Saving the reports' figures: one place for the backend, the resolution and the caption."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # no display on lab machines
import matplotlib.pyplot as plt

# One line under each figure, by file name: what to look at in it.
CAPTIONS = {
    "throughput": "Where goodput (orange) peaks is the best value; throughput still rising past it "
                  "means the SLO, not the server, is the limit.",
    "latency": "Read where a percentile crosses the red SLO line: the values past it miss the SLO.",
    "server": "A growing queue, a KV cache near 100% or any preemption say the server ran out of room "
              "at that value.",
    "heatmaps": "Bold cells meet the SLO and the red frame is the best of them: look for where the "
                "bold region ends.",
    "pareto": "Only points on the blue front are worth choosing; the gold star is the best that "
              "meets the SLO.",
    "history": "The blue step is the best so far: a flat tail means more trials would not help.",
    "importances": "The longest bar is the flag that moved the objective most; a flag with no bar had "
                   "no measurable effect and can stay at its default.",
    "stress": "The knee is where latency turns upward: past it requests queue faster than they are "
              "served.",
    "timeline": "Compare served with offered load: the gap during the spike, and how fast it closes "
                "after, is the recovery.",
    "effects": "Where the blue bar (measured) and the grey bar (claimed) point the same way, the "
               "claim holds here.",
    "baseline": "Bars marked * changed significantly since last period; the rest is within noise.",
    "best": "The gap between grey (baseline) and green (best under the SLO) is what tuning gained.",
    "sweeps": "A curve that peaks inside its range found a best value; one that rises to its edge "
              "needs a wider sweep.",
    "combos": "Blue points meet the SLO; the red front is the best throughput each latency allows.",
    "watch": "Red crosses are probes flagged as regressions against their recorded baseline.",
    "capacities": "Green is the best by the rule above; where grey (predicted) and the measured bar "
                  "part, the predictor misread that configuration. On the right, each staircase "
                  "crosses the red SLO line where its capacity ends.",
    "trace": "The traffic the flags were ranked on: the trace's arrivals as sent, and its lengths.",
    "energy": "A lower bar costs fewer joules for each token; where the SLO also holds, it is the "
              "cheaper setting to run.",
}


def caption_for(path: Path) -> str:
    """The one-line caption of a figure file ("" for one without)."""
    return CAPTIONS.get(path.stem, "")


def save(fig, path: Path) -> Path:
    """Write an experiment page's figure (cropped to its content) and free it."""
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path


def save_captioned(fig, path: Path, caption: str) -> Path:
    """Write a figure of a fixed layout with ``caption`` (what it came from) along its foot."""
    fig.text(0.01, 0.005, caption, fontsize=7, va="bottom", color="#555")
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
