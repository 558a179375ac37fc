"""What the connector adds to each vLLM scheduler step, on vLLM's real ``BlockPool``.

    .venv-vllm/bin/python -m connector.bench_step [--blocks 40000] [--steps 6000]

A 40,000-block pool (vLLM 0.32's ``BlockPool``, no engine) and a 65,536-block host tier's order
(``HostOrder``, as the connector's host tier keeps it) run a stream of agent requests:
each scheduler step starts or finishes a request (prefix hits touched, new blocks allocated and
cached, blocks freed tail first), and every ``--snapshot-every`` steps a new snapshot arrives
that names ``--named`` blocks with scores and lists the workflows that finished (one more each
time; a new workflow takes its place). Per step the benchmark
times exactly the connector's share, as it runs at a prefix lookup: ``GpuTier.adopt`` (refresh
the view, adopt a new plan) then ``GpuTier.plan`` (at most ``--step-ops`` operations of it and
of the host order's re-keying, stopped at the connector's deadline, ``--step-deadline-us``; 0:
none). It prints p50 / p99 / max in microseconds for steps with an unchanged view and for all
steps, side by side with the same stream where the snapshot never changes, the work the plan
did and the steps the deadline cut, and checks the budget (p99 <= 200 us).
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from vllm.utils.gc_utils import freeze_gc_heap
from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.kv_cache_utils import make_block_hash_with_group_id

from connector.runtime import ConnectorRuntime
from connector.vllm_adapter import GpuTier
from policyd.core.types import Event, PolicySnapshot, ScoredBlocks
from policyd.tiers.budget import DEFAULT_STEP_DEADLINE_US, STEP_BUDGET_P99_US
from policyd.tiers.gpu import DEFAULT_STEP_OPS, gpu_caps
from policyd.tiers.host_order import HostOrder
from policyd.tiers.view import SnapshotView

TOKENS = 16
GROUP = 0


def digest(block: int) -> bytes:
    return block.to_bytes(8, "big") + bytes(24)


class _Sink:
    def send_many(self, events: Sequence[Event]) -> int:
        return len(events)


def run(
    args: argparse.Namespace, *, snapshots: bool
) -> tuple[dict[str, list[float]], dict[str, int]]:
    """One stream; per-step times (us) of the connector's GPU work, by kind of step, and the
    work done (the plan's operations, the host order's, the steps the deadline cut)."""
    rng = random.Random(args.seed)
    deadline_ns = int(args.step_deadline_us * 1000) if args.step_deadline_us > 0 else None
    pool = BlockPool(num_gpu_blocks=args.blocks + 1, enable_caching=True, hash_block_size=TOKENS)
    freeze_gc_heap()  # as vLLM's engine does once it is initialised
    current: list[SnapshotView | None] = [None]  # as the client's thread indexed it
    previous: list[SnapshotView | None] = [None]
    rt = ConnectorRuntime(_Sink(), lambda: current[0], tokens_per_block=TOKENS)
    host: HostOrder[int] = HostOrder(int)  # the host tier's order, as the manager attaches it
    rt.host_order = host
    pinned, ranked = gpu_caps(args.blocks)
    tier = GpuTier(
        pool,
        [GROUP],
        max_pinned_blocks=pinned,
        max_ranked_blocks=ranked,
        budget_ops=args.step_ops,
        host=host,
    )
    rt.remember = tier.remember  # as the adapter wires it (bookkeeping runs at once here)
    # workflows: a shared system prompt, then each its own growing transcript
    system = list(range(1, 65))
    next_block = iter(range(10_000, 10**9))
    transcripts: dict[str, list[int]] = {}
    active = [f"wf{i}" for i in range(args.workflows)]
    finished: list[str] = []  # the daemon lists workflows that finished, newest last
    next_workflow = iter(range(args.workflows, 10**9))
    running: dict[str, list[Any]] = {}
    known: list[int] = []
    version = 0
    times: dict[str, list[float]] = {
        k: [] for k in ("unchanged", "new snapshot", "unchanged wall", "new snapshot wall")
    }
    for step in range(args.steps):
        if running and (len(running) >= args.running or rng.random() < 0.5):
            rid = rng.choice(list(running))
            pool.free_blocks(reversed(running.pop(rid)))
            rt.request_finished(rid, 8)
        else:
            wf = rng.choice(active)
            transcript = transcripts.setdefault(wf, [])
            transcript.extend(next(next_block) for _ in range(rng.randrange(4, 40)))
            blocks = system + transcript[-args.max_prompt_blocks :]
            hit = 0
            while hit < len(blocks) and tier.cached(blocks[hit]):
                hit += 1
            hits = [tier.cached(b)[0] for b in blocks[:hit]]
            pool.touch(hits)
            n_new = len(blocks) - hit
            if n_new > pool.get_num_free_blocks():
                pool.free_blocks(reversed(hits))
                continue
            new = pool.get_new_blocks(n_new)
            for block, phys in zip(blocks[hit:], new, strict=True):
                if tier.cached(block):
                    continue
                pool._insert_block_hash(
                    make_block_hash_with_group_id(digest(block), GROUP), phys, TOKENS
                )
            rid = f"r{step}"
            digests = [digest(b) for b in blocks]
            rt.request_started(rid, {"workflow_id": wf}, None, digests, len(blocks) * TOKENS)
            running[rid] = hits + new
            known.extend(blocks[hit:])
            for block in blocks[hit:]:  # the host tier stores the new blocks, LRU makes room
                host.insert(block, evictable=True)
            if len(host) > args.host_blocks:
                host.evict(len(host) - args.host_blocks)
        changed = False
        if snapshots and step % args.snapshot_every == 0:
            version += 1
            named = rng.sample(known, k=min(len(known), args.named))
            groups = tuple(
                ScoredBlocks(rng.random() * 4, tuple(named[i : i + 32]))
                for i in range(0, len(named), 32)
            )
            # one workflow finished since the last snapshot; a new one takes its place
            done = active.pop(rng.randrange(len(active)))
            active.append(f"wf{next(next_workflow)}")
            finished = [*finished, done][-args.retired_listed :]
            retired = tuple(finished)
            snap = PolicySnapshot(
                version=version,
                ts=0.0,
                ttl_s=3600.0,
                policy="bench",
                scores=groups,
                retired_workflows=retired,
            )
            # the client's thread indexes it and, like DaemonClient, keeps the one it replaces
            # until the next arrives, so that large indexes are freed off the timed path
            previous[0], current[0] = current[0], SnapshotView.of(snap, max(pinned, ranked))
            changed = True
        # the cyclic collector's pauses depend on every object in the process (vLLM's too), not
        # on the connector's work: it runs outside the timed call
        gc.disable()
        c0, t0 = time.thread_time_ns(), time.perf_counter_ns()
        tier.adopt(rt)
        tier.plan(rt, over=_deadline(t0, deadline_ns))
        c1, t1 = time.thread_time_ns(), time.perf_counter_ns()
        gc.enable()
        tier.close_step()  # one lookup a step here: the worst case, a step that admits
        kind = "new snapshot" if changed else "unchanged"
        times[kind].append((c1 - c0) / 1e3)
        times[kind + " wall"].append((t1 - t0) / 1e3)
    budget = tier.budget
    work = {
        "GPU plan operations": tier.applier.counters.ops,
        "host re-keying operations": budget.host_units,
        "steps the deadline cut": budget.cut_steps,
    }
    return times, work


def _deadline(start_ns: int, deadline_ns: int | None) -> Callable[[], bool] | None:
    """The connector's deadline for a step that started at ``start_ns`` (one hook a step here:
    its wall time so far), or None."""
    if deadline_ns is None:
        return None
    return lambda: time.perf_counter_ns() - start_ns >= deadline_ns


def _row(name: str, xs: list[float]) -> str:
    if not xs:
        return f"| {name} | 0 | - | - | - |"
    q = statistics.quantiles(xs, n=100) if len(xs) > 1 else [xs[0]] * 99
    return f"| {name} | {len(xs)} | {q[49]:.1f} | {q[98]:.1f} | {max(xs):.1f} |"


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--blocks", type=int, default=40_000)
    p.add_argument("--steps", type=int, default=6000)
    p.add_argument(
        "--snapshot-every",
        type=int,
        default=50,
        help="steps between snapshots (1 s at 20 ms a step)",
    )
    p.add_argument("--named", type=int, default=20_000, help="blocks each snapshot scores")
    p.add_argument("--workflows", type=int, default=64, help="active at once")
    p.add_argument(
        "--retired-listed", type=int, default=64, help="finished workflows a snapshot lists"
    )
    p.add_argument("--running", type=int, default=16, help="requests running at once")
    p.add_argument("--host-blocks", type=int, default=65_536, help="the host tier's size")
    p.add_argument("--max-prompt-blocks", type=int, default=1500)
    p.add_argument("--step-ops", type=int, default=DEFAULT_STEP_OPS)
    p.add_argument(
        "--step-deadline-us",
        type=float,
        default=DEFAULT_STEP_DEADLINE_US,
        help="the GPU plan's deadline a step, as the connector applies it (0: none, the "
        "operation budget alone)",
    )
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    still, _ = run(args, snapshots=False)
    live, work = run(args, snapshots=True)
    deadline = f"{args.step_deadline_us:g} us" if args.step_deadline_us > 0 else "none"
    print(f"connector GPU work per scheduler step, vLLM BlockPool of {args.blocks} blocks (us)")
    print(
        f"budget: {args.step_ops} operations a step, deadline {deadline}; over the run: "
        + ", ".join(f"{k} {v}" for k, v in work.items())
    )
    print("CPU: the step thread's CPU time; wall: perf_counter (includes being descheduled)\n")
    print("| steps | n | p50 | p99 | max |\n|---|---|---|---|---|")
    verdicts = []
    for clock, suffix in (("CPU", ""), ("wall", " wall")):
        every = live["unchanged" + suffix] + live["new snapshot" + suffix]
        print(_row(f"{clock}: no snapshot ever (idle)", still["unchanged" + suffix]))
        print(_row(f"{clock}: unchanged view", live["unchanged" + suffix]))
        print(_row(f"{clock}: adopting a new view", live["new snapshot" + suffix]))
        print(_row(f"{clock}: every step", every))
        p99 = statistics.quantiles(every, n=100)[98]
        verdict = "within" if p99 <= STEP_BUDGET_P99_US else "OVER"
        verdicts.append(f"{clock} p99 over every step {p99:.1f} us: {verdict} the budget")
    print(f"\nbudget p99 <= {STEP_BUDGET_P99_US:.0f} us; " + "; ".join(verdicts))
    print(
        f"command: .venv-vllm/bin/python -m connector.bench_step {' '.join(sys.argv[1:])}".rstrip()
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
