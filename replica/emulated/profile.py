"""Timing profiles: how long one scheduler iteration of an emulated engine takes.

One iteration (vLLM "step") runs the dense layers over every scheduled token and attention over
every cached token those tokens look at.  The dense part is a roofline: streaming the weights once
from HBM is a floor (small batches are memory-bound), above it compute grows with the tokens.
Attention is costed apart because it grows with context, not with batch size: a decoding sequence
reads each of its cached tokens' K and V once (memory-bound); a prefill chunk computes one score
per (query, key) pair (compute-bound).  ``step_time`` is affine in ``kv_tokens``, which the engine
relies on to sum decode-only stretches in closed form.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass(frozen=True)
class TimingProfile:
    name: str
    block_size: int  # tokens per KV block
    num_gpu_blocks: int  # KV capacity in blocks
    max_num_seqs: int  # max running requests
    max_num_batched_tokens: int  # per-step token budget (chunked prefill)
    step_base_s: float  # fixed cost of an iteration: scheduling, input prep, sampler, launches
    weights_read_s: float  # dense-layer floor: reading all weights once from HBM
    prefill_s_per_token: float  # dense compute per prompt token (compute-bound regime)
    decode_s_per_seq: float  # dense compute + sampling per decoding sequence
    decode_s_per_kv_token: float  # decode attention: reading one cached token's K,V in all layers
    prefill_s_per_attn_pair: float  # prefill attention: one (query, key) pair in all layers

    def step_time(self, prefill_tokens: int, num_decodes: int, kv_tokens: int,
                  attn_pairs: int = 0) -> float:
        """Seconds for one iteration.

        ``prefill_tokens``: prompt tokens computed this step (all chunks); ``num_decodes``: sequences
        generating one token; ``kv_tokens``: tokens the decoding sequences attend to (their context,
        the new token included); ``attn_pairs``: (query, key) pairs of the prefill chunks, i.e. for a
        chunk of n tokens after c computed ones, n*c + n*(n+1)/2.
        """
        dense = prefill_tokens * self.prefill_s_per_token + num_decodes * self.decode_s_per_seq
        if dense < self.weights_read_s:
            dense = self.weights_read_s
        return (self.step_base_s + dense + kv_tokens * self.decode_s_per_kv_token
                + attn_pairs * self.prefill_s_per_attn_pair)

    def prefill_tokens_per_s(self) -> float:
        """Steady prefill throughput with no decodes: full-budget chunks of fresh prompt."""
        n = self.max_num_batched_tokens
        return n / self.step_time(n, 0, 0, n * (n + 1) // 2)

    def decode_step_s(self, num_decodes: int, context_tokens: int) -> float:
        """One decode-only iteration of ``num_decodes`` sequences of ``context_tokens`` each."""
        return self.step_time(0, num_decodes, num_decodes * context_tokens)

    def replace(self, **overrides: object) -> TimingProfile:
        """A copy with some fields changed (``dataclasses.replace``)."""
        return dataclasses.replace(self, **overrides)


# --- Llama-3-8B-Instruct, bf16, one H100 SXM 80GB, vLLM v1 (chunked prefill, prefix caching) ---
# Model (config.json): 32 layers, hidden 4096, 32 query heads, 8 KV heads, head_dim 128,
# vocab 128,256; 8.03e9 parameters, of which 0.525e9 are the input embedding (a lookup, no FLOPs)
# and 0.525e9 the LM head.  GPU (NVIDIA H100 SXM datasheet): HBM3 3.35 TB/s, 989 TFLOPS dense
# bf16.
_WEIGHT_BYTES = 8.03e9 * 2  # 16.06 GB of bf16 weights
_HBM_BYTES_PER_S = 3.35e12
_BF16_FLOPS = 989e12
# K and V, per token: 32 layers * 8 KV heads * 128 dims * 2 (K and V) * 2 bytes = 128 KiB.
_KV_BYTES_PER_TOKEN = 32 * 8 * 128 * 2 * 2

LLAMA3_8B_H100 = TimingProfile(
    name="llama3-8b-h100",
    block_size=16,  # vLLM's default --block-size
    # (79.6 GiB visible * 0.9 gpu_memory_utilization - 14.96 GiB weights - ~2.5 GiB activation peak
    # of the profiling run at 8192 tokens and CUDA graphs) / 128 KiB ~= 444k tokens ~= 27.7k blocks.
    num_gpu_blocks=27_750,
    # vLLM's defaults for `vllm serve` on a GPU with >= 70 GiB that is not an A100
    # (EngineArgs.get_batch_defaults); smaller GPUs get 256 sequences and 2048 tokens.
    max_num_seqs=1024,
    max_num_batched_tokens=8192,
    # vLLM v1 with CUDA graphs: ~1 ms of scheduling, input preparation and sampling per iteration.
    # With the weight floor below, a lone decode step is ~6.6 ms (~150 tokens/s), roughly what
    # single-stream benchmarks of an 8B model on one H100 report.
    step_base_s=1.0e-3,
    # 16.06 GB / (3.35 TB/s at ~85% achievable bandwidth) = 5.6 ms.
    weights_read_s=_WEIGHT_BYTES / (_HBM_BYTES_PER_S * 0.85),
    # 2 FLOP per weight per token over the 6.98e9 non-embedding weights (vLLM applies the LM head to
    # the last prompt token only) = 14.0 GFLOP at ~50% MFU = 28.3 us/token.  With attention, an
    # 8192-token chunk takes ~0.27 s: ~30k prefill tokens/s.
    prefill_s_per_token=2 * 6.98e9 / (_BF16_FLOPS * 0.50),
    # 15 GFLOP per decoded token (LM head included) at ~40% MFU (a decode batch makes skinny GEMMs):
    # 38 us; +2 us of sampling and bookkeeping.  Exceeds the weight floor above ~140 sequences.
    decode_s_per_seq=2 * 7.5e9 / (_BF16_FLOPS * 0.40) + 2e-6,
    # 128 KiB read per cached token per decoding sequence at ~80% of HBM bandwidth = 49 ns; 256
    # sequences of 1.5k context spend ~19 ms in attention.
    decode_s_per_kv_token=_KV_BYTES_PER_TOKEN / (_HBM_BYTES_PER_S * 0.80),
    # QK^T and PV: 2 * 2 * 128 FLOP per head, 32 query heads, 32 layers = 524,288 FLOP per pair at
    # ~40% of peak (FlashAttention on varlen chunks) = 1.33 ns.  A 2k prompt's self-attention is
    # ~6% of its prefill; 2k new tokens after a 30k cached prefix pay ~80 ms of attention.
    prefill_s_per_attn_pair=4 * 128 * 32 * 32 / (_BF16_FLOPS * 0.40),
)

# A tiny engine whose steps take a few milliseconds of real time: for tests and demos that run the
# HTTP replica on a wall clock.  Not a model of any hardware.
CPU_TINY = TimingProfile(
    name="cpu-tiny",
    block_size=16,
    num_gpu_blocks=1024,
    max_num_seqs=32,
    max_num_batched_tokens=2048,
    step_base_s=2e-3,
    weights_read_s=1e-3,
    prefill_s_per_token=4e-6,
    decode_s_per_seq=20e-6,
    decode_s_per_kv_token=20e-9,
    prefill_s_per_attn_pair=0.0,
)

DEFAULT_PROFILE = LLAMA3_8B_H100
PROFILES: dict[str, TimingProfile] = {p.name: p for p in (LLAMA3_8B_H100, CPU_TINY)}
PROFILES["default"] = DEFAULT_PROFILE
