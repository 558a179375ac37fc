"""Which rows to copy between vLLM's KV tensors and the host buffer for one transfer.

The host buffer of each KV tensor is a ``(num_chunks * blocks_per_chunk, page_bytes)`` array:
chunk ``c`` holds the pages of ``blocks_per_chunk`` consecutive GPU blocks at rows
``c * blocks_per_chunk + j``. A transfer names GPU block ids (grouped by KV-cache group) and host
chunk ids; when a group's first GPU block starts mid-chunk (``block_indices[g] %
blocks_per_chunk``), the first chunk's leading rows are skipped - vLLM's own worker does the same
(v1/kv_offload/cpu/gpu_worker.py, ``transfer_async``). Pure numpy, so it is tested without vLLM.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

Rows = npt.NDArray[np.int64]


def plan_rows(
    gpu_block_ids: Sequence[int] | npt.NDArray[np.integer],
    host_chunk_ids: Sequence[int] | npt.NDArray[np.integer],
    group_sizes: Sequence[int],
    block_indices: Sequence[int],
    blocks_per_chunk: int,
) -> list[tuple[Rows, Rows]]:
    """Per KV-cache group: (GPU rows, host rows) of equal length, in transfer order.

    >>> [(g.tolist(), h.tolist()) for g, h in plan_rows([7, 3, 9], [4, 5], [3], [1], 2)]
    [([7, 3, 9], [9, 10, 11])]
    """
    if blocks_per_chunk < 1:
        raise ValueError(f"blocks_per_chunk must be >= 1, got {blocks_per_chunk}")
    if len(group_sizes) != len(block_indices):
        raise ValueError("group_sizes and block_indices must have one entry per KV-cache group")
    gpu = np.asarray(gpu_block_ids, dtype=np.int64)
    host = np.asarray(host_chunk_ids, dtype=np.int64)
    if int(sum(group_sizes)) != len(gpu):
        raise ValueError(f"{len(gpu)} GPU blocks, but the groups add up to {sum(group_sizes)}")
    plans: list[tuple[Rows, Rows]] = []
    gpu_off = host_off = 0
    for size, first in zip(group_sizes, block_indices, strict=True):
        if size == 0:
            plans.append((np.empty(0, np.int64), np.empty(0, np.int64)))
            continue
        skip = first % blocks_per_chunk
        n_chunks = -(-(size + skip) // blocks_per_chunk)
        chunks = host[host_off : host_off + n_chunks]
        if len(chunks) != n_chunks:
            raise ValueError(f"group needs {n_chunks} host chunks, only {len(chunks)} left")
        sub = (chunks[:, None] * blocks_per_chunk + np.arange(blocks_per_chunk)).reshape(-1)
        plans.append((gpu[gpu_off : gpu_off + size], sub[skip : skip + size]))
        gpu_off += size
        host_off += n_chunks
    if host_off != len(host):
        raise ValueError(f"{len(host)} host chunks given, the transfer uses {host_off}")
    return plans
