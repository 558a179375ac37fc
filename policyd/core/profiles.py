"""Hardware + model profiles for the simulator's cost model.

Each number says where it comes from. Throughputs are *modelled* (peak x an assumed
utilisation), not measured here: no GPU is available to this project's CI. Change them with
``policyd bench --profile`` or by adding a profile; results are comparable only within a profile.
"""

from __future__ import annotations

from dataclasses import dataclass

GiB = 1024**3


@dataclass(frozen=True, slots=True)
class HardwareProfile:
    name: str
    description: str
    prefill_tokens_per_s: float  # recomputed prompt tokens per second (compute-bound)
    decode_s_per_token: float  # seconds per generated token of one request (memory-bound step)
    h2d_bytes_per_s: float  # host -> device (loads from the host tier)
    d2h_bytes_per_s: float  # device -> host (stores into the host tier)
    kv_bytes_per_token: int
    gpu_kv_bytes: int  # HBM left for the KV cache after weights and activations
    host_kv_bytes: int  # a typical host-tier size for this machine

    @property
    def kv_bytes_per_block(self) -> int:
        return self.kv_bytes_per_token * 16

    def gpu_blocks(self) -> int:
        return self.gpu_kv_bytes // self.kv_bytes_per_block

    def host_blocks(self) -> int:
        return self.host_kv_bytes // self.kv_bytes_per_block


# Llama-3.1-8B: 32 layers, 8 KV heads, head_dim 128, bf16 -> 2 (K,V) * 32 * 8 * 128 * 2 B
# = 131072 B = 128 KiB per token (model card config.json).
# H200 SXM: 141 GB HBM3e at 4.8 TB/s, 989 TFLOPS dense BF16 (NVIDIA H200 datasheet).
# Prefill: 2 * 8.0e9 FLOP/token -> 61.8k tokens/s at peak; at 40 % MFU ~ 25k tokens/s.
# Decode: a step streams the 16 GB of weights: 16e9 / 4.8e12 = 3.3 ms; with attention over long
# contexts and scheduling overhead vLLM reaches ~8 ms per step at moderate batch (assumed).
# Host link: PCIe Gen5 x16, 64 GB/s per direction peak; ~50 GB/s achieved.
# KV space: 141 GB - 16 GB weights - ~10 % activations/graphs at gpu_memory_utilization 0.9
# -> ~110 GB; we take 100 GiB. Host tier: 256 GiB of a typical 1-2 TB host.
H200_LLAMA31_8B = HardwareProfile(
    name="h200-llama3.1-8b",
    description="NVIDIA H200 141 GB + Llama-3.1-8B (bf16), PCIe Gen5",
    prefill_tokens_per_s=25_000.0,
    decode_s_per_token=0.008,
    h2d_bytes_per_s=50e9,
    d2h_bytes_per_s=50e9,
    kv_bytes_per_token=131_072,
    gpu_kv_bytes=100 * GiB,
    host_kv_bytes=256 * GiB,
)

# Qwen3-14B: 40 layers, 8 KV heads, head_dim 128, bf16 -> 2 * 40 * 8 * 128 * 2 B = 163840 B
# = 160 KiB per token (model card config.json).
# RTX A6000: 48 GB GDDR6 at 768 GB/s, 154.8 TFLOPS dense BF16 tensor (NVIDIA A6000 datasheet).
# Prefill: 2 * 14.8e9 FLOP/token -> 5.2k tokens/s at peak; at 45 % MFU ~ 2.4k tokens/s.
# Decode: 29.6 GB of weights / 768 GB/s = 39 ms; ~45 ms per step with overhead (assumed).
# Host link: PCIe Gen4 x16, 32 GB/s per direction peak; ~25 GB/s achieved.
# KV space: 48 GB * 0.9 - 29.6 GB weights - ~2 GB activations ~ 11.5 GB; we take 10 GiB.
A6000_QWEN3_14B = HardwareProfile(
    name="a6000-qwen3-14b",
    description="NVIDIA RTX A6000 48 GB + Qwen3-14B (bf16), PCIe Gen4",
    prefill_tokens_per_s=2_400.0,
    decode_s_per_token=0.045,
    h2d_bytes_per_s=25e9,
    d2h_bytes_per_s=25e9,
    kv_bytes_per_token=163_840,
    gpu_kv_bytes=10 * GiB,
    host_kv_bytes=64 * GiB,
)

PROFILES: dict[str, HardwareProfile] = {p.name: p for p in (H200_LLAMA31_8B, A6000_QWEN3_14B)}


def get_profile(name: str) -> HardwareProfile:
    try:
        return PROFILES[name]
    except KeyError:
        raise ValueError(
            f"unknown hardware profile {name!r}; valid profiles: {', '.join(sorted(PROFILES))}"
        ) from None
