"""The engine's configuration, as vLLM resolves it at start-up: the flags the engine reads merged
over vLLM's defaults for the GPU and checked as vLLM checks them, and the split of GPU memory its
profiling run makes (weights, activations, CUDA graphs, the KV cache). Where vLLM would refuse to
start, ``EngineStartError`` carries vLLM's words."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from vllm_lab.flags import engine_defaults
from vllm_lab.twin.profile import Profile
from vllm_lab.twin.request_queue import POLICIES

GiB = 1024 ** 3
_WEIGHT_DTYPES = {"float32": (4, "fp32"), "float": (4, "fp32"), "float16": (2, "fp16"),
                  "half": (2, "fp16"), "bfloat16": (2, "bf16")}
_KV_DTYPES = {"fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1, "fp8_inc": 1, "bfloat16": 2, "float16": 2,
              "half": 2}
_BLOCK_SIZES = (1, 8, 16, 32, 64, 128, 256)
# The flags the engine reads; every other flag it is given changes nothing in it. Their defaults
# come from the flag catalog (vllm_lab.flags), the GPU-dependent ones sized for the profile's GPU.
ENGINE_FLAGS = frozenset({
    "max-num-seqs", "max-num-batched-tokens", "gpu-memory-utilization", "block-size",
    "max-model-len", "enforce-eager", "dtype", "kv-cache-dtype", "tensor-parallel-size",
    "enable-prefix-caching", "long-prefill-token-threshold", "num-gpu-blocks-override",
    "async-scheduling", "max-num-partial-prefills", "max-long-partial-prefills", "quantization",
    "cpu-offload-gb", "kv-cache-memory-bytes", "scheduling-policy", "kv-offloading-size",
    "kv-offloading-backend",
})
# The one --quantization the twin models: vLLM quantizes a 16-bit checkpoint's linear layers to
# fp8 as it loads it (no config file needed). Every other method reads its settings from the
# checkpoint (quantize_config.json and the like), which the lab's model folders do not have.
ONLINE_QUANTIZATION = "fp8"


class EngineStartError(Exception):
    """vLLM would refuse to start: ``cause`` is "oom" or "refused-flag", ``message`` vLLM's words."""

    def __init__(self, cause: str, message: str):
        super().__init__(message)
        self.cause = cause
        self.message = message


@dataclass
class MemoryPlan:
    """How vLLM splits GPU memory at start-up (per GPU)."""

    total_bytes: int
    requested_bytes: int
    weights_bytes: int
    activation_bytes: int
    cuda_graph_bytes: int
    non_torch_bytes: int
    kv_bytes: int
    kv_bytes_per_token: int
    num_gpu_blocks: int


@dataclass
class EngineConfig:
    """The flags the engine reads, resolved against vLLM's defaults."""

    max_num_seqs: int
    max_num_batched_tokens: int
    gpu_memory_utilization: float
    block_size: int
    max_model_len: int
    enforce_eager: bool
    weight_bytes: int
    peak_key: str
    kv_bytes: int
    tensor_parallel_size: int
    enable_prefix_caching: bool
    long_prefill_token_threshold: int
    num_gpu_blocks_override: int | None
    # vLLM 0.26 schedules step N+1 while step N runs unless an incompatible option turns it off
    # (config/vllm.py: async_scheduling None -> True); --no-async-scheduling plans each step after
    # the previous one ends.
    async_scheduling: bool = True
    quantization: str | None = None       # "fp8": linear layers stored and multiplied in fp8
    cpu_offload_bytes: int = 0            # weights kept in host memory, per GPU (V1 runner only)
    kv_cache_memory_bytes: int | None = None  # the KV cache's size, per GPU, when given
    scheduling_policy: str = "fcfs"       # the WAITING queue's order and the preemption victim
    kv_offloading_bytes: int = 0          # host memory for KV blocks, all GPUs together
    raw: dict[str, Any] = field(default_factory=dict)


def _norm_key(key: str) -> str:
    return key.lstrip("-").replace("_", "-")


def v1_model_runner(environ: Mapping[str, str]) -> bool:
    """Whether vLLM 0.26 runs the lab's models (dense ones) on its V1 model runner: only where
    the server's environment says VLLM_USE_V2_MODEL_RUNNER=0 (config/vllm.py: V2 is the default
    for every dense model, as envs.py reads the variable, an integer)."""
    value = environ.get("VLLM_USE_V2_MODEL_RUNNER")
    return value is not None and value.strip().isdigit() and int(value) == 0


def resolve_flags(flags: dict[str, Any], profile: Profile, model,
                  environ: Mapping[str, str] | None = None) -> EngineConfig:
    """Merge ``flags`` over vLLM's defaults for this GPU and check them as vLLM would; ``environ``
    is the server's environment, where vLLM reads which model runner to use (None: vLLM's
    default runner)."""
    defaults = engine_defaults(profile.hardware.memory_gib, profile.hardware.name, ENGINE_FLAGS)
    merged = {**defaults, **{_norm_key(k): v for k, v in flags.items()}}

    def refuse(msg: str):
        raise EngineStartError("refused-flag", msg)

    # vLLM checks these before anything else (EngineArgs._check_feature_supported): its V1 engine
    # has no concurrent partial prefills.
    if any(int(merged[k]) != 1 for k in ("max-num-partial-prefills", "max-long-partial-prefills")):
        refuse("NotImplementedError: Concurrent Partial Prefill is not supported. We recommend to "
               "remove Concurrent Partial Prefill from your config.")

    dtype = str(merged["dtype"] or "auto")
    dtype_name = model.torch_dtype if dtype == "auto" else dtype
    dtype_name = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}.get(dtype_name, dtype_name)
    if dtype_name not in _WEIGHT_DTYPES:
        refuse(f"argument --dtype: invalid choice: '{dtype}' (choose from 'auto', 'bfloat16', "
               f"'float', 'float16', 'float32', 'half')")
    weight_bytes, peak_key = _WEIGHT_DTYPES[dtype_name]
    kv_dtype = str(merged["kv-cache-dtype"] or "auto")
    if kv_dtype == "auto":
        kv_bytes = weight_bytes
    elif kv_dtype in _KV_DTYPES:
        kv_bytes = _KV_DTYPES[kv_dtype]
    else:
        refuse(f"argument --kv-cache-dtype: invalid choice: '{kv_dtype}'")
    block_size = int(merged["block-size"])
    if block_size not in _BLOCK_SIZES:
        refuse(f"argument --block-size: invalid choice: {block_size} (choose from "
               f"{', '.join(map(str, _BLOCK_SIZES))})")
    util = float(merged["gpu-memory-utilization"])
    if not 0 < util <= 1:
        refuse(f"1 validation error for CacheConfig\ngpu_memory_utilization\n  Input should be "
               f"{'greater than 0' if util <= 0 else 'less than or equal to 1'} "
               f"[type=greater_than, input_value={util}]")
    tp = int(merged["tensor-parallel-size"])
    if tp < 1:
        refuse(f"tensor_parallel_size must be at least 1, got {tp}")
    if model.num_heads % tp:
        refuse(f"Total number of attention heads ({model.num_heads}) must be divisible by tensor "
               f"parallel size ({tp}).")
    if tp > profile.hardware.gpu_count:
        refuse(f"World size ({tp}) is larger than the number of available GPUs "
               f"({profile.hardware.gpu_count}) in this node.")
    derived = model.max_position_embeddings
    max_model_len = merged.get("max-model-len")
    if max_model_len is None:
        max_model_len = derived
    max_model_len = int(max_model_len)
    if max_model_len > derived:
        refuse(f"User-specified max_model_len ({max_model_len}) is greater than the derived "
               f"max_model_len (max_position_embeddings={derived} or model_max_length=None in "
               f"model's config.json). To allow overriding this maximum, set the env var "
               f"VLLM_ALLOW_LONG_MAX_MODEL_LEN=1.")
    if max_model_len < 1:
        refuse(f"max_model_len must be at least 1, got {max_model_len}")
    seqs = int(merged["max-num-seqs"])
    mnbt = int(merged["max-num-batched-tokens"])
    if seqs < 1 or mnbt < 1:
        refuse("max_num_seqs and max_num_batched_tokens must be at least 1")
    if mnbt < seqs:
        refuse(f"max_num_batched_tokens ({mnbt}) must be greater than or equal to max_num_seqs "
               f"({seqs}).")
    quantization = merged.get("quantization")
    if quantization not in (None, ONLINE_QUANTIZATION):
        refuse(f"ValueError: Cannot find the config file for {quantization}")
    offload = float(merged.get("cpu-offload-gb") or 0)
    if offload < 0:
        refuse(f"cpu_offload_gb must be at least 0, got {offload}")
    # Only vLLM 0.26's V1 model runner installs the weight offloader; its V2 runner, the default
    # for dense models, accepts --cpu-offload-gb and keeps every weight on the GPU
    # (vllm-project/vllm#51396; an H100 read the same KV cache and step times at 0 and 1 GiB).
    if not v1_model_runner(environ or {}):
        offload = 0.0
    policy = str(merged.get("scheduling-policy") or "fcfs")
    if policy not in POLICIES:
        refuse(f"argument --scheduling-policy: invalid choice: '{policy}' (choose from "
               f"{', '.join(repr(p) for p in POLICIES)})")
    offloading = float(merged.get("kv-offloading-size") or 0)
    if offloading and merged.get("kv-offloading-backend") == "lmcache":
        # LMCache is a package of its own, not part of vLLM (nor of the twin).
        refuse("ModuleNotFoundError: No module named 'lmcache'")
    kv_memory = merged.get("kv-cache-memory-bytes")
    override = merged.get("num-gpu-blocks-override")
    return EngineConfig(
        quantization=quantization, cpu_offload_bytes=int(offload * GiB), scheduling_policy=policy,
        kv_offloading_bytes=int(offloading * GiB),
        kv_cache_memory_bytes=int(kv_memory) if kv_memory else None,
        max_num_seqs=seqs, max_num_batched_tokens=mnbt, gpu_memory_utilization=util,
        block_size=block_size, max_model_len=max_model_len,
        enforce_eager=bool(merged["enforce-eager"]), weight_bytes=weight_bytes, peak_key=peak_key,
        kv_bytes=kv_bytes, tensor_parallel_size=tp,
        enable_prefix_caching=bool(merged["enable-prefix-caching"]),
        long_prefill_token_threshold=int(merged.get("long-prefill-token-threshold") or 0),
        async_scheduling=merged.get("async-scheduling") is not False,
        num_gpu_blocks_override=int(override) if override else None, raw=merged)


def plan_memory(cfg: EngineConfig, profile: Profile, model) -> MemoryPlan:
    """Split one GPU's memory as vLLM's profiling run does, or raise where vLLM would not start."""
    hw, co = profile.hardware, profile.coefficients
    tp = cfg.tensor_parallel_size
    total = int(hw.memory_gib * GiB)
    requested = int(total * cfg.gpu_memory_utilization)
    # What stays on the GPU: the rest of the weights once --cpu-offload-gb is in host memory.
    weights = max(0, model_weight_bytes(cfg, model) // tp - cfg.cpu_offload_bytes)
    # The profiling run's peak: one max-num-batched-tokens forward (MLP intermediates dominate)
    # plus the sampler's fp32 logits for max-num-seqs sequences.
    act = cfg.max_num_batched_tokens * (3 * model.intermediate_size + 4 * model.hidden_size)
    act = act * cfg.weight_bytes // tp + cfg.max_num_seqs * model.vocab_size * 4 // tp
    graphs = 0 if cfg.enforce_eager else int(co.cuda_graph_memory_gib * GiB)
    non_torch = int(co.non_torch_memory_gib * GiB)
    per_token = model.kv_bytes_per_token(cfg.kv_bytes) // tp
    if weights > total - non_torch:
        raise EngineStartError("oom", (
            f"torch.OutOfMemoryError: CUDA out of memory. Tried to allocate "
            f"{min(weights, 2 * GiB) / 2**20:.2f} MiB. GPU 0 has a total capacity of "
            f"{total / GiB:.2f} GiB of which {max(total - non_torch - weights, 0) / 2**20:.2f} MiB "
            f"is free. Failed to load model - not enough GPU memory."))
    kv = requested - weights - act - graphs - non_torch
    if cfg.kv_cache_memory_bytes:
        # vLLM sizes the cache as told and leaves gpu-memory-utilization aside; a cache larger
        # than what is left fails to allocate.
        kv = cfg.kv_cache_memory_bytes
        free = total - weights - act - graphs - non_torch
        if kv > free:
            raise EngineStartError("oom", (
                f"torch.OutOfMemoryError: CUDA out of memory. Tried to allocate {kv / GiB:.2f} GiB. "
                f"GPU 0 has a total capacity of {total / GiB:.2f} GiB of which {max(free, 0) / GiB:.2f} "
                f"GiB is free."))
    if kv <= 0:
        raise EngineStartError("oom", "No available memory for the cache blocks. Try increasing "
                                      "`gpu_memory_utilization` when initializing the engine.")
    blocks = kv // (per_token * cfg.block_size)
    if cfg.num_gpu_blocks_override:
        blocks = cfg.num_gpu_blocks_override
    need = cfg.max_model_len * per_token
    if blocks * cfg.block_size < cfg.max_model_len:
        est = blocks * cfg.block_size
        raise EngineStartError("oom", (
            f"To serve at least one request with the models's max seq len ({cfg.max_model_len}), "
            f"({need / GiB:.2f} GiB KV cache is needed, which is larger than the available KV cache "
            f"memory ({kv / GiB:.2f} GiB). Based on the available memory, the estimated maximum "
            f"model length is {est}. Try increasing `gpu_memory_utilization` or decreasing "
            f"`max_model_len` when initializing the engine."))
    return MemoryPlan(total, requested, weights, act, graphs, non_torch, kv, per_token, int(blocks))


def model_weight_bytes(cfg: EngineConfig, model) -> int:
    """The model's weights in bytes (before tensor parallelism): the linear layers in one byte under
    --quantization fp8, the embeddings, the LM head and the norms in the model's dtype."""
    linear = model.linear_params
    per_linear = 1 if cfg.quantization == ONLINE_QUANTIZATION else cfg.weight_bytes
    return linear * per_linear + (model.num_params - linear) * cfg.weight_bytes
