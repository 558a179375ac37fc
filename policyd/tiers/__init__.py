"""Applying a policy snapshot to the KV tiers: the one decision path.

The vLLM connector (``connector/vllm_adapter.py``) and the simulator (``policyd.sim``) run this
code, so a figure the simulator credits is a decision the connector applies. No vLLM import.

* ``view`` - a snapshot indexed for O(1) questions, the write filter (decided locally, per
  request), pin selection, and which blocks only retired workflows used;
* ``gpu`` - the GPU tier's moves (retire, rank, pin) on a pool with vLLM's free-queue semantics,
  in budgeted steps;
* ``host_order`` - the host tier's eviction order (exactly LRU without a snapshot).
"""
