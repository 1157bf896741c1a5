"""Scenario files: a strict schema, composition of files, and the resolved scenario that gets recorded.

A run is described by layers, later wins: a hardware preset (``scenarios/hardware/<name>.yaml``),
the scenario file (``scenarios/<name>.yaml``), then ``section.key=value`` overrides from the command
line. The merged result is validated once; the resolved scenario is what the store records, so a
report can always say exactly what ran.
"""

from __future__ import annotations

import copy
import difflib
import typing
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from vllm_lab import hardware
from vllm_lab.flags import DEFAULT_VLLM_VERSION, is_secret
from vllm_lab.inputs import InputError, load_yaml, read_text, shown
from vllm_lab.traffic.spec import Load, Workload

SCENARIO_DIR = Path(__file__).resolve().parent.parent / "scenarios"
DEFAULT_HARDWARE = "h200"


class ScenarioError(Exception):
    """Bad scenario input, said in one sentence that names the file and the key."""


class Strict(BaseModel):
    """Base of every configuration model: a misspelled key is an error, never a silent default."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class Hardware(hardware.Hardware):
    """A hardware preset: the one GPU schema, with the short key and the twin profile required."""

    gpu: str = Field(description="Short key, e.g. h200; picks the twin profile.")
    twin_profile: str = Field(description="Twin profile (vllm_lab/twin/profiles/) for this GPU.")


class SloTarget(Strict):
    """A latency threshold at a percentile: 'p99 TTFT under 500 ms'."""

    threshold_ms: float = Field(gt=0)
    percentile: float = Field(99.0, gt=0, le=100)


class Slo(Strict):
    """Service-level objectives; a request meets the SLO when it is under every per-request threshold."""

    ttft: SloTarget | None = None
    tpot: SloTarget | None = None
    itl: SloTarget | None = None
    e2e: SloTarget | None = None

    def targets(self) -> dict[str, SloTarget]:
        """The SLOs that are set, by metric name."""
        return {k: v for k, v in (("ttft", self.ttft), ("tpot", self.tpot), ("itl", self.itl),
                                  ("e2e", self.e2e)) if v is not None}


class RunSettings(Strict):
    """How each measurement is taken."""

    repeats: int = Field(1, ge=1, description="Runs per point; the baseline uses 3.")
    warmup_requests: int = Field(8, ge=0, description="Requests sent and discarded after a start.")
    warmup_runs: int = Field(0, ge=0, description=(
        "Runs of the scenario's own load sent and discarded after each server start, before its "
        "first measured run: on an H200 the first run after a start read 6-10% slow in vLLM's "
        "own steps, which a few short requests do not reach."))
    clean: bool = Field(True, description="Reset the prefix cache between runs.")
    start_timeout_s: float = Field(600, gt=0)
    seed: int = 0


class Scenario(Strict):
    """A resolved scenario: what vLLM runs, what traffic it gets, and what counts as good."""

    name: str
    description: str = ""
    vllm_version: str = DEFAULT_VLLM_VERSION
    hardware: Hardware
    serve: dict[str, Any] = Field(description="vLLM flags spelled as `vllm serve` spells them.")
    workload: Workload
    load: Load
    slo: Slo = Slo()
    run: RunSettings = RunSettings()
    sources: list[str] = Field(default_factory=list, description="The files and overrides merged.")

    @field_validator("serve")
    @classmethod
    def _serve_flags_given_with_model(cls, serve: dict[str, Any]) -> dict[str, Any]:
        """The flags given a value, a model among them. A flag given none (`serve.enforce-eager=`,
        or `null` in a file) is vLLM's default: it undoes a layer below, e.g. a template's flags,
        without naming the default's value."""
        serve = {k: v for k, v in serve.items() if v is not None}
        if not serve.get("model"):
            raise ValueError("serve.model is required (a model name or folder)")
        return serve

    @model_validator(mode="after")
    def _replay_has_a_trace(self) -> Scenario:
        if self.load.mode == "replay" and self.workload.source != "trace":
            raise ValueError(f"load.mode replay sends a trace's requests at their times: it needs "
                             f"workload.source trace (with path and trace_format), not "
                             f"{self.workload.source!r}")
        return self

    def with_serve(self, **flags: Any) -> Scenario:
        """A copy with some serve flags replaced (kebab-case names)."""
        return self.model_copy(update={"serve": {**self.serve, **flags}})

    def to_record(self) -> dict[str, Any]:
        """The JSON-ready dict the store keeps."""
        return self.model_dump(mode="json")


def read_yaml(path: Path) -> dict[str, Any]:
    """Read one YAML mapping, or raise ScenarioError naming the file and line: a regular UTF-8 file
    of a bounded size, whose aliases cannot expand it past ``inputs.MAX_VALUES`` values."""
    try:
        data = load_yaml(read_text(path, what="scenario file"), _display(path))
    except InputError as e:
        raise ScenarioError(str(e).replace(str(path), _display(path), 1)) from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ScenarioError(f"{_display(path)}{where}: broken YAML: {problem}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ScenarioError(f"{_display(path)}: must be a mapping of sections (serve, workload, load, slo), "
                            f"not a {type(data).__name__}")
    return data


def deep_merge(base: dict, top: dict) -> dict:
    """Merge ``top`` over ``base``: mappings merge key by key, anything else is replaced."""
    out = copy.deepcopy(base)
    for key, value in top.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def _holds_secret(value: Any) -> bool:
    """Whether a value (a mapping given whole, ``serve={"api-key": ...}``) holds a secret key."""
    if isinstance(value, dict):
        return any(is_secret(k) or _holds_secret(v) for k, v in value.items())
    if isinstance(value, list):
        return any(_holds_secret(v) for v in value)
    return False


def parse_override(text: str) -> dict[str, Any]:
    """'serve.max-num-seqs=128' -> {'serve': {'max-num-seqs': 128}} (the value read as YAML)."""
    path, sep, raw = text.partition("=")
    if not sep or not path.strip():
        raise ScenarioError(f"override {shown(text)}: write section.key=value, e.g. "
                            f"serve.max-num-seqs=128")
    try:
        value = load_yaml(raw, f"override {path.strip()}", lines=False) if raw.strip() else None
    except yaml.YAMLError:
        value = raw
    except InputError as e:
        raise ScenarioError(str(e)) from None
    keys = path.strip().split(".")
    if is_secret(keys[-1]) or _holds_secret(value):
        # A command line shows in ps and the shell's history.
        raise ScenarioError(f"override {path.strip()}: a secret is not taken on the command line; put "
                            f"it in the scenario file, VLLM_API_KEY in the environment, or "
                            f"vllm_api_key in the inventory's ansible-vault")
    out: dict[str, Any] = {}
    node = out
    for key in keys[:-1]:
        node = node.setdefault(key, {})
    node[keys[-1]] = value
    return out


def scenario_path(name: str | Path, folder: Path = SCENARIO_DIR) -> Path:
    """A scenario name ('default') or path to its file."""
    p = Path(name)
    if p.suffix in (".yaml", ".yml") or p.exists():
        return p
    return folder / f"{name}.yaml"


def hardware_path(name: str | Path, folder: Path = SCENARIO_DIR) -> Path:
    """A hardware preset name ('h200') or path to its file."""
    p = Path(name)
    if p.suffix in (".yaml", ".yml"):
        return p
    return folder / "hardware" / f"{name}.yaml"


def _display(path: Path) -> str:
    """A path as the user would type it: relative to the working folder when inside it."""
    try:
        return str(path.resolve().relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def available(folder: Path = SCENARIO_DIR) -> dict[str, list[str]]:
    """Scenario and hardware preset names shipped in ``folder``."""
    return {"scenarios": sorted(p.stem for p in folder.glob("*.yaml")),
            "hardware": sorted(p.stem for p in (folder / "hardware").glob("*.yaml"))}


def _error_location(loc: tuple, layers: list[tuple[str, dict]]) -> str:
    """The last layer that set the key at ``loc``: that is the file the user must fix."""
    for source, data in reversed(layers):
        node: Any = data
        for part in loc:
            if isinstance(node, dict) and part in node:
                node = node[part]
            else:
                break
        else:
            return source
    return layers[-1][0] if layers else "scenario"


def _model_at(loc: tuple) -> type[BaseModel] | None:
    """The pydantic model that holds the last key of ``loc`` (Optional[...] unwrapped)."""
    model: type[BaseModel] | None = Scenario
    for part in loc:
        field = model.model_fields.get(str(part)) if model else None
        if field is None:
            return None
        candidates = [field.annotation, *typing.get_args(field.annotation)]
        model = next((c for c in candidates if isinstance(c, type) and issubclass(c, BaseModel)), None)
    return model


def _explain(err: ValidationError, layers: list[tuple[str, dict]]) -> str:
    """One sentence for the most useful validation error: file, key, what is allowed."""
    # A misspelled key also makes its real name "missing": report the misspelling first.
    errors = sorted(err.errors(), key=lambda e: e["type"] != "extra_forbidden")
    first = errors[0]
    loc = tuple(first["loc"])
    key = ".".join(str(p) for p in loc)
    source = _error_location(loc, layers)
    if first["type"] == "extra_forbidden":
        parent = _model_at(loc[:-1])
        allowed = list(parent.model_fields) if parent else []
        near = difflib.get_close_matches(str(loc[-1]), allowed, n=1)
        hint = f" (did you mean {near[0]}?)" if near else ""
        return f"{source}: unknown key {key}{hint}; allowed here: {', '.join(allowed)}"
    if first["type"] == "missing":
        return f"{source}: key {key} is required"
    return f"{source}: key {key}: {first['msg']} (got {shown(first.get('input'), key)})"


def load_layers(scenario: str | Path = "default", hardware: str | Path | None = None,
                overrides: list[str] | None = None,
                folder: Path = SCENARIO_DIR) -> list[tuple[str, dict[str, Any]]]:
    """The layers of a run, earliest first: hardware preset, scenario file, overrides."""
    spath = scenario_path(scenario, folder)
    sdata = read_yaml(spath)
    preset = sdata.pop("hardware_preset", None)
    # A name with a NUL byte names no file: the operating system refuses the path itself.
    if preset is not None and (not isinstance(preset, str) or "\x00" in preset):
        raise ScenarioError(f"{_display(spath)}: key hardware_preset must be a preset name, "
                            f"e.g. h200 (got {shown(preset)})")
    hw_name = hardware or preset or DEFAULT_HARDWARE
    hpath = hardware_path(hw_name, folder)
    layers = [(_display(hpath), read_yaml(hpath)), (_display(spath), sdata)]
    layers += [(f"override {text!r}", parse_override(text)) for text in overrides or []]
    return layers


def merge_layers(layers: list[tuple[str, dict[str, Any]]]) -> dict[str, Any]:
    """Merge layers, later wins; the scenario's name defaults to its file's stem."""
    merged: dict[str, Any] = {}
    for _, data in layers:
        merged = deep_merge(merged, data)
    merged.setdefault("name", Path(layers[1][0]).stem if len(layers) > 1 else "scenario")
    merged["sources"] = [source for source, _ in layers]
    return merged


def origin(key_path: tuple, layers: list[tuple[str, dict[str, Any]]]) -> str:
    """The last layer that set ``key_path``: the file the user must fix."""
    return _error_location(key_path, layers)


def resolve(scenario: str | Path = "default", hardware: str | Path | None = None,
            overrides: list[str] | None = None, folder: Path = SCENARIO_DIR) -> Scenario:
    """Merge hardware preset, scenario file and overrides, later wins, and validate the result."""
    layers = load_layers(scenario, hardware, overrides, folder)
    return validate(layers)


def validate(layers: list[tuple[str, dict[str, Any]]]) -> Scenario:
    """Validate merged layers into a Scenario, or raise ScenarioError naming file and key."""
    try:
        return Scenario.model_validate(merge_layers(layers))
    except ValidationError as e:
        raise ScenarioError(_explain(e, layers)) from None
