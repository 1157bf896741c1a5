"""Saving the reports' figures: one place for the backend, the resolution and the caption."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # no display on lab machines
import matplotlib.pyplot as plt


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
