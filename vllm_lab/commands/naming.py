"""How a command names its experiment: step, scenario, parameter and the time, unique in the store;
with RESUME, the newest experiment alike."""

from __future__ import annotations

import re
import time
from pathlib import Path

from vllm_lab import outdir
from vllm_lab.commands.settings import Settings
from vllm_lab.scenarios import Scenario
from vllm_lab.store import Store, StoreError, check_experiment_name


def experiment_name(step: str, scenario: Scenario, param: str | None = None) -> str:
    """A readable experiment id: step, scenario, parameter and the time.

    The scenario's name is free text (a file may set any ``name:``); it is cut down to the store's
    experiment name pattern, so the id is always a single folder name inside OUT.
    """
    middle = "-".join([scenario.name] + ([param] if param else []))
    middle = re.sub(r"\.{2,}", ".", re.sub(r"[^A-Za-z0-9._-]+", "-", middle)).strip("-.") or "scenario"
    stamp = time.strftime("-%Y%m%d-%H%M%S")
    return f"{step}-{middle}"[: 120 - len(stamp)].rstrip("-.") + stamp


_STAMP = len("-YYYYmmdd-HHMMSS")


def experiment_id(settings: Settings, step: str, scenario: Scenario, param: str | None = None) -> str:
    """EXPERIMENT if given; with RESUME the newest experiment of this step, scenario and param;
    else a new name, made unique in the store (two commands started in the same second)."""
    if settings.experiment:
        return settings.experiment
    name = experiment_name(step, scenario, param)
    if not settings.store_path.exists():  # asking must not create the store: a bad input writes nothing
        if settings.resume:
            raise StoreError(f"{settings.store_path}: nothing to resume for {name[:-_STAMP]}; "
                             f"run without RESUME=1")
        return _claimed(settings, name, set())
    with Store(settings.store_path) as store:
        if settings.resume:
            newest = store.newest_experiment(name[:-_STAMP] + "-")
            if newest is None:
                raise StoreError(f"{settings.store_path}: nothing to resume for {name[:-_STAMP]}; "
                                 f"run without RESUME=1")
            return newest
        taken = set(store.experiments()["id"])
    return _claimed(settings, name, taken)


def _claimed(settings: Settings, name: str, taken: set[str]) -> str:
    """``name``, or ``name-2``, ``name-3``, ...: the first one not in the store whose work folder
    this process could make. Making a folder is atomic, so two commands started in the same
    second on one OUT get two ids, however close their store reads were."""
    work = outdir.make_folder(settings.out, outdir.work_folder(settings.out))
    unique, n = name, 2
    while True:
        check_experiment_name(unique)
        if unique not in taken:
            try:
                (work / unique).mkdir()
                return unique
            except FileExistsError:
                pass
        unique, n = f"{name}-{n}", n + 1


def newest_experiment(path: Path) -> str:
    """The newest experiment in the store, or StoreError saying there is none yet."""
    with Store(path) as store:
        newest = store.newest_experiment()
    if newest is None:
        raise StoreError(f"{path}: no experiments yet; run make baseline or make sweep first")
    return newest
