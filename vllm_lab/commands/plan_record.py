"""An experiment's plan is part of the experiment: the options that shape its runs (the scenario's
layers, the backend, repeats, and the command's own: the swept flag and its values, the shape
and levels, ...) are recorded with it when it is made, and a resume (RESUME=1, or EXPERIMENT= of
one that exists) restores them; an option given again must say the same, or the resume is
refused in one sentence, so two plans never mix in one experiment.

What may change between a run and its resume is left out: where it runs (INVENTORY, SPREAD, OUT),
how long it may take (DEADLINE, TRIALS of a search, GPU_MINUTES) and how it is shown (LIVE).
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from vllm_lab.commands.arguments import UsageError
from vllm_lab.store import Store, store_path

# The options that shape the runs of every long command, then each command's own.
_COMMON = ("--scenario", "--hardware", "--set", "--backend", "--repeats", "--precision")
SHAPING: dict[str, tuple[str, ...]] = {
    "baseline": _COMMON,
    "sweep": _COMMON + ("--param", "--values"),
    "combo": _COMMON + ("--params", "--grid"),
    "tune": _COMMON + ("--objective", "--space", "--study-storage", "--startup-trials", "--confirm",
                       "--confirm-backend"),
    "stress": _COMMON + ("--shape", "--levels", "--refine"),
    "claims": _COMMON + ("--claims",),
    "calibrate": _COMMON + ("--reference",),
    "autotune": _COMMON + ("--trials", "--space", "--seed", "--top", "--objective"),
}
# Options whose repeats are a list of items (order aside, the same list is the same plan).
_LISTS = ("--set", "--reference")
# What names the experiment a RESUME=1 without EXPERIMENT continues, besides the command.
_NAMING = ("--scenario", "--param", "--shape")
_DEFAULTS = {"--scenario": ["default"], "--backend": ["twin"]}
Options = dict[str, list[str]]
# The key of an experiment's meta that keeps the plan: the command that made it and its options.
META_KEY = "made_by"


def given(argv: Sequence[str], command: str) -> Options:
    """The shaping options ``argv`` gives, each with its values as written (``--set`` repeats)."""
    wanted, out = SHAPING.get(command, ()), {}
    words = list(argv)
    i = 0
    while i < len(words):
        name, eq, value = words[i].partition("=")
        if name in wanted:
            if not eq and name != "--reference":
                i += 1
                value = words[i] if i < len(words) else ""
            if name == "--reference":  # nargs: the words up to the next option
                values = [value] if eq else []
                while not eq and i + 1 < len(words) and not words[i + 1].startswith("--"):
                    i += 1
                    values.append(words[i])
                out.setdefault(name, []).extend(values)
            else:
                out.setdefault(name, []).append(value)
        i += 1
    return out


def _same(option: str, a: list[str], b: list[str]) -> bool:
    if option in _LISTS:
        return sorted(a) == sorted(b)
    return [v.replace(" ", "") for v in a] == [v.replace(" ", "") for v in b]


def words(options: Mapping[str, list[str]]) -> list[str]:
    """The options as command-line words (``--opt=value`` each)."""
    return [f"{name}={v}" for name, values in options.items() for v in values]


class Restored:
    """The command line a command runs with: the given one, or, for an experiment that exists and
    recorded its plan, the given one with the plan's options it left out."""

    def __init__(self, argv: list[str], plan: Options, experiment: str | None, restored: Options):
        self.argv, self.plan, self.experiment, self.restored = argv, plan, experiment, restored


def restore(argv: list[str], args: Any, show: Callable[[str, list[str]], str]) -> Restored:
    """``argv`` with the recorded plan of the experiment it resumes restored, or UsageError when
    an option given contradicts it; ``show(option, values)`` names an option as the user wrote it
    (a make variable, or the lab's option)."""
    command = argv[0]
    mine = given(argv[1:], command)
    if command not in SHAPING:
        return Restored(argv, mine, None, {})
    path = store_path(args.out, args.store)
    found = _recorded(path, command, args.experiment, mine) if (
        args.experiment or args.resume) and path.exists() else None
    if found is None:
        return Restored(argv, mine, None, {})
    exp_id, plan = found
    for option in sorted(set(plan) | set(mine)):
        if option in mine and not _same(option, mine[option], plan.get(option, _DEFAULTS.get(option, []))):
            was = show(option, plan.get(option, _DEFAULTS.get(option, [])))
            now = show(option, mine[option])
            raise UsageError(f"EXPERIMENT={exp_id} was planned with {was}, and {now} contradicts "
                             f"it: leave {now.partition('=')[0]} out to resume it as planned, or "
                             f"start a new experiment (another EXPERIMENT, no RESUME=1)")
    missing = {o: v for o, v in plan.items() if o not in mine}
    restored_argv = [*argv, *words(missing)]
    if not args.experiment:
        restored_argv.append(f"--experiment={exp_id}")
    return Restored(restored_argv, plan, exp_id, missing)


def _recorded(path: Path, command: str, experiment: str | None,
              mine: Options) -> tuple[str, Options] | None:
    """The experiment a resume continues and its recorded plan: EXPERIMENT, or the newest of this
    command whose plan has the same scenario (and swept flag or shape); None where there is none
    with a plan (an experiment made before plans were recorded resumes as it always did)."""
    with Store(path) as store:
        rows = store.experiments()
    for row in rows.to_dict("records"):  # newest first
        if experiment and row["id"] != experiment:
            continue
        plan = json.loads(row["meta_json"] or "{}").get(META_KEY)
        if not plan or plan.get("command") != command:
            if experiment:
                return None
            continue
        options = plan.get("options", {})
        alike = all(_same(o, options.get(o, _DEFAULTS.get(o, [])), mine.get(o, _DEFAULTS.get(o, [])))
                    for o in _NAMING)
        if experiment or alike:
            return row["id"], options
    return None


def record(command: str, options: Options, **resolved: str) -> dict[str, Any]:
    """The plan an experiment's meta keeps: the command and its shaping options, with what the
    command resolved in place of an option left out (``values``: the ladder it took)."""
    extra = {f"--{k.replace('_', '-')}": [v] for k, v in resolved.items() if v is not None}
    return {"command": command, "options": {**extra, **options}}


def resume_words(command: str, plan: Mapping[str, Any], exp_id: str) -> str:
    """The lab command line that resumes an experiment from its plan alone."""
    return shlex.join(["scripts/lab.py", command, *words(plan.get("options", {})), "--resume",
                       f"--experiment={exp_id}"])
