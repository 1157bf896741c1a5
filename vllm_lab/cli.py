"""The lab's command line: parse, call one command (``vllm_lab.commands``), print. The Makefile
calls this: ``lab make TARGET`` reads the make variables as data (``make_argv``)."""

from __future__ import annotations

import argparse
import functools
import glob
import json
import os
import re
import shlex
import sqlite3
import sys
from collections.abc import Callable, Mapping
from pathlib import Path

import pandas as pd

from vllm_lab import outdir, scenarios, serving, shutdown
from vllm_lab.commands import (
    autotune,
    baseline,
    bench,
    calibrate,
    claims,
    combo,
    findings,
    hosts,
    lint,
    monitor,
    plan_record,
    quarterly,
    report,
    show,
    status,
    stress,
    sweep,
    tune,
    watch,
)
from vllm_lab.commands.arguments import UsageError
from vllm_lab.flags import redact_url
from vllm_lab.inputs import InputError
from vllm_lab.monitor import MonitorError
from vllm_lab.store import StoreError, describe_sqlite_error, store_path
from vllm_lab.watch import WatchError

# The commands in the order `lab --help` lists them; each adds its own parser.
COMMANDS = (lint, show, baseline, sweep, calibrate, status, report, combo, tune, stress, autotune,
            claims, monitor, watch, findings, hosts, bench, quarterly)


class LabParser(argparse.ArgumentParser):
    """argparse that raises UsageError instead of printing its usage and exiting."""

    def error(self, message: str):
        """argparse's hook for a bad command line."""
        raise UsageError(message)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of every lab command (options in full: a resume reads which were
    given, so no abbreviation stands for one)."""
    parser = LabParser(prog="lab", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True,
                                parser_class=functools.partial(LabParser, allow_abbrev=False))
    for command in COMMANDS:
        command.register(sub)
    return parser


# -- make: every make variable reaches the lab as data ---------------------------------------------

# The Makefile copies each variable's text, unexpanded, into the environment as LAB_MAKE_<NAME>
# and runs `lab.py make TARGET`; here it becomes an argument list, never shell or make text.
_SCENARIO_VARS = (("SCENARIO", "--scenario"), ("HARDWARE", "--hardware"))
_RUN_VARS = (("INVENTORY", "--inventory"), ("BACKEND", "--backend"), ("OUT", "--out"),
             ("EXPERIMENT", "--experiment"), ("RESUME", "--resume"), ("REPEATS", "--repeats"),
             ("SPREAD", "--spread"), ("LOADGEN_PROCESSES", "--loadgen-processes"),
             ("DEADLINE", "--deadline"), ("PRECISION", "--precision"), ("LIVE", "--live"),
             ("LIVE_HOST", "--live-host"))
MAKE_TARGETS: dict[str, tuple[tuple[str, str], ...]] = {
    "baseline": _RUN_VARS,
    "sweep": _RUN_VARS + (("PARAM", "--param"), ("VALUES", "--values")),
    "calibrate": _RUN_VARS + (("PROFILE_OUT", "--profile-out"), ("FIT_ONLY", "--fit-only"),
                              ("REFERENCE", "--reference"), ("FIT", "--fit")),
    "report": (("OUT", "--out"), ("EXPERIMENT", "--experiment")),
    "quarterly": (("PERIOD", "--period"), ("OUT", "--out"), ("PDF", "--no-pdf")),
    "combo": _RUN_VARS + (("PARAMS", "--params"), ("GRID", "--grid")),
    "tune": _RUN_VARS + (("TRIALS", "--trials"), ("OBJECTIVE", "--objective"), ("SPACE", "--space"),
                         ("STUDY_STORAGE", "--study-storage"), ("SEED", "--seed"),
                         ("CONFIRM", "--confirm"), ("CONFIRM_BACKEND", "--confirm-backend")),
    "stress": _RUN_VARS + (("SHAPE", "--shape"), ("LEVELS", "--levels")),
    "claims": _RUN_VARS + (("CLAIMS", "--claims"),),
    "autotune": _RUN_VARS + (("GPU_MINUTES", "--gpu-minutes"), ("TRIALS", "--trials"),
                             ("SPACE", "--space"), ("SEED", "--seed"), ("CONFIRM", "--top"),
                             ("OBJECTIVE", "--objective")),
    "monitor": (("INVENTORY", "--inventory"),),
    "watch": (("INVENTORY", "--inventory"), ("OUT", "--out"), ("URL", "--url"), ("EVERY", "--every"),
              ("COUNT", "--count"), ("BASELINE", "--baseline"), ("HARDWARE", "--hardware"),
              ("REPEATS", "--repeats"), ("SET", "--set")),
    "findings": (("OUT", "--out"), ("EXPERIMENT", "--experiment")),
    "provision": (("INVENTORY", "--inventory"),),
    "stop": (("INVENTORY", "--inventory"),),
    "teardown": (("INVENTORY", "--inventory"),),
    "bench": (("NAME", "name"), ("ARGS", "args")),
    "lint": (),
    "show": (),
    "status": (("OUT", "--out"),),
}
# Targets that take the scenario's layers (SCENARIO, HARDWARE, SET, MODEL, DURATION).
_LAYERED = {"baseline", "sweep", "calibrate", "combo", "tune", "stress", "claims", "lint", "show",
            "autotune"}
_REQUIRED = {"sweep": ("PARAM", "make sweep PARAM=max-num-seqs"),
             "stress": ("SHAPE", "make stress SHAPE=ramp (ramp, step, spike or soak)"),
             "combo": ("PARAMS or GRID", "make combo PARAMS=max-num-seqs,max-num-batched-tokens"),
             "bench": ("NAME", "make bench NAME=twin (make help lists them)")}
# Read by the container inventories from the environment (inventory/container.yml), not options.
_INVENTORY_VARS = ("VLLM_VENV", "LAB_ROOT")
# Values the Makefile gives variables left unset: they reach the lab as no option (its own default
# is the same), so a resume tells a variable given from one left out; a resume command leaves them
# out too.
_MAKE_DEFAULTS = {"SCENARIO": "default", "INVENTORY": "inventory/local.yml", "BACKEND": "twin",
                  "OUT": "reports"}
_SWITCHES = {"--resume", "--spread", "--fit-only", "--baseline", "--live"}
_ON, _OFF = ("1", "yes", "true", "on"), ("0", "no", "false", "off")


def _switch(name: str, text: str) -> bool:
    if text.lower() in _ON:
        return True
    if text.lower() in _OFF:
        return False
    raise UsageError(f"{name}={text!r} is not allowed: write {name}=1 to turn it on, or leave it out")


def _words(name: str, text: str) -> list[str]:
    """A variable that holds several items (SET, REFERENCE), split as a shell would split words,
    so a quoted item keeps its spaces: SET='serve.served-model-name="a b" load.shape.level=2'."""
    try:
        return shlex.split(text)
    except ValueError as e:
        raise UsageError(f"{name}={text!r} cannot be split into items ({e}); close every quote") from None


def make_argv(target: str, env: Mapping[str, str]) -> tuple[list[str], dict[str, str]]:
    """The lab's argument list for ``make TARGET`` from the LAB_MAKE_* environment, and which make
    variable each option came from (for error messages)."""
    def var(name: str) -> str:
        text = env.get(f"LAB_MAKE_{name}", "").strip()
        if any(not c.isprintable() for c in text):
            # A newline or other control character would split the one-line answer it ends up in.
            raise UsageError(f"{name}={text!r} is not allowed: a make variable is one line of "
                             f"printable text")
        return text

    for name in _INVENTORY_VARS:
        var(name)  # refused here, with a sentence, when it holds a control character
    if target == "report" and var("PERIOD"):
        target = "quarterly"
    if target not in MAKE_TARGETS:
        raise UsageError(f"make target {target!r} is not one the lab runs "
                         f"({', '.join(sorted(MAKE_TARGETS))})")
    required = _REQUIRED.get(target)
    if required and not any(var(n) for n in required[0].split(" or ")):
        raise UsageError(f"{required[0]} is required, e.g. {required[1]}")
    names: dict[str, str] = {}
    argv = [target]
    if target in _LAYERED:
        scenario = var("SCENARIO") or "default"
        if target == "lint" and scenario == "all":
            return ["lint", "--all"], names
        for name, option in _SCENARIO_VARS:
            if var(name) and var(name) != _MAKE_DEFAULTS.get(name):
                argv.append(f"{option}={var(name)}")
                names[option] = name
        argv += [f"--set={item}" for item in _words("SET", var("SET"))]
        if var("MODEL"):
            argv.append(f"--set=serve.model={json.dumps(var('MODEL'))}")
        if var("DURATION"):
            duration = _seconds_or_none(var("DURATION"))
            if not duration:
                raise UsageError(f"DURATION={var('DURATION')!r} is not allowed: seconds per run, "
                                 f"a number above 0")
            argv.append(f"--set=load.stop.duration_s={duration:g}")
        names["--set"] = "SET"
    for name, option in MAKE_TARGETS[target]:
        text = var(name)
        names[option] = name
        if not text or text == _MAKE_DEFAULTS.get(name):
            continue
        if option in _SWITCHES:
            argv += [option] if _switch(name, text) else []
        elif option == "--no-pdf":
            argv += [] if _switch(name, text) else ["--no-pdf"]
        elif option == "--set":
            argv += [f"--set={item}" for item in _words(name, text)]
        elif option == "name":
            if text.startswith("-"):
                raise UsageError(f"{name}={text!r} is not allowed: a benchmark's name, e.g. "
                                 f"{name}=twin (make help lists them)")
            argv.append(text)  # positional: checked against scripts/bench_*.py by the command
        elif option == "args":
            argv += _words(name, text)
        elif option == "--reference":
            # The shell used to expand REFERENCE=dir/*.json; the lab does it now, as data.
            files = [f for word in _words(name, text) for f in (sorted(glob.glob(word)) or [word])]
            argv += ["--reference", *(f if not f.startswith("-") else f"./{f}" for f in files)]
        else:
            argv.append(f"{option}={text}")  # one word, even if it starts with '-' (VALUES=-1)
    return argv, names


def _seconds_or_none(text: str) -> float | None:
    try:
        value = float(text)
    except ValueError:
        return None
    return value if 0 < value < float("inf") else None


def _for_make(message: str, names: Mapping[str, str]) -> str:
    """An error about an option, reworded for the make variable it came from."""
    if not names:
        return message
    # "argument --experiment: '../x' is not ..." -> "EXPERIMENT='../x' is not ..."
    message = re.sub(r"^argument (--[\w-]+)(?:/[\w-]+)?: (['\"]?)",
                     lambda m: names.get(m.group(1), m.group(1)) + ("=" if m.group(2) else ": ")
                     + m.group(2), message)
    return message.replace("--no-pdf", "PDF=0")


def _ansible_verbosity_problem(args: argparse.Namespace) -> str | None:
    """ANSIBLE_VERBOSITY changes the output the lab reads from ansible-playbook and
    ansible-inventory; a command that runs them refuses it instead of misreading it."""
    level = os.environ.get("ANSIBLE_VERBOSITY", "").strip()
    live = args.command in ("monitor", "watch") or getattr(args, "spread", False) \
        or getattr(args, "backend", "predict") != "predict" or getattr(args, "confirm", 0)
    if not live or level in ("", "0"):
        return None
    return (f"ANSIBLE_VERBOSITY={level!r}: the lab reads Ansible's normal output, which verbosity "
            f"changes; unset it or set it to 0 (failed tasks are quoted in full anyway)")


_NOT_RESUMED = {"RESUME", "EXPERIMENT", "DEADLINE"}


def _make_resume_command(target: str, env: Mapping[str, str],
                         restored: Mapping[str, list[str]] | None = None) -> Callable[..., str]:
    """The make command that resumes an experiment of ``make TARGET``: the variables it was given
    (but RESUME, EXPERIMENT and DEADLINE, and those ``changes`` replace, e.g. TRIALS left), those
    of its plan a resume ``restored``, then RESUME=1 EXPERIMENT=<id>, quoted for a shell."""
    names = [n for n, _ in _SCENARIO_VARS] + ["SET", "MODEL", "DURATION"] if target in _LAYERED else []
    names += [n for n, _ in MAKE_TARGETS.get(target, ()) if n not in names]
    planned = [w for o, v in (restored or {}).items() for w in _make_words(o, v)]

    def command(exp_id: str, **changes: object) -> str:
        words = [f"{n}={text}" for n in names if n not in _NOT_RESUMED and n not in changes
                 and (text := env.get(f"LAB_MAKE_{n}", "").strip()) and _MAKE_DEFAULTS.get(n) != text]
        words += [w for w in planned if w.partition("=")[0] not in changes]
        words += [f"{n}={v}" for n, v in changes.items()]
        return shlex.join(["make", target, *words, "RESUME=1", f"EXPERIMENT={exp_id}"])
    return command


def _resume_command(argv: list[str]) -> Callable[..., str]:
    """The lab command line that resumes an experiment: this one without --deadline,
    --experiment, --resume (and the options ``changes`` replace, by make name), then
    --resume --experiment=<id>."""
    options = {name: option for vars_ in MAKE_TARGETS.values() for name, option in vars_}

    def command(exp_id: str, **changes: object) -> str:
        dropped = {"--resume", "--deadline", "--experiment", *(options[n] for n in changes)}
        words, skip = [], False
        for word in argv:
            if skip or word.partition("=")[0] in dropped:
                skip = not skip and word in dropped and word != "--resume"  # its value is the next word
                continue
            words.append(word)
        words += [f"{options[n]}={v}" for n, v in changes.items()]
        return shlex.join(["scripts/lab.py", *words, "--resume", f"--experiment={exp_id}"])
    return command


# Each option's make variable, for sentences and resume commands about a recorded plan.
_MAKE_NAMES = {o: n for vars_ in (_SCENARIO_VARS, *MAKE_TARGETS.values()) for n, o in vars_}
_SET_ITEMS = {"load.stop.duration_s": "DURATION", "serve.model": "MODEL"}


def _make_words(option: str, values: list[str]) -> list[str]:
    """An option as the make variables that give it: ``--set`` items as DURATION, MODEL and SET,
    a list as its shell words."""
    name = _MAKE_NAMES.get(option, option)
    if option == "--set":
        own = [f"{_SET_ITEMS[k]}={json.loads(t) if k == 'serve.model' else t}"
               for k, _, t in (v.partition("=") for v in values) if k in _SET_ITEMS]
        rest = [v for v in values if v.partition("=")[0] not in _SET_ITEMS]
        return own + ([f"SET={shlex.join(rest)}"] if rest else [])
    if option == "--reference":
        return [f"{name}={shlex.join(values)}"]
    return [f"{name}={','.join(values)}"]


def _show_option(names: Mapping[str, str]) -> Callable[[str, list[str]], str]:
    """How a sentence names an option: as the make variables it came from, or as the lab's option."""
    def show(option: str, values: list[str]) -> str:
        if not names:
            return " ".join(f"{option}={v}" for v in values) or f"no {option}"
        if not values:
            return f"no {_MAKE_NAMES.get(option, option)}"
        return " ".join(shlex.quote(w) for w in _make_words(option, values))
    return show


def _with_plan(argv: list[str], args: argparse.Namespace,
               names: Mapping[str, str]) -> tuple[list[str], argparse.Namespace, dict]:
    """A long command's arguments with the plan of the experiment it resumes restored (or
    UsageError naming the option that contradicts it), the plan it records, and the options
    restored."""
    show = _show_option(names)
    restored = plan_record.restore(argv, args, show)
    if restored.argv != argv:
        args = build_parser().parse_args(restored.argv)
        shown = " ".join(show(o, v) for o, v in restored.restored.items())
        print(f"resuming {restored.experiment} as planned" + (f": {shown}" if shown else ""),
              flush=True)
    args.plan = plan_record.record(argv[0], plan_record.given(restored.argv[1:], argv[0]))
    return restored.argv, args, restored.restored


def _store_of(args: argparse.Namespace | None) -> Path:
    if args is None or not hasattr(args, "out"):
        return Path("reports/lab.db")
    return store_path(args.out, args.store)


# Exit statuses beside 0, 1 (lint errors, a watch regression), 2 (bad input), 75 (DEADLINE) and
# 130 (Ctrl-C); sysexits.h's numbers, so a script tells the machine's faults from its own.
EXIT_SOFTWARE = 70  # a bug of the lab
EXIT_IO = 74        # the disk is full, a file cannot be written
SENTENCE_CHARS = 1000


def _say(message: str) -> None:
    """One line on stderr: the message's line breaks joined, a URL's userinfo hidden, a long one cut
    in its middle (it may echo a value; its end says what is allowed)."""
    text = redact_url(" ".join(message.splitlines()))  # a URL's password, wherever it came from
    if len(text) > SENTENCE_CHARS:
        text = f"{text[:SENTENCE_CHARS * 2 // 3]} … {text[-SENTENCE_CHARS // 3:]}"
    print(f"lab: {text}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    """Run one lab command; a bad input is one sentence on stderr and exit status 2, a long
    command stopped for its DEADLINE exits deadline.EXIT_DEADLINE (75), Ctrl-C 130, SIGTERM 143,
    SIGHUP 129, a full disk EXIT_IO (74), a bug of the lab EXIT_SOFTWARE (70), each with one
    sentence.

    ``lab make TARGET`` takes its inputs from the LAB_MAKE_* variables the Makefile exports, and
    writes its status to the file LAB_EXIT_FILE names (scripts/lab-make's): make itself exits 2
    for any failed recipe, so a watch's regression (1) or a DEADLINE (75) reaches cron or CI only
    that way.
    """
    argv = sys.argv[1:] if argv is None else list(argv)
    code = _main(argv)
    if argv[:1] == ["make"] and os.environ.get(EXIT_FILE):
        _record_exit(Path(os.environ[EXIT_FILE]), code)
    return code


EXIT_FILE = "LAB_EXIT_FILE"


def _record_exit(path: Path, code: int) -> None:
    """Write ``code`` to the wrapper's file; a file that cannot be written loses only the code."""
    try:
        path.write_text(f"{code}\n")
    except OSError as e:
        _say(f"{path}: {e.strerror or e}: the exit status {code} was not recorded ({EXIT_FILE})")


def _main(argv: list[str]) -> int:
    names: dict[str, str] = {}
    args = None
    try:
        by_make = argv[:1] == ["make"]
        if by_make:
            argv, names = make_argv(argv[1] if len(argv) > 1 else "", os.environ)
        args = build_parser().parse_args(argv)
        restored: dict = {}
        if hasattr(args, "resume"):
            argv, args, restored = _with_plan(argv, args, names)
        args.resume_command = (_make_resume_command(argv[0], os.environ, restored) if by_make
                               else _resume_command(argv))
        problem = _ansible_verbosity_problem(args)
        if problem:
            raise UsageError(problem)
        with shutdown.handling():  # SIGTERM and SIGHUP stop it as Ctrl-C does
            return args.func(args)
    except (UsageError, scenarios.ScenarioError, StoreError, MonitorError, WatchError,
            serving.InventoryError, serving.InstanceBusy, outdir.OutsideOut, InputError) as e:
        _say(_for_make(str(e), names))
        return 2
    except (sqlite3.DatabaseError, pd.errors.DatabaseError) as e:
        # Whatever query met it: a damaged, foreign or locked store, named, with what to do.
        _say(_for_make(describe_sqlite_error(_store_of(args), e), names))
        return EXIT_IO if "full" in str(e) else 2
    except KeyboardInterrupt as stop:
        return _stopped(stop)
    except OSError as e:  # the machine's, not the input's: a full disk, a folder taken away
        _say(f"{e.filename or 'the lab'}: {e.strerror or e}; finished runs are in the store")
        return EXIT_IO
    except Exception as e:  # a bug of the lab: still one sentence, the traceback when asked for
        stop = shutdown.stop_inside(e)
        if stop is not None:  # a stop signal that a library wrapped in its own error
            return _stopped(stop)
        if os.environ.get("LAB_TRACEBACK"):
            raise
        _say(f"internal error ({type(e).__name__}: {str(e)[:200]}); finished runs are in the "
             f"store; LAB_TRACEBACK=1 shows where it happened (please report it)")
        return EXIT_SOFTWARE


def _stopped(stop: KeyboardInterrupt) -> int:
    _say(f"{shutdown.stop_words(stop)}; finished runs are in the store")
    return shutdown.exit_code(stop)


if __name__ == "__main__":
    sys.exit(main())
