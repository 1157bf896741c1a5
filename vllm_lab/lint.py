"""The flag lint: what `vllm serve` would refuse or ignore, found before anything is launched.

Each finding names the file, the key, what is wrong and what to write instead. Errors stop a run;
warnings are printed and the run goes on. The target vLLM version is a setting (the scenario's
``vllm_version``), because flags come and go between releases.
"""

from __future__ import annotations

import difflib
import math
from dataclasses import dataclass
from typing import Any

from vllm_lab.flags import FLAGS, Flag, changes_for, real_vllm_flag_names
from vllm_lab.inputs import shown
from vllm_lab.models import DTYPE_BYTES, load_model_shape
from vllm_lab.scenarios import Scenario, origin

GIB = 1024**3


@dataclass(frozen=True)
class Finding:
    """One thing the lint found."""

    severity: str  # "error" | "warning"
    source: str  # the file (or override) that set the key
    key: str
    message: str

    def __str__(self) -> str:
        return f"{self.severity}: {self.source}: serve.{self.key}: {self.message}"


def lint(scenario: Scenario, layers: list[tuple[str, dict[str, Any]]] | None = None,
         known_flags: set[str] | None = None) -> list[Finding]:
    """Check a resolved scenario's serve flags against vLLM at the scenario's target version.

    ``known_flags`` is the set of flag names to accept; by default the installed vLLM's own parser
    where vLLM is importable, else the lab's catalog.
    """
    layers = layers or [(scenario.sources[-1] if scenario.sources else scenario.name,
                         {"serve": scenario.serve})]
    names = known_flags if known_flags is not None else (real_vllm_flag_names() or set(FLAGS))
    changes = changes_for(scenario.vllm_version)

    def where(key: str) -> str:
        return origin(("serve", key), layers)

    findings: list[Finding] = []
    serve = scenario.serve
    for key, value in serve.items():
        findings += _check_name_and_value(key, value, names, changes, scenario.vllm_version, where)
    for check in (_check_block_size, _check_budget, _check_parallel, _check_memory):
        findings += check(scenario, where)
    return findings


def hardware_refusal(scenario: Scenario) -> Finding | None:
    """A finding no start on this hardware can get past (more GPUs than it has, weights that do
    not fit): a plan records such a point as refused instead of spending a start on it."""
    for f in _check_parallel(scenario, lambda key: "preflight") + _check_memory(scenario, lambda key: "preflight"):
        if f.key == "tensor-parallel-size" or "do not fit" in f.message:
            return f
    return None


def _check_name_and_value(key, value, names, changes, version, where) -> list[Finding]:
    change = changes.get(key)
    problem = change.problem(version, value) if change else None
    if problem:
        severity = "warning" if change.kind == "no-op" else "error"
        return [Finding(severity, where(key), key, problem)]
    if key not in names:
        kebab = key.replace("_", "-")
        near = [kebab] if kebab in names else difflib.get_close_matches(key, sorted(names), n=1, cutoff=0.6)
        hint = f"; nearest allowed key: {near[0]}" if near else ""
        return [Finding("error", where(key), key, f"is not a flag of vLLM {version}{hint}")]
    flag = FLAGS.get(key)
    if flag is None or value is None:
        return []
    problem = value_problem(flag, value)
    return [Finding("error", where(key), key, problem)] if problem else []


def value_problem(flag: Flag, value: Any) -> str | None:
    """Why ``value`` is not allowed for ``flag``, or None (a secret's value is never shown)."""
    if flag.kind == "bool":
        ok = isinstance(value, bool)
    elif flag.kind == "int":
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif flag.kind == "float":
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    else:
        ok = isinstance(value, str)
    if ok and isinstance(value, float) and not math.isfinite(value):
        ok = False  # .inf or .nan compare as in range, and no server takes them
    if not ok:
        return f"{shown(value, flag.name)} is not allowed: must be {flag.describe_range()}"
    if flag.choices is not None and value not in flag.choices:
        return f"{shown(value, flag.name)} is not allowed: must be {flag.describe_range()}"
    if flag.min is not None and (value <= flag.min if flag.min_exclusive else value < flag.min):
        return f"{shown(value, flag.name)} is out of range: must be {flag.describe_range()}"
    if flag.max is not None and value > flag.max:
        return f"{shown(value, flag.name)} is out of range: must be {flag.describe_range()}"
    return None


def _check_block_size(scenario: Scenario, where) -> list[Finding]:
    block = scenario.serve.get("block-size")
    if block not in FLAGS["block-size"].choices or block % 16 == 0:
        return []
    # CUDA GPUs run FlashAttention (block sizes in multiples of 16) or FlashInfer (16/32/64).
    return [Finding("error", where("block-size"), "block-size",
                    f"{block} is refused on {scenario.hardware.name} by the FlashAttention backends "
                    f"(multiples of 16) and FlashInfer (16, 32, 64); write "
                    f"{FLAGS['block-size'].default} (vLLM's default), "
                    f"or 32 to cut per-block overhead on long generations")]


def _check_budget(scenario: Scenario, where) -> list[Finding]:
    serve = scenario.serve
    tokens, seqs = serve.get("max-num-batched-tokens"), serve.get("max-num-seqs")
    if isinstance(tokens, int) and isinstance(seqs, int) and tokens < seqs:
        return [Finding("error", where("max-num-batched-tokens"), "max-num-batched-tokens",
                        f"{tokens} is smaller than max-num-seqs {seqs}; vLLM refuses this "
                        f"(every running sequence needs a token per step): raise it to at least {seqs}")]
    return []


def _shape(scenario: Scenario):
    try:
        return load_model_shape(str(scenario.serve.get("model")))
    except (ValueError, OSError, KeyError):
        return None  # an unknown model: vLLM will read its config; nothing to check here


def _check_parallel(scenario: Scenario, where) -> list[Finding]:
    tp = scenario.serve.get("tensor-parallel-size", FLAGS["tensor-parallel-size"].default)
    if not isinstance(tp, int):
        return []
    out = []
    if tp > scenario.hardware.gpu_count:
        out.append(Finding("error", where("tensor-parallel-size"), "tensor-parallel-size",
                           f"{tp} needs {tp} GPUs but the hardware preset {scenario.hardware.name} "
                           f"has {scenario.hardware.gpu_count}; set hardware.gpu_count or lower it"))
    shape = _shape(scenario)
    if shape and shape.num_heads % tp:
        out.append(Finding("error", where("tensor-parallel-size"), "tensor-parallel-size",
                           f"{tp} does not divide the model's {shape.num_heads} attention heads; "
                           f"use a divisor of {shape.num_heads}"))
    return out


def _check_memory(scenario: Scenario, where) -> list[Finding]:
    shape = _shape(scenario)
    if shape is None:
        return []
    serve = scenario.serve
    out = []
    max_len = serve.get("max-model-len")
    if isinstance(max_len, int) and max_len > shape.max_position_embeddings:
        out.append(Finding("error", where("max-model-len"), "max-model-len",
                           f"{max_len} is longer than the model's max_position_embeddings "
                           f"({shape.max_position_embeddings}); vLLM refuses it: use at most that"))
    dtype = serve.get("dtype", FLAGS["dtype"].default)
    dtype = shape.torch_dtype if dtype == "auto" else dtype
    tp_default = FLAGS["tensor-parallel-size"].default
    tp = serve.get("tensor-parallel-size", tp_default)
    tp = tp if isinstance(tp, int) else tp_default
    util = serve.get("gpu-memory-utilization", FLAGS["gpu-memory-utilization"].default)
    weights = shape.num_params * DTYPE_BYTES.get(dtype, 2) / max(tp, 1)
    if not isinstance(util, (int, float)):
        util = FLAGS["gpu-memory-utilization"].default
    budget = scenario.hardware.memory_gib * GIB * util
    if weights >= budget:
        out.append(Finding("error", where("gpu-memory-utilization"), "gpu-memory-utilization",
                           f"the model's weights ({weights / GIB:.1f} GiB in {dtype}) do not fit in "
                           f"{util} x {scenario.hardware.memory_gib} GiB; raise tensor-parallel-size, "
                           f"use a smaller dtype, or a larger GPU"))
    return out
