"""Replays on the compiled cache model: ``simulate`` takes this path for ``lru`` and ``belady``.

``compiled_simulate`` returns the ``Report`` the Python ``Simulator`` returns for the same
replay (every counter, the simulated times, the records), from ``policyd.sim.kernel``. It
applies when the policy makes no snapshot decision and the replay needs nothing the kernel does
not model (``unsupported`` says what); ``simulate`` falls back to the Python model otherwise.

``wall_s`` covers the arrays' preparation and the replay (for belady: its last pass and its
future index), not numba's one-off compilation (cached on disk across processes), which
``warm_up`` does outside the timing.
"""

from __future__ import annotations

import functools
import time
from collections import OrderedDict
from collections.abc import Callable

import numpy as np
import numpy.typing as npt

from policyd.core.profiles import get_profile
from policyd.sim import kernel
from policyd.sim.config import SimConfig
from policyd.sim.dense import DenseTrace
from policyd.sim.report import Report, RequestRecord
from policyd.sim.requests import call_of
from policyd.workloads.calls import Call, Workload

COMPILED_POLICIES = ("lru", "belady")
_TRACES: OrderedDict[int, tuple[Workload, int, DenseTrace]] = OrderedDict()
_TRACES_KEPT = 4  # workloads whose arrays are kept between replays (a bench replays each often)


def unsupported(
    workload: Workload, policy: str, config: SimConfig, params: dict[str, object] | None
) -> str | None:
    """Why the compiled model cannot replay this, or None when it can."""
    if policy not in COMPILED_POLICIES:
        return f"{policy} makes snapshot decisions (compiled: {', '.join(COMPILED_POLICIES)})"
    if params:
        return "policy parameters"
    if config.prefetch_budget_blocks:
        return "prefetch"
    if config.audit_declines:
        return "the declined-write audit"
    if config.codec_roundtrip:
        return "the wire codec round trip"
    if dense_trace(workload, config.block_tokens).repeats_a_block:
        return "a call naming one block twice"
    return None


def dense_trace(workload: Workload, block_tokens: int) -> DenseTrace:
    """``workload``'s arrays, kept for the last few workloads replayed."""
    key = id(workload)
    kept = _TRACES.get(key)
    if kept is not None and kept[0] is workload and kept[1] == block_tokens:
        _TRACES.move_to_end(key)
        return kept[2]
    trace = DenseTrace.of(workload, block_tokens)
    _TRACES[key] = (workload, block_tokens, trace)
    while len(_TRACES) > _TRACES_KEPT:
        _TRACES.popitem(last=False)
    return trace


def compiled_simulate(
    workload: Workload,
    policy: str,
    config: SimConfig,
    *,
    belady_passes: int = 2,
    lru_report: Report | None = None,
    progress: Callable[[int], None] | None = None,
) -> Report:
    """``simulate`` on the compiled model (``unsupported`` must be None). Belady learns the
    order calls reach the cache as ``simulate`` does: from ``lru_report`` when it has records,
    else from an LRU replay; then from each of its own passes, until a pass admits the calls
    in the order it was told (open-loop traces: the first)."""
    warm_up()
    started = time.perf_counter()
    trace = dense_trace(workload, config.block_tokens)
    if policy == "lru":
        report, _ = _replay(trace, config, None, started)
    else:
        report = _belady(trace, config, belady_passes, lru_report, started)
    if progress is not None:
        progress(report.requests)
    return report


def _belady(
    trace: DenseTrace,
    config: SimConfig,
    passes: int,
    lru_report: Report | None,
    started: float,
) -> Report:
    if lru_report is not None and len(lru_report.records) == lru_report.requests:
        order = _order_of_records(trace, lru_report.records)
    else:
        order = _replay(trace, config, None, started)[1]
    passes = 1 if config.concurrency == 1 else max(1, passes)
    report = None
    for _ in range(passes):
        started = time.perf_counter()
        report, admitted = _replay(trace, config, order, started)
        if np.array_equal(admitted, order):  # a fixed point: another pass replays this one
            break
        order = admitted
    assert report is not None
    return report


@functools.cache
def warm_up() -> None:
    """Compile (or load from numba's cache) the kernel once per process, on a tiny trace."""
    call = Call("w", "a", (1, 2), prompt_tokens=40, output_tokens=20)
    tiny = Workload("warm-up", [(call, call)])
    for host_blocks in (0, 8):
        config = SimConfig(concurrency=1, gpu_blocks=8, host_blocks=host_blocks)
        trace = DenseTrace.of(tiny, config.block_tokens)
        _, order = _replay(trace, config, None, 0.0)
        _replay(trace, config, order, 0.0)


def _order_of_records(trace: DenseTrace, records: list[RequestRecord]) -> npt.NDArray[np.int64]:
    first = trace.stream_first
    out = np.empty(len(records), dtype=np.int64)
    for k, rec in enumerate(records):
        stream, index = call_of(rec.request_id)
        out[k] = first[stream] + index
    return out


def _replay(
    trace: DenseTrace,
    config: SimConfig,
    belady_order: npt.NDArray[np.int64] | None,
    started: float,
) -> tuple[Report, npt.NDArray[np.int64]]:
    """One pass: LRU when ``belady_order`` is None, else Belady knowing that order. Returns
    the report and the order calls were admitted in."""
    profile = get_profile(config.profile)
    gpu_blocks, host_blocks = config.tier_blocks(profile)
    belady = belady_order is not None
    setup = kernel.Setup(
        policy=kernel.POLICY_BELADY if belady else kernel.POLICY_LRU,
        separate=config.running_space == "separate",
        offload_prompt_only=config.offload_prompt_only,
        concurrency=config.concurrency,
        gpu_capacity=gpu_blocks,
        host_capacity=host_blocks,
        block_tokens=config.block_tokens,
        kv_bytes_per_block=profile.kv_bytes_per_block,
        prefill_tokens_per_s=profile.prefill_tokens_per_s,
        decode_s_per_token=profile.decode_s_per_token,
        h2d_bytes_per_s=profile.h2d_bytes_per_s,
        d2h_bytes_per_s=profile.d2h_bytes_per_s,
    )
    oracle = _oracle(trace, belady_order)
    run = _new_run(trace, setup, oracle.never)
    kernel.replay(_trace_arrays(trace, config), setup, run, oracle)
    _raise_on_error(trace, run, gpu_blocks)
    report = Report(
        policy="belady" if belady else "lru",
        workload=trace.workload.name,
        profile=profile.name,
        concurrency=config.concurrency,
        gpu_blocks=gpu_blocks,
        host_blocks=host_blocks,
    )
    _fill(report, trace, run, config.record_requests)
    report.finish(
        float(run.ft[kernel.F_LAST_FINISH]),
        run.latency[: run.st[kernel.S_FINISHED]].tolist(),
        time.perf_counter() - started,
    )
    return report, run.admitted[: run.st[kernel.S_ADMITTED]].copy()


def _trace_arrays(trace: DenseTrace, config: SimConfig) -> kernel.Trace:
    return kernel.Trace(
        prompt=trace.prompt,
        prompt_off=trace.prompt_off,
        cached_out=trace.cached_out,
        cached_out_off=trace.cached_out_off,
        physical_blocks=trace.physical_blocks,
        prompt_tokens=trace.prompt_tokens,
        output_tokens=trace.output_tokens,
        gap_s=trace.gap_s,
        parallel=trace.parallel,
        stream_first=trace.stream_first,
        stream_of=trace.stream_of,
        hit_limit=trace.hit_limits(config.recompute_last_token),
    )


def _oracle(trace: DenseTrace, order: npt.NDArray[np.int64] | None) -> kernel.Oracle:
    position = np.full(trace.n_calls, -1, dtype=np.int64)
    if order is None:
        empty = np.zeros(1, dtype=np.int64)
        return kernel.Oracle(position, empty, np.zeros(1, np.int32), empty, empty, 0)
    off, blocks, nxt, depth = kernel.future_of(
        order, (trace.prompt, trace.prompt_off), (trace.given_out, trace.given_out_off), trace.n_ids
    )
    if len(depth) and int(depth.max()) >= kernel.DEPTH_LIMIT:
        raise ValueError(f"a call of more than {kernel.DEPTH_LIMIT} blocks: use the Python model")
    position[order] = np.arange(len(order), dtype=np.int64)
    return kernel.Oracle(position, off, blocks, nxt, depth, len(order) + 1)


def _new_run(trace: DenseTrace, setup: kernel.Setup, never: int) -> kernel.Run:
    n, n_ids = trace.n_calls, max(1, trace.n_ids)
    keyed = setup.policy == kernel.POLICY_BELADY
    held_len = np.diff(trace.prompt_off) + np.diff(trace.cached_out_off)
    held_off = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(held_len, out=held_off[1:])
    widest = int(held_len.max()) if n else 0
    timers = 2 * n + 8
    return kernel.Run(
        st=np.zeros(kernel.N_STATE, dtype=np.int64),
        ft=np.zeros(kernel.N_FSTATE, dtype=np.float64),
        counters=np.zeros(kernel.N_COUNTERS, dtype=np.int64),
        refs=np.full(n_ids, -1, dtype=np.int32),
        gpu=kernel.make_queue(n_ids, setup.gpu_capacity, keyed),
        host=kernel.make_queue(n_ids, setup.host_capacity, keyed),
        next_use=np.full(n_ids if keyed else 1, never, dtype=np.int64),
        protect=np.zeros(n_ids, dtype=np.int64),
        buf=np.zeros(widest + min(setup.host_capacity, n_ids) + 1, dtype=np.int32),
        held=np.zeros(int(held_off[-1]), dtype=np.int32),
        held_off=held_off,
        held_n=np.zeros(n, dtype=np.int64),
        req_scratch=np.zeros(n, dtype=np.int64),
        gpu_hit=np.zeros(n, dtype=np.int64),
        host_hit=np.zeros(n, dtype=np.int64),
        arrival_s=np.zeros(n, dtype=np.float64),
        waiting=np.zeros(n, dtype=np.int64),
        outstanding=np.zeros(len(trace.stream_first), dtype=np.int64),
        next_step=np.zeros(len(trace.stream_first), dtype=np.int64),
        timer_when=np.zeros(timers, dtype=np.float64),
        timer_seq=np.zeros(timers, dtype=np.int64),
        timer_kind=np.zeros(timers, dtype=np.int64),
        timer_call=np.zeros(timers, dtype=np.int64),
        admitted=np.zeros(n, dtype=np.int64),
        latency=np.zeros(n, dtype=np.float64),
    )


def _raise_on_error(trace: DenseTrace, run: kernel.Run, gpu_blocks: int) -> None:
    error = run.st[kernel.S_ERROR]
    if error == kernel.ERROR_TOO_LARGE:
        c = int(run.st[kernel.S_ERROR_CALL])
        raise ValueError(
            f"request {trace.request_id(c)} needs {int(trace.physical_blocks[c])} GPU blocks but "
            f"the GPU tier has {gpu_blocks}: raise the GPU capacity"
        )
    if error == kernel.ERROR_NEVER_ADMITTED:
        waiting = int(run.st[kernel.S_WAIT_TAIL] - run.st[kernel.S_WAIT_HEAD])
        raise RuntimeError(f"{waiting} requests never admitted")


def _fill(report: Report, trace: DenseTrace, run: kernel.Run, records: bool) -> None:
    c = run.counters
    report.requests = int(c[kernel.C_REQUESTS])
    report.prompt_blocks = int(c[kernel.C_PROMPT_BLOCKS])
    report.prompt_tokens = int(c[kernel.C_PROMPT_TOKENS])
    report.gpu_hit_blocks = int(c[kernel.C_GPU_HIT])
    report.host_hit_blocks = int(c[kernel.C_HOST_HIT])
    report.recomputed_tokens = int(c[kernel.C_RECOMPUTED_TOKENS])
    report.host_write_bytes = int(c[kernel.C_HOST_WRITE_BYTES])
    report.host_read_bytes = int(c[kernel.C_HOST_READ_BYTES])
    report.host_declined_blocks = int(c[kernel.C_HOST_DECLINED])
    report.host_evicted_blocks = int(c[kernel.C_HOST_EVICTED])
    report.gpu_evicted_blocks = int(c[kernel.C_GPU_EVICTED])
    if not records:
        return
    prompt_len = np.diff(trace.prompt_off)
    for call in run.admitted[: run.st[kernel.S_ADMITTED]].tolist():
        source = trace.calls[call]
        report.records.append(
            RequestRecord(
                trace.request_id(call),
                source.workflow_id,
                source.agent,
                int(prompt_len[call]),
                int(run.gpu_hit[call]),
                int(run.host_hit[call]),
            )
        )
