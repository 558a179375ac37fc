"""``policyd bench-guard``: what the recency guard costs per event, beside what the engine costs.

The same event stream (a generated workload's calls as the connector reports them: the start,
the prefix hit, the end) goes, in one run, through the guard alone and through the daemon's
engine with agentkv without and with its guard, the engines taking a snapshot every
``--snapshot-every`` events (the guard's learned shadow adopts each). Printed: microseconds per
event and per block reference, and the guard's share of the engine's time. Timings are CPU
time of this thread; compare the ratios (shared machines are noisy), not the absolute figures;
each path's figure is its fastest of three rounds.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence

from policyd.core.engine import Engine
from policyd.core.types import Event, PrefixHit, RequestFinished, RequestStarted
from policyd.policies.agentkv import AgentKV
from policyd.policies.guard import FILTER, LEARNED, RecencyGuard
from policyd.workloads import make_workload


def events_of(workload_name: str, seed: int, max_calls: int) -> tuple[list[Event], int]:
    """The events of the workload's first ``max_calls`` calls (streams interleaved call by
    call), each request hitting the first half of its prompt; and the block references."""
    workload = make_workload(workload_name, seed=seed)
    streams = [list(s) for s in workload.streams]
    events: list[Event] = []
    refs = 0
    n = 0
    depth = 0
    while n < max_calls and any(depth < len(s) for s in streams):
        for s, calls in enumerate(streams):
            if depth >= len(calls) or n >= max_calls:
                continue
            call = calls[depth]
            rid = f"{s}.{depth}"
            blocks = call.block_hashes
            refs += len(blocks)
            half = len(blocks) // 2
            events.append(
                RequestStarted(
                    ts=float(n),
                    request_id=rid,
                    workflow_id=call.workflow_id,
                    agent=call.agent,
                    workflow_type=call.workflow_type,
                    block_hashes=blocks,
                    prompt_tokens=call.prompt_tokens,
                )
            )
            events.append(
                PrefixHit(
                    ts=float(n),
                    request_id=rid,
                    gpu_blocks=half,
                    host_blocks=0,
                    recomputed_blocks=len(blocks) - half,
                )
            )
            events.append(RequestFinished(ts=float(n), request_id=rid, output_tokens=16))
            n += 1
        depth += 1
    return events, refs


def _cpu_s(fn: object, events: Sequence[Event]) -> float:
    t0 = time.thread_time()
    for event in events:
        fn(event)  # type: ignore[operator]
    return time.thread_time() - t0


def _engine_cpu_s(engine: Engine, events: Sequence[Event], snapshot_every: int) -> float:
    """The engine's time on ``events``, a snapshot taken after every ``snapshot_every``."""
    t0 = time.thread_time()
    for i, event in enumerate(events, 1):
        engine.apply_event(event)
        if i % snapshot_every == 0:
            engine.snapshot()
    return time.thread_time() - t0


def measure(
    events: Sequence[Event],
    gpu_blocks: int,
    host_blocks: int,
    snapshot_every: int,
    repeats: int = 3,
) -> dict[str, float]:
    """The fastest of ``repeats`` rounds of each path, the paths alternating within a round
    (a noisy neighbour slows all three alike)."""
    best = {"guard_s": float("inf"), "unguarded_s": float("inf"), "guarded_s": float("inf")}
    rate = 1.0
    for _ in range(repeats):
        guard = RecencyGuard(arms=(FILTER, LEARNED))  # agentkv's arms
        guard.configure(gpu_blocks=gpu_blocks, host_blocks=host_blocks)
        rate = guard.rate
        best["guard_s"] = min(best["guard_s"], _cpu_s(guard.observe, events))
        for name, guarded in (("unguarded", False), ("guarded", True)):
            policy = AgentKV(gpu_blocks=gpu_blocks, host_blocks=host_blocks, guard=guarded)
            engine = Engine(policy)
            spent = _engine_cpu_s(engine, events, snapshot_every)
            best[f"{name}_s"] = min(best[f"{name}_s"], spent)
    return {**best, "rate": rate}


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="policyd bench-guard", description=__doc__)
    p.add_argument("--workload", default="code-writing", help="a generator name")
    p.add_argument("--calls", type=int, default=3000, help="calls to replay (default 3000)")
    p.add_argument("--gpu-blocks", type=int, default=40_000)
    p.add_argument("--host-blocks", type=int, default=160_000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--snapshot-every",
        type=int,
        default=300,
        help="events between the engine's snapshots (default 300: every 100 calls)",
    )
    args = p.parse_args(argv)
    if args.snapshot_every < 1:
        p.error("--snapshot-every must be >= 1")
    events, refs = events_of(args.workload, args.seed, args.calls)
    m = measure(events, args.gpu_blocks, args.host_blocks, args.snapshot_every)
    n = len(events)
    print(
        f"{args.workload}: {n} events, {refs} block references; GPU {args.gpu_blocks} blocks, "
        f"host {args.host_blocks}; shadows' sample rate {m['rate']:.4f}; the engines take a "
        f"snapshot every {args.snapshot_every} events\n"
    )
    print("| path | us / event | ns / block reference |\n|---|---|---|")
    for label, key in (
        ("guard alone (events, no snapshots)", "guard_s"),
        ("engine + agentkv, no guard", "unguarded_s"),
        ("engine + agentkv + guard", "guarded_s"),
    ):
        print(f"| {label} | {m[key] / n * 1e6:.2f} | {m[key] / refs * 1e9:.1f} |")
    print(
        f"\nthe guard alone / the unguarded engine: {m['guard_s'] / m['unguarded_s']:.3f}; "
        f"guarded / unguarded engine: {m['guarded_s'] / m['unguarded_s']:.3f}"
    )
    print(
        f"command: policyd bench-guard --workload {args.workload} --calls {args.calls} "
        f"--gpu-blocks {args.gpu_blocks} --host-blocks {args.host_blocks} --seed {args.seed} "
        f"--snapshot-every {args.snapshot_every}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
