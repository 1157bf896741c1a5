"""vLLM's serve flags as data: types, ranges, defaults, and what changed between releases.

The lint (``vllm_lab.lint``), the twin (its argument parser, engine and server) and the findings
all read this catalog, the one place vLLM's defaults are written, so the twin accepts exactly what
the lab lets through. ``twin_models=False`` marks a flag the twin accepts but does not model. Where a real ``vllm`` is importable, the lint checks flag
names against vLLM's own parser instead (``real_vllm_flag_names``), so a new release needs no code
change here; the catalog then only adds ranges and advice.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

DEFAULT_VLLM_VERSION = "0.26.0"
GIB = 1024**3


@dataclass(frozen=True)
class Flag:
    """One `vllm serve` flag: its kind, allowed values and vLLM's default."""

    name: str
    kind: str  # "int" | "float" | "bool" | "str"
    default: Any = None
    help: str = ""
    choices: tuple | None = None
    min: float | None = None
    max: float | None = None
    min_exclusive: bool = False
    tuning: bool = False  # an engine knob the lab sweeps; frontend flags are not
    secret: bool = False  # a credential: redacted in the store, reports and logs, never in argv
    # False where the twin accepts the flag but behaves the same whatever its value: its effect
    # is then known only from runs on real vLLM ("not modelled: measured only").
    twin_models: bool = True

    def describe_range(self) -> str:
        """The allowed values in words, for error messages."""
        if self.choices is not None:
            return "one of " + ", ".join(str(c) for c in self.choices)
        if self.kind == "bool":
            return "true or false"
        low = "" if self.min is None else (f"> {self.min}" if self.min_exclusive else f">= {self.min}")
        high = "" if self.max is None else f"<= {self.max}"
        parts = [p for p in (low, high) if p]
        return f"a{'n' if self.kind == 'int' else ''} {self.kind} " + " and ".join(parts) if parts else f"a {self.kind}"


@dataclass(frozen=True)
class Change:
    """Something vLLM changed about a flag, and what to write instead."""

    flag: str
    since: str  # the first vLLM version where it applies
    kind: str  # "removed" | "no-op" | "refused" (accepted by the parser, any value but the default stops the start)
    advice: str

    def problem(self, version: str, value: Any = None) -> str | None:
        """What setting the flag to ``value`` does at ``version``, in words (None: a refused flag
        at its default, which vLLM takes)."""
        if self.kind == "removed":
            return f"was removed in vLLM {self.since} (target {version}): {self.advice}"
        if self.kind == "no-op":
            return f"has no effect since vLLM {self.since} (target {version}): {self.advice}"
        if value is not None and value == FLAGS[self.flag].default:
            return None
        return (f"vLLM {version} refuses to start with any value but {FLAGS[self.flag].default} "
                f"(since {self.since}): {self.advice}")


def _f(name, kind, default=None, help="", **kw) -> Flag:
    return Flag(name=name, kind=kind, default=default, help=help, **kw)


_DTYPES = ("auto", "half", "float16", "bfloat16", "float", "float32")
_KV_DTYPES = ("auto", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2", "fp8_inc", "fp8_ds_mla")

FLAGS: dict[str, Flag] = {f.name: f for f in [
    # Engine knobs the tuning method sweeps.
    _f("max-num-seqs", "int", None, "Most sequences in one batch (running requests).", min=1, tuning=True),
    _f("max-num-batched-tokens", "int", None, "Token budget of one scheduler step.", min=1, tuning=True),
    _f("gpu-memory-utilization", "float", 0.92, "Share of GPU memory vLLM may use.", min=0.0,
       max=1.0, min_exclusive=True, tuning=True),
    _f("block-size", "int", 16, "Tokens per KV-cache block.", choices=(1, 8, 16, 32, 64, 128, 256),
       tuning=True),
    _f("max-model-len", "int", None, "Longest prompt + output (default: the model's).", min=1,
       tuning=True),
    _f("enforce-eager", "bool", False, "Run without CUDA graphs.", tuning=True),
    _f("dtype", "str", "auto", "Weights and activations dtype.", choices=_DTYPES, tuning=True),
    _f("kv-cache-dtype", "str", "auto", "KV cache dtype.", choices=_KV_DTYPES, tuning=True),
    _f("tensor-parallel-size", "int", 1, "GPUs one model is split over.", min=1, tuning=True),
    _f("pipeline-parallel-size", "int", 1, "Pipeline stages.", min=1, twin_models=False),
    _f("data-parallel-size", "int", 1, "Engine replicas behind one server.", min=1, twin_models=False),
    _f("enable-prefix-caching", "bool", True, "Reuse KV blocks of shared prefixes.", tuning=True),
    _f("enable-chunked-prefill", "bool", True, "Split long prefills over steps (always on in V1).", twin_models=False),
    _f("long-prefill-token-threshold", "int", 0, "Prefill chunk cap per request (0: none).", min=0,
       tuning=True),
    # V0's concurrent partial prefills: vLLM's V1 engine refuses to start with either at any value
    # but 1 (CHANGES below), and so does the twin.
    _f("max-num-partial-prefills", "int", 1, "Concurrent partial prefills (V0 only).", min=1),
    _f("max-long-partial-prefills", "int", 1, "Concurrent long partial prefills (V0 only).", min=1),
    _f("num-gpu-blocks-override", "int", None, "Force the number of KV blocks.", min=1),
    _f("kv-cache-memory-bytes", "int", None, "KV cache size in bytes (overrides utilization).", min=1),
    _f("cpu-offload-gb", "float", 0, "Weights offloaded to CPU per GPU, GiB.", min=0),
    _f("kv-offloading-size", "float", None, "CPU memory for KV offload, GiB.", min=0, tuning=True),
    _f("kv-offloading-backend", "str", "native", "KV offload backend.", choices=("native", "lmcache")),
    _f("scheduling-policy", "str", "fcfs", "Queue order.", choices=("fcfs", "priority"), tuning=True),
    # On by default since vLLM turned it on where compatible (None -> True); the twin plans each step
    # while the one before it runs, so a request taken in mid-flight joins a step later.
    _f("async-scheduling", "bool", True, "Overlap scheduling with the model step.", tuning=True),
    _f("stream-interval", "int", 1, "Tokens per streamed chunk.", min=1),
    _f("api-server-count", "int", 1, "API-server (frontend) processes in front of the engine.", min=1,
       tuning=True),
    # The twin models fp8 (online, on a 16-bit checkpoint) and refuses the methods that need a
    # quantized checkpoint's config, as vLLM does on the lab's model folders.
    _f("quantization", "str", None, "Weight quantization method."),
    _f("seed", "int", 0, "Random seed."),
    # Model loading.
    _f("model", "str", None, "Model name or folder."),
    _f("tokenizer", "str", None, "Tokenizer name or folder."),
    _f("served-model-name", "str", None, "Name the API answers to."),
    _f("load-format", "str", "auto", "How weights load.",
       choices=("auto", "pt", "safetensors", "npcache", "dummy", "tensorizer", "runai_streamer",
                "bitsandbytes", "sharded_state", "gguf", "mistral", "fastsafetensors"), twin_models=False),
    _f("download-dir", "str", None, "Where weights download.", twin_models=False),
    _f("revision", "str", None, "Model revision.", twin_models=False),
    _f("trust-remote-code", "bool", False, "Run the model's own code.", twin_models=False),
    _f("generation-config", "str", "auto", "Where default sampling parameters come from.", twin_models=False),
    _f("max-logprobs", "int", 20, "Most logprobs per token.", min=-1),
    _f("disable-log-stats", "bool", False, "Do not log engine stats.", twin_models=False),
    _f("enable-log-requests", "bool", False, "Log each request.", twin_models=False),
    _f("distributed-executor-backend", "str", None, "Executor.", choices=("ray", "mp", "uni", "external_launcher"), twin_models=False),
    _f("compilation-config", "str", None, "torch.compile and CUDA-graph settings, as JSON.", twin_models=False),
    # Frontend.
    _f("host", "str", None, "Address to listen on."),
    _f("port", "int", 8000, "Port to listen on.", min=1, max=65535),
    _f("api-key", "str", None, "Key clients must send (on /v1 routes).", secret=True),
    _f("uvicorn-log-level", "str", "info", "Server log level.",
       choices=("critical", "error", "warning", "info", "debug", "trace")),
    _f("max-log-len", "int", None, "Longest prompt logged.", min=0, twin_models=False),
    _f("chat-template", "str", None, "Chat template file or string."),
    _f("disable-uvicorn-access-log", "bool", False, "No per-request access log."),
]}

CHANGES: list[Change] = [
    Change("swap-space", "0.18.0", "removed",
           "V1 preempts by recompute, so CPU swap is gone; for CPU KV offload write "
           "kv-offloading-size (GiB) and kv-offloading-backend instead, or drop the key"),
    Change("enable-chunked-prefill", "0.10.0", "no-op",
           "chunked prefill is always on in the V1 engine; drop the key "
           "(max-num-batched-tokens sets the chunk budget)"),
    Change("max-seq-len-to-capture", "0.11.0", "removed",
           "CUDA graph capture sizes follow max-num-seqs now; drop the key"),
    Change("disable-log-requests", "0.11.0", "removed",
           "requests are not logged by default; drop the key (enable-log-requests turns logging on)"),
    Change("num-scheduler-steps", "0.10.0", "removed",
           "multi-step scheduling was a V0 feature; drop the key (async-scheduling overlaps steps in V1)"),
    Change("use-v2-block-manager", "0.7.0", "removed", "the V1 KV cache manager is the only one; drop the key"),
    Change("preemption-mode", "0.10.0", "removed", "V1 always preempts by recompute; drop the key"),
    # Checked on 0.26.0 (its source, and an H100: the same KV cache and step times at 0 and 1 GiB);
    # earlier releases that defaulted dense models to the V2 runner may share it.
    Change("cpu-offload-gb", "0.26.0", "no-op",
           "the V2 model runner, vLLM's default for dense models, never installs the weight "
           "offloader, so every weight stays on the GPU (vllm-project/vllm#51396); "
           "VLLM_USE_V2_MODEL_RUNNER=0 in the server's environment brings back the V1 runner, "
           "which offloads; else drop the key"),
    *(Change(name, "0.11.0", "refused",
             "its V1 engine has no concurrent partial prefills (NotImplementedError: Concurrent "
             "Partial Prefill is not supported); long-prefill-token-threshold caps a long prompt's "
             "share of a step instead") for name in ("max-num-partial-prefills", "max-long-partial-prefills")),
]


REDACTED = "***"
# Keys that hold a credential wherever they appear (role variables, environment names, flags).
_SECRET_ENDINGS = ("api-key", "hf-token", "password")


def is_secret(name: str) -> bool:
    """Whether a flag, variable or key of that name holds a credential (any spelling)."""
    key = str(name).lower().replace("_", "-")
    flag = FLAGS.get(key)
    return bool(flag and flag.secret) or key.endswith(_SECRET_ENDINGS)


# A URL's userinfo (scheme://user:password@host, a database's or a deployment's): everything from
# the scheme to the host's last "@", which a password may hold too.
_USERINFO = re.compile(r"\b([A-Za-z][A-Za-z0-9+.-]*://)[^/?#\s]*@")


def redact_url(text: str) -> str:
    """``text`` with the userinfo of every URL in it ``***`` (scheme://***@host)."""
    return _USERINFO.sub(rf"\1{REDACTED}@", text) if "://" in text else text


def redact(data: Any) -> Any:
    """A copy of ``data`` (dicts and lists, any depth) with the value of every secret key ``***``
    and the userinfo of every URL in a string ``***``: what the lab shows or keeps of an input."""
    if isinstance(data, dict):
        return {k: (REDACTED if is_secret(k) and v not in (None, "") else redact(v))
                for k, v in data.items()}
    if isinstance(data, (list, tuple)):
        return type(data)(redact(v) for v in data)
    if isinstance(data, str):
        return redact_url(data)
    return data


def version_tuple(version: str) -> tuple[int, ...]:
    """'0.26.0' -> (0, 26, 0); a local suffix (+cu130, .dev5) is ignored."""
    core = version.split("+")[0]
    return tuple(int(p) for p in core.split(".")[:3] if p.isdigit())


def changes_for(version: str) -> dict[str, Change]:
    """The changes in force at ``version``, keyed by flag name."""
    v = version_tuple(version)
    return {c.flag: c for c in CHANGES if version_tuple(c.since) <= v}


# vLLM's batch defaults under `vllm serve` (EngineArgs.get_batch_defaults, usage context
# OPENAI_API_SERVER): larger on GPUs with 70 GiB or more, A100s excepted (vLLM PR 17885).
LARGE_GPU_GIB = 70
BATCH_DEFAULTS = {
    "large": {"max-num-batched-tokens": 8192, "max-num-seqs": 1024},
    "small": {"max-num-batched-tokens": 2048, "max-num-seqs": 256},
}


def is_large_gpu(gpu_memory_gib: float, gpu_name: str = "") -> bool:
    """Whether vLLM gives this GPU its larger batch defaults."""
    return gpu_memory_gib >= LARGE_GPU_GIB and "a100" not in gpu_name.lower()


def engine_defaults(gpu_memory_gib: float, gpu_name: str = "",
                    names: Iterable[str] | None = None) -> dict[str, Any]:
    """vLLM's defaults for ``names`` (default: the tuning flags) on this GPU (``vllm serve``, V1).

    The catalog's defaults, with max-num-batched-tokens and max-num-seqs as vLLM sizes them for
    the GPU: 8192 tokens / 1024 sequences at 70 GiB or more (A100s excepted), else 2048 / 256.
    """
    wanted = [n for n, f in FLAGS.items() if f.tuning] if names is None else list(names)
    defaults = {name: FLAGS[name].default for name in wanted}
    batch = BATCH_DEFAULTS["large" if is_large_gpu(gpu_memory_gib, gpu_name) else "small"]
    defaults.update({k: v for k, v in batch.items() if k in defaults})
    return defaults


NOT_MODELLED = "not modelled: measured only"
# Why the twin does not model a flag, where a reason helps (the rest: "not modelled").
UNMODELLED_WHY = {
    "enable-chunked-prefill": "chunked prefill is always on in vLLM's V1 engine",
}
# Flags the twin's server honours but its predictor does not model, and why.
PREDICTOR_IGNORES = {"stream-interval": "the predictor streams every token as it is made"}


def unmodelled(name: str, backend: str) -> str | None:
    """Why ``backend`` would read every value of flag ``name`` alike (None: it models the flag,
    or it is real vLLM)."""
    flag = FLAGS.get(name)
    if backend not in ("twin", "predict") or flag is None:
        return None
    if not flag.twin_models:
        return UNMODELLED_WHY.get(name, f"the flags catalog marks it {NOT_MODELLED}")
    return PREDICTOR_IGNORES.get(name) if backend == "predict" else None


def twin_note(name: str) -> str | None:
    """What to say beside a flag's twin or predictor figures: None where the twin models it."""
    flag = FLAGS.get(name)
    return NOT_MODELLED if flag is not None and not flag.twin_models else None


def default(name: str) -> Any:
    """vLLM's default for one flag that does not depend on the GPU (the catalog's)."""
    return FLAGS[name].default


def real_vllm_flag_names() -> set[str] | None:
    """Flag names of the installed vLLM's own `serve` parser, or None where vLLM is not importable."""
    try:
        from vllm.entrypoints.openai.cli_args import make_arg_parser
        from vllm.utils.argparse_utils import FlexibleArgumentParser
    except Exception:  # noqa: BLE001 - any import failure means "no usable vLLM here"
        try:
            from vllm.entrypoints.openai.cli_args import make_arg_parser
            from vllm.utils import FlexibleArgumentParser
        except Exception:  # noqa: BLE001
            return None
    parser = make_arg_parser(FlexibleArgumentParser())
    names = set()
    for action in parser._actions:  # argparse keeps no public list of options
        for opt in action.option_strings:
            if opt.startswith("--"):
                names.add(opt[2:].removeprefix("no-") if opt.startswith("--no-") else opt[2:])
    return names | {"model"}


def installed_vllm_version() -> str | None:
    """The installed vLLM's version, or None."""
    try:
        from importlib.metadata import version

        return version("vllm")
    except Exception:  # noqa: BLE001
        return None
