"""The time of one engine step: roofline terms from the model shape and hardware, plus fitted overheads.

Linear layers: max(FLOPs / (peak x efficiency), weight bytes / (bandwidth x efficiency)) - weights
are read once per step whatever the batch. Attention: max(FLOPs over query-key pairs, KV bytes
read). Then fixed costs per step, per sequence and per token, kernel launches when no CUDA graph
covers the step, and two all-reduces per layer under tensor parallelism.

Launches without a CUDA graph: the CPU issues each kernel while the GPU runs the ones before it,
so a step without a graph takes max(GPU time, the CPU's launch time), never their sum. Under
--enforce-eager vLLM runs neither torch.compile nor CUDA graphs: PyTorch's eager dispatch issues every
op of every layer (``eager_layer_overhead_s`` per layer, measured where a profile's GPU served
with --enforce-eager: on the H200's host 26 ms a pure-decode step at 64 sequences where the graphed
step takes 5 ms, on an H100's 15.3 ms at the chat traffic's lightest level; it is the host's CPU,
and of make calibrate's runs only its eager one reads it). Small
steps (decodes) are then bound by the CPU, while a step with a prefill chunk of thousands of tokens
keeps the GPU busy longer than its launches and costs what it costs with graphs. A compiled step
larger than the largest captured graph (vLLM captures up to min(2 x max-num-seqs, 512) tokens)
launches Inductor's fused kernels, fewer and cheaper (``compiled_layer_launch_s`` per layer).
"""

from __future__ import annotations

import numpy as np

from vllm_lab.twin.profile import HOST_LINK_GBS, Profile

DTYPE_PEAK_KEY = {4: "fp32", 2: "bf16", 1: "fp8"}
# L2's read bandwidth over HBM's where a GPU's is not known: 8,500 GB/s reads an H100's (3.35 TB/s)
# shared-prompt runs at 64 and 128 users (reports/examples/h100, "A fourteenth host").
L2_OVER_HBM = 2.5


def chunk_pairs(tokens: int, cached: int) -> float:
    """Attention pairs of a prompt chunk of ``tokens`` after ``cached`` tokens in the cache: each
    token attends over the cache and, causally, over the chunk's tokens up to itself."""
    return tokens * (cached + (tokens + 1) / 2)


class StepTimeModel:
    """Prices one step from its batch composition."""

    def __init__(self, profile: Profile, model, weight_bytes: int, kv_bytes: int, tp: int = 1,
                 enforce_eager: bool = False, block_size: int = 16, cuda_graph_max_tokens: int = 512,
                 dtype_name: str = "bf16", fp8_linear: bool = False, offload_bytes: int = 0):
        hw, co = profile.hardware, profile.coefficients
        self.co = co
        h, v, layers = model.hidden_size, model.vocab_size, model.num_layers
        linear_params = model.linear_params
        peak = hw.tflops(dtype_name) or hw.tflops(DTYPE_PEAK_KEY[weight_bytes]) or 100.0
        # --quantization fp8: the linear layers' weights are one byte, multiplied at the fp8 peak
        # where the tensor cores have one (else dequantized to 16-bit arithmetic); the LM head
        # stays in the model's dtype. The efficiency is the 16-bit GEMMs' (not measured in fp8).
        linear_peak = (hw.tflops("fp8") or peak) if fp8_linear else peak
        linear_bytes = 1 if fp8_linear else weight_bytes
        bw = hw.bandwidth_gbs * 1e9 * co.bandwidth_efficiency
        self.gemm_s_per_token = 2 * linear_params / tp / (linear_peak * 1e12 * co.gemm_efficiency)
        self.lm_head_s_per_sample = 2 * h * v / tp / (peak * 1e12 * co.gemm_efficiency)
        self.weights_s = (linear_params * linear_bytes + h * v * weight_bytes) / tp / bw
        # Bytes a second one GPU reads host memory at. --cpu-offload-gb: the kernels read the
        # offloaded weights over it (zero-copy), every step whatever its batch.
        self.host_link = (hw.host_link_gbs or HOST_LINK_GBS) * 1e9
        self.offload_s = offload_bytes / self.host_link
        self.attn_s_per_pair = (4 * layers * model.num_heads * model.head_dim / tp
                                / (peak * 1e12 * co.attention_efficiency))
        # An fp8 cache (one byte) is read in fp8_kv_read_share of a 16-bit cache's time, not half.
        kv_read_bytes = 2 * co.fp8_kv_read_share if kv_bytes == 1 else kv_bytes
        kv_token_bytes = 2 * layers * model.num_kv_heads * model.head_dim * kv_read_bytes / tp
        # Attention streams the cache in one kernel a layer, nearer the HBM's bandwidth than the
        # linear layers' short kernels reach.
        kv_bw = hw.bandwidth_gbs * 1e9 * (co.kv_bandwidth_efficiency or co.bandwidth_efficiency)
        self.kv_s_per_token = kv_token_bytes / kv_bw
        # A shared prompt's blocks are read from memory by the first request of a step that holds
        # them and, still in L2 (a layer's share of a long prompt is a few MB), by the others.
        l2_bw = (hw.l2_bandwidth_gbs or L2_OVER_HBM * hw.bandwidth_gbs) * 1e9
        self.kv_l2_s_per_token = min(self.kv_s_per_token, kv_token_bytes / l2_bw)
        self.block_s_per_token = co.block_overhead_s * layers / block_size
        self.launch_s = co.eager_layer_overhead_s * layers
        self.compiled_launch_s = co.compiled_layer_launch_s * layers
        self.mixed_launch_s = co.mixed_step_launch_s
        self.eager = enforce_eager
        self.graph_max = cuda_graph_max_tokens
        self.comm_s = self.comm_s_per_token = 0.0
        if tp > 1:
            self.comm_s = 2 * layers * hw.interconnect_latency_us * 1e-6
            self.comm_s_per_token = (2 * layers * h * 2 * 2 * (tp - 1) / tp
                                     / (hw.interconnect_gbs * 1e9))
        self.quantize_s = co.fp8_layer_overhead_s * layers if fp8_linear else 0.0
        self.fixed_s = co.step_overhead_s + self.offload_s + self.quantize_s

    def compute_share(self, num_tokens: int, kernel_s: float) -> float:
        """The share of a step's kernel time (``kernel_s``, for ``num_tokens`` tokens) that is
        arithmetic (its linear layers' multiplications) rather than waiting on memory: ~0 for a
        small decode batch, which reads the weights and the KV cache, about half for 512 decodes,
        ~1 for a prefill chunk of thousands of tokens."""
        if kernel_s <= 0:
            return 0.0
        return min(1.0, num_tokens * self.gemm_s_per_token / kernel_s)

    def step_time(self, num_tokens: int, num_seqs: int, num_sampled: int, attn_pairs: float,
                  kv_tokens: float, prefills: int = 0) -> float:
        """Seconds for a step of ``num_tokens`` tokens over ``num_seqs`` sequences.

        ``attn_pairs``: query-key pairs attention computes; ``kv_tokens``: KV tokens read or written;
        ``prefills``: the prompt chunks among them (beside decodes, the step runs as a piecewise graph).
        """
        return self.step_parts(num_tokens, num_seqs, num_sampled, attn_pairs, kv_tokens, prefills)[0]

    def step_parts(self, num_tokens: int, num_seqs: int, num_sampled: int, attn_pairs: float,
                   kv_tokens: float, prefills: int = 0, shared_tokens: float = 0) -> tuple[float, float]:
        """A step's seconds (``step_time``) and, of them, the seconds its kernels keep the GPU
        busy: the roofline terms. The rest (the engine's own work a step, a sequence and a token,
        and the launches no CUDA graph covers) is the host's, while the GPU waits.
        ``shared_tokens``: of ``kv_tokens``, those read again by another sequence of the step (a
        shared prompt prefix's blocks, each hold past the first), which L2 serves."""
        co = self.co
        gemm = num_tokens * self.gemm_s_per_token + num_sampled * self.lm_head_s_per_sample
        t = max(self.weights_s, gemm)
        attn = attn_pairs * self.attn_s_per_pair
        kv = self._kv_read(kv_tokens, shared_tokens)
        t += max(kv, attn)
        blocks = kv_tokens * self.block_s_per_token
        kernels = t + self.offload_s + self.quantize_s + blocks
        t += self.fixed_s + co.seq_overhead_s * num_seqs + co.token_overhead_s * num_tokens
        t += blocks
        if self.comm_s:
            t += self.comm_s + num_tokens * self.comm_s_per_token
            kernels += self.comm_s + num_tokens * self.comm_s_per_token
        return self._launched(t, num_tokens, mixed=0 < prefills < num_seqs), kernels

    def _kv_read(self, kv_tokens, shared_tokens: float):
        """Seconds a step reads ``kv_tokens`` of KV cache in: from memory, but for the repeated
        reads of the blocks several of its sequences hold (``shared_tokens``), which L2 serves."""
        return ((kv_tokens - shared_tokens) * self.kv_s_per_token
                + shared_tokens * self.kv_l2_s_per_token)

    def _launched(self, t, num_tokens: int, mixed: bool = False):
        """Step time ``t`` (seconds, scalar or array) with the kernel launches a graph would save.

        vLLM 0.26 replays a whole CUDA graph only for a batch of decodes; a step that carries
        prompt chunks beside decodes runs its graph in pieces, attention launched layer by layer
        between them (FULL_AND_PIECEWISE), which costs ``mixed_step_launch_s`` more (a prefill
        alone, its GPU work long enough to hide the launches, measured no such cost); past the
        largest graph the compiled kernels are launched one by one, a floor."""
        if self.eager:
            return np.maximum(t, self.launch_s)
        if num_tokens > self.graph_max:
            return np.maximum(t, self.compiled_launch_s)
        if mixed:
            return t + self.mixed_launch_s
        return t

    def decode_times(self, batch: int, ctx_sum: int, steps: int) -> np.ndarray:
        """Times of ``steps`` pure-decode steps of ``batch`` sequences whose contexts sum to ``ctx_sum``
        at the first step and grow by ``batch`` each step."""
        return self.decode_parts(batch, ctx_sum, steps)[0]

    def decode_parts(self, batch: int, ctx_sum: int, steps: int,
                     shared_tokens: float = 0) -> tuple[np.ndarray, np.ndarray]:
        """``decode_times`` and, of each, the seconds its kernels keep the GPU busy, with
        ``shared_tokens`` of the contexts read again (``step_parts``)."""
        co = self.co
        ctx = ctx_sum + batch * np.arange(steps, dtype=np.float64)
        linear = max(batch * (self.gemm_s_per_token + self.lm_head_s_per_sample), self.weights_s)
        fixed = linear + self.fixed_s + co.seq_overhead_s * batch
        fixed += co.token_overhead_s * batch
        linear += self.offload_s + self.quantize_s  # the kernels of ``fixed_s``
        if self.comm_s:
            fixed += self.comm_s + batch * self.comm_s_per_token
            linear += self.comm_s + batch * self.comm_s_per_token
        t = np.maximum(ctx * self.attn_s_per_pair,
                       self._kv_read(ctx, shared_tokens))
        t += ctx * self.block_s_per_token
        return self._launched(t + fixed, batch), t + linear
