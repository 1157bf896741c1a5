"""`vllm serve`'s command line for the twin: the parser built from the flag catalog, --config
files, vLLM's human-readable integers and its range checks, with vLLM's wording on every error."""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from vllm_lab import flags as flag_catalog

DEFAULT_PROFILE = "h200-llama-3-8b"
# Flags the API server consumes itself; every other given flag goes to the engine.
FRONTEND_FLAGS = {"host", "port", "api-key", "served-model-name", "uvicorn-log-level",
                  "max-log-len", "chat-template", "disable-uvicorn-access-log",
                  "enable-log-requests", "disable-log-stats", "model", "tokenizer",
                  "stream-interval"}
# The flags the API server honours itself; with engine.ENGINE_FLAGS, every flag the twin models
# (the catalog's twin_models). The rest are accepted, as vLLM accepts them, and change nothing.
SERVER_FLAGS = frozenset({"host", "port", "api-key", "served-model-name", "uvicorn-log-level",
                          "chat-template", "disable-uvicorn-access-log", "model", "tokenizer",
                          "stream-interval", "max-logprobs", "seed", "api-server-count"})
# Faults the twin can be told to inject into generation requests (--twin-fault), for testing how a
# client and the lab take a server that misbehaves: none ("ok"), a 500 before anything is generated,
# a streamed event that is not JSON after the first token, the connection closed after it.
FAULTS = ("ok", "http500", "malformed", "broken")
# vLLM parses these with human_readable_int ("8k", "1K"); max-model-len also takes "auto"/-1.
HUMAN_INT_FLAGS = {"max-num-batched-tokens", "kv-cache-memory-bytes", "max-model-len"}


def _human_int(value: str) -> int:
    """vLLM's human_readable_int: '8k' -> 8000, '8K' -> 8192, plain integers as they are."""
    value = value.strip()
    mult = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12,
            "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
    if value and value[-1] in mult:
        number = value[:-1]
        if value[-1].isupper():
            if not number.isdigit():
                raise argparse.ArgumentTypeError(
                    f"Decimals are not allowed with binary suffixes like {value[-1]}. Did you mean "
                    f"to use {number}{value[-1].lower()} instead?")
            return int(number) * mult[value[-1]]
        return int(float(number) * mult[value[-1]])
    if value in ("auto", "-1"):
        return -1
    return int(value)


_human_int.__name__ = "human_readable_int"  # argparse names it in "invalid ... value"


def build_parser() -> argparse.ArgumentParser:
    """`vllm serve`'s parser, built from the lab's flag catalog (vllm_lab.flags)."""
    parser = argparse.ArgumentParser(
        prog="vllm serve", description="Launch a local OpenAI-compatible API server (the twin).",
        argument_default=argparse.SUPPRESS)
    parser.add_argument("model_tag", nargs="?", help="The model tag to serve.")
    parser.add_argument("--config", help="Read CLI options from a config file (YAML).")
    for name, flag in flag_catalog.FLAGS.items():
        opt = "--" + name
        if name == "served-model-name":
            parser.add_argument(opt, nargs="+", help=flag.help)
        elif flag.kind == "bool":
            parser.add_argument(opt, action=argparse.BooleanOptionalAction, help=flag.help)
        elif flag.kind == "int":
            conv = _human_int if name in HUMAN_INT_FLAGS else int
            if flag.choices:
                parser.add_argument(opt, type=conv, choices=flag.choices, help=flag.help)
            else:
                parser.add_argument(opt, type=conv, help=flag.help)
        elif flag.kind == "float":
            parser.add_argument(opt, type=float, help=flag.help)
        else:
            parser.add_argument(opt, type=str, choices=flag.choices, help=flag.help)
    twin = parser.add_argument_group("twin-only settings (not vLLM flags)")
    twin.add_argument("--twin-profile", help="Step-time profile name or YAML path "
                      "(env VLLM_TWIN_PROFILE, default h200-llama-3-8b).")
    twin.add_argument("--twin-startup-seconds", type=float,
                      help="Simulated start-up time (env VLLM_TWIN_STARTUP_SECONDS, default 1).")
    twin.add_argument("--twin-fault", help=(
        "Faults injected into completion and chat requests, dealt in turn: a comma-separated list "
        "of ok, http500 (vLLM's 500 error body, nothing generated), malformed (a streamed event "
        "that is not JSON after the first token, then the stream goes on), broken (the connection "
        "closed after a stream's first token); e.g. ok,ok,ok,http500 fails every fourth request. "
        "Env VLLM_TWIN_FAULT; default: none."))
    return parser


def _normalise(args: list[str]) -> list[str]:
    # FlexibleArgumentParser accepts --max_num_seqs as --max-num-seqs and --key=value.
    out = []
    for a in args:
        if a.startswith("--"):
            key, eq, val = a[2:].partition("=")
            a = "--" + key.replace("_", "-") + (eq + val if eq else "")
        out.append(a)
    return out


def _config_args(path: str) -> list[str]:
    """vLLM's --config: YAML keys spelled as flags, turned into command-line words."""
    if path.split(".")[-1] not in ("yaml", "yml"):
        raise ValueError(f"Config file must be of a yaml/yml type. {path.split('.')[-1]} supplied")
    try:
        config = yaml.safe_load(Path(path).read_text()) or {}
    except OSError as e:
        raise ValueError(f"Unable to read the config file at {path}. Check path correctness") from e
    out: list[str] = []
    for key, value in config.items():
        if isinstance(value, bool):
            if value:  # vLLM drops false booleans from the file: the default stands
                out.append("--" + key)
        elif isinstance(value, list):
            if value:
                out += ["--" + key] + [str(v) for v in value]
        elif isinstance(value, dict):
            out += ["--" + key, json.dumps(value)]
        else:
            out += ["--" + key, str(value)]
    return out


@dataclass
class ServeArgs:
    """What `serve` was asked: the model, the flags given (kebab-case) and the twin's settings."""

    model: str
    flags: dict[str, Any]
    profile: str
    startup_s: float
    faults: tuple[str, ...] = ()  # --twin-fault: dealt to generation requests in turn


def parse_serve_args(argv: list[str]) -> ServeArgs:
    """Parse `serve MODEL [flags]` as vLLM does; argparse errors exit 2 with vLLM's wording."""
    parser = build_parser()
    argv = _normalise(list(argv))
    if argv and argv[0] == "serve":
        argv = argv[1:]
    else:
        parser.error("the following arguments are required: subparser (choose from serve)")
    if "--config" in argv:
        i = argv.index("--config")
        if i == len(argv) - 1:
            parser.error("No config file specified! Please check your command-line arguments.")
        try:
            cfg = _normalise(_config_args(argv[i + 1]))
        except ValueError as e:
            parser.error(str(e))
        rest = argv[:i] + argv[i + 2:]
        # Precedence as vLLM: CLI > config file > defaults; the model stays first.
        if rest and not rest[0].startswith("-"):
            argv = rest[:1] + cfg + rest[1:]
        else:
            argv = cfg + rest
    ns = vars(parser.parse_args(argv))
    ns.pop("config", None)
    model = ns.pop("model_tag", None) or ns.pop("model", None)
    ns.pop("model", None)
    if not model:
        parser.error("No model specified! Please specify model either as a positional argument "
                     "or in a config file.")
    profile = ns.pop("twin_profile", None) or os.environ.get("VLLM_TWIN_PROFILE") or DEFAULT_PROFILE
    startup = ns.pop("twin_startup_seconds", None)
    if startup is None:
        startup = float(os.environ.get("VLLM_TWIN_STARTUP_SECONDS", "1.0"))
    faults = _faults(parser, ns.pop("twin_fault", None) or os.environ.get("VLLM_TWIN_FAULT", ""))
    given = {k.replace("_", "-"): v for k, v in ns.items()}
    _check_ranges(given)
    return ServeArgs(model=model, flags=given, profile=profile, startup_s=startup, faults=faults)


def _faults(parser: argparse.ArgumentParser, text: str) -> tuple[str, ...]:
    """--twin-fault's list; an unknown fault is argparse's error (exit 2), naming the choices."""
    faults = tuple(f.strip() for f in text.split(",") if f.strip())
    bad = [f for f in faults if f not in FAULTS]
    if bad:
        parser.error(f"argument --twin-fault: invalid choice: {bad[0]!r} (choose from "
                     f"{', '.join(FAULTS)}, separated by commas)")
    return () if set(faults) <= {"ok"} else faults


def _check_ranges(given: dict[str, Any]) -> None:
    """Refuse out-of-range values as vLLM's pydantic config does (exit 1, its wording)."""
    for name, value in given.items():
        flag = flag_catalog.FLAGS.get(name)
        if flag is None or flag.kind not in ("int", "float") or value is None:
            continue
        if name == "max-model-len" and value == -1:
            continue
        bad = None
        if flag.min is not None:
            if flag.min_exclusive and value <= flag.min:
                bad = ("greater_than", f"Input should be greater than {flag.min:g}")
            elif not flag.min_exclusive and value < flag.min:
                bad = ("greater_than_equal", f"Input should be greater than or equal to {flag.min:g}")
        if flag.max is not None and value > flag.max:
            bad = ("less_than_equal", f"Input should be less than or equal to {flag.max:g}")
        if bad:
            field_name = name.replace("-", "_")
            sys.stderr.write(
                "pydantic_core._pydantic_core.ValidationError: 1 validation error for EngineArgs\n"
                f"{field_name}\n  {bad[1]} [type={bad[0]}, input_value={value!r}, "
                f"input_type={type(value).__name__}]\n")
            sys.exit(1)
