"""The replay's time model, from a hardware profile.

Prefills run one at a time at ``prefill_tokens_per_s``, each once its host loads have arrived;
loads and stores queue on their own direction of the host link (``h2d_bytes_per_s``,
``d2h_bytes_per_s``); decoding runs concurrently at ``decode_s_per_token``. Each booking method
takes its resource from when it is free (or from ``now``) and returns when the work ends.
"""

from __future__ import annotations

from policyd.core.profiles import HardwareProfile


class CostModel:
    """When each resource is next free: the compute (prefills) and both link directions."""

    __slots__ = ("compute_free_s", "d2h_free_s", "h2d_free_s", "profile")

    def __init__(self, profile: HardwareProfile) -> None:
        self.profile = profile
        self.compute_free_s = 0.0
        self.h2d_free_s = 0.0
        self.d2h_free_s = 0.0

    def block_bytes(self, blocks: int) -> int:
        """The KV bytes of ``blocks`` blocks."""
        return blocks * self.profile.kv_bytes_per_block

    def load(self, now: float, nbytes: int) -> float:
        """Book a host -> GPU transfer of ``nbytes``; returns when it has arrived."""
        start = max(now, self.h2d_free_s)
        self.h2d_free_s = start + nbytes / self.profile.h2d_bytes_per_s
        return self.h2d_free_s

    def store(self, now: float, nbytes: int) -> float:
        """Book a GPU -> host transfer of ``nbytes``; returns when it is written."""
        start = max(now, self.d2h_free_s)
        self.d2h_free_s = start + nbytes / self.profile.d2h_bytes_per_s
        return self.d2h_free_s

    def prefill(self, now: float, loaded_s: float, tokens: int) -> float:
        """Book the prefill of ``tokens`` tokens whose loads arrive at ``loaded_s``; returns
        when it ends."""
        start = max(now, self.compute_free_s, loaded_s)
        self.compute_free_s = start + tokens / self.profile.prefill_tokens_per_s
        return self.compute_free_s

    def decode_end(self, now: float, output_tokens: int) -> float:
        """When decoding ``output_tokens`` tokens from ``now`` ends (decoding is not queued)."""
        return now + output_tokens * self.profile.decode_s_per_token
