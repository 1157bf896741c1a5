"""OUT, the one folder the lab writes in: every path it writes or deletes there is checked first.

A path is taken only when it lies inside OUT and no part of it below OUT is a symbolic link: a link
there (``OUT/.work -> /somewhere``) would let a prune, a report or a samples file land anywhere on
the disk. OUT itself may be a link (a bigger disk); the user chose it. Parts that do not exist yet
are fine: they are made as real folders.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

WORK = ".work"  # OUT/.work: a run's Locust files while it runs, the heartbeat, the timings


class OutsideOut(Exception):
    """A path the lab would write or delete is not inside OUT; one sentence naming it."""


def inside(root: Path | str, path: Path | str) -> Path:
    """``path`` as given, once it is known to lie inside ``root`` with no symbolic link on the way
    below ``root``; else OutsideOut."""
    root, path = Path(root), Path(path)
    base, target = Path(os.path.abspath(root)), Path(os.path.abspath(path))
    if target != base and base not in target.parents:
        raise OutsideOut(f"{path}: not inside OUT={root}; the lab writes and deletes only there")
    node = base
    for part in target.relative_to(base).parts:
        node = node / part
        if node.is_symlink():
            raise OutsideOut(f"{node}: a symbolic link (to {os.readlink(node)}); the lab writes and "
                             f"deletes only inside OUT={root} and follows no link there: remove "
                             f"the link, or choose another OUT")
        if not node.exists():
            break  # the rest is made by the lab, as real folders
    return path


def work_folder(out: Path | str) -> Path:
    """OUT/.work, checked."""
    return inside(out, Path(out) / WORK)


def make_folder(root: Path | str, path: Path | str) -> Path:
    """``path`` (inside ``root``, checked) made with its parents."""
    folder = inside(root, path)
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def remove_tree(root: Path | str, path: Path | str) -> None:
    """Remove the folder ``path`` inside ``root`` (checked first; a link inside it is removed as a
    link, never followed)."""
    shutil.rmtree(inside(root, path), ignore_errors=True)


def no_links_within(root: Path | str, folder: Path | str) -> Path:
    """``folder`` (inside ``root``, checked) once nothing in it is a symbolic link: a folder the lab
    writes file by file (a report) must not hand a write to a link in it."""
    folder = inside(root, folder)
    for top, dirs, files in os.walk(folder):
        for name in dirs + files:
            if os.path.islink(os.path.join(top, name)):
                inside(root, Path(top) / name)  # raises, naming the link
    return folder
