"""``policyd throughput``: how fast a what-if replay runs, side by side with two peers.

One trace (Mooncake's when ``$AGENTKV_TRACES`` or ``--trace`` has it, else the seeded synthetic
agent workload), vLLM's 16-token blocks, one process:

* **kvcache-simulator** (C++ backend, its CLI, JSON parsing included): LRU over the same calls'
  block ids (written as its JSONL), at the same capacity. Its cost is the CPU time of the CLI on
  the trace minus its CPU time on one record (start-up, model catalogue, compiler check).
* **libCacheSim** (C, ``process_trace``): plain LRU over the flat stream of the same block ids
  (each call's blocks tail first), read from a text trace - a cache without prefixes, for speed
  only.
* **ours**: the compiled cache model (``policyd.sim.compiled``) - LRU on the GPU tier, LRU with
  a host tier (each preparing the trace's arrays), Belady's cost beside an LRU run (its future
  index and passes, given the LRU run's order and arrays, as every bench pays it); the Python
  ``Simulator`` and agentkv (snapshots every 100 ms of simulated time, which only the Python
  model applies) on the first ``--python-requests`` calls.

Figures are block references per CPU second of this process (``time.process_time``), arrays'
preparation included, numba's one-off compilation not; the trace's loading is shown apart.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import resource
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import libcachesim
from rich.console import Console
from rich.table import Table

from policyd.sim.compiled import warm_up
from policyd.sim.replay import CacheModel, SimConfig, simulate
from policyd.sim.report import Report
from policyd.traces.location import MOONCAKE, local_trace
from policyd.traces.mooncake import mooncake_workload
from policyd.workloads import make_workload
from policyd.workloads.calls import Call, Workload, sequential
from policyd.workloads.synthetic import synthetic_agents

KVCACHE_MODEL = "llama-3.1-8b"  # any catalogue model: only its bytes per block, to set a capacity


@dataclass(frozen=True, slots=True)
class Row:
    simulator: str
    what: str
    refs: int
    cpu_s: float
    hit_rate: float | None = None

    @property
    def refs_per_s(self) -> float:
        return self.refs / self.cpu_s if self.cpu_s > 0 else 0.0


@dataclass(frozen=True, slots=True)
class OracleCost:
    """Belady's whole cost (every pass, given an LRU run's order) beside that LRU run's."""

    workload: str
    concurrency: int
    gpu_blocks: int
    lru_s: float
    belady_s: float
    lru_hit: float
    belady_hit: float
    one_pass_s: float  # Belady's first pass alone
    one_pass_hit: float

    @property
    def ratio(self) -> float:
        return self.belady_s / self.lru_s if self.lru_s > 0 else 0.0

    @property
    def one_pass_ratio(self) -> float:
        return self.one_pass_s / self.lru_s if self.lru_s > 0 else 0.0


@dataclass(slots=True)
class Throughput:
    trace: str
    calls: int
    refs: int
    load_s: float
    gpu_blocks: int
    host_blocks: int
    rows: list[Row] = dataclasses.field(default_factory=list)
    oracle: list[OracleCost] = dataclasses.field(default_factory=list)

    def row(self, simulator: str, what: str) -> Row:
        return next(r for r in self.rows if r.simulator == simulator and r.what == what)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--trace", type=Path, help="a Mooncake JSONL (default: the one in $AGENTKV_TRACES)"
    )
    parser.add_argument("--requests", type=int, default=3000, help="calls replayed (default 3000)")
    parser.add_argument("--gpu-blocks", type=int, default=120_000)
    parser.add_argument("--host-blocks", type=int, default=480_000)
    parser.add_argument("--concurrency", type=int, default=1)
    parser.add_argument(
        "--oracle-concurrency",
        default="1,16",
        help="concurrencies at which Belady's whole cost is set beside an LRU run's (default 1,16)",
    )
    parser.add_argument(
        "--oracle-gpu-blocks",
        help="GPU tiers of that comparison (default: --gpu-blocks), comma-separated",
    )
    parser.add_argument(
        "--oracle-workloads",
        default="",
        help="generated workloads (closed loops) compared too, at the largest concurrency given, "
        "GPU tiers of 2x and 4x their largest request; comma-separated (default: none)",
    )
    parser.add_argument(
        "--python-requests",
        type=int,
        default=300,
        help="calls the Python model and agentkv replay (they are slow; default 300)",
    )
    parser.add_argument("--seed", type=int, default=0, help="the synthetic workload's seed")


def load(trace: Path | None, requests: int, seed: int) -> tuple[Workload, float]:
    """The trace's first ``requests`` calls, one per stream, and the seconds loading took."""
    started = time.process_time()
    path = trace or local_trace(MOONCAKE)
    if path is not None and path.exists():
        workload = mooncake_workload(path, limit=requests)
    else:
        calls = [c for s in synthetic_agents(seed=seed, workflows=requests) for c in s][:requests]
        workload = sequential(calls, name=f"synthetic-seed{seed}")
    return workload, time.process_time() - started


def measure(args: argparse.Namespace, progress: Callable[[str], None]) -> Throughput:
    workload, load_s = load(args.trace, args.requests, args.seed)
    calls = [c for s in workload for c in s]
    refs = sum(len(c.block_hashes) for c in calls)
    out = Throughput(workload.name, len(calls), refs, load_s, args.gpu_blocks, args.host_blocks)
    progress("kvcache-simulator")
    out.rows.append(kvcache_simulator_lru(calls, args.gpu_blocks))
    progress("libCacheSim")
    out.rows.append(libcachesim_lru(calls, args.gpu_blocks))
    warm_up()
    gpu = SimConfig(concurrency=args.concurrency, gpu_blocks=args.gpu_blocks, host_blocks=0)
    host = dataclasses.replace(gpu, host_blocks=args.host_blocks)
    progress("ours, compiled")
    recording = dataclasses.replace(gpu, record_requests=True)
    row, lru = _ours("compiled", "lru, GPU", workload, "lru", recording)
    out.rows.append(row)
    again = dataclasses.replace(workload)  # a new object: its arrays are prepared again
    out.rows.append(_ours("compiled", "lru, GPU + host", again, "lru", host)[0])
    belady = "belady, GPU (its extra cost)"
    out.rows.append(_ours("compiled", belady, workload, "belady", gpu, lru_report=lru)[0])
    concurrencies = [int(c) for c in args.oracle_concurrency.split(",") if c]
    sizes = [int(g) for g in (args.oracle_gpu_blocks or str(args.gpu_blocks)).split(",") if g]
    for concurrency in concurrencies:
        for gpu_blocks in sizes:
            progress(f"the oracle beside LRU, concurrency {concurrency}, {gpu_blocks:,} blocks")
            out.oracle.append(oracle_cost(workload, concurrency, gpu_blocks))
    for name in (n for n in args.oracle_workloads.split(",") if n):
        generated = make_workload(name, seed=args.seed)
        largest = max(len(c.block_hashes) for stream in generated for c in stream)
        for gpu_blocks in (2 * largest, 4 * largest):
            progress(f"the oracle beside LRU, {name}, {gpu_blocks:,} blocks")
            out.oracle.append(oracle_cost(generated, max(concurrencies), gpu_blocks))
    head = sequential(calls[: args.python_requests], name=f"{workload.name}-head")
    first = f"first {len(head.streams)} calls"
    progress("ours, Python")
    out.rows.append(_ours("python", f"lru, GPU, {first}", head, "lru", gpu)[0])
    every_100ms = dataclasses.replace(host, snapshot_interval_s=0.1)
    agentkv = f"agentkv, GPU + host, {first}"
    out.rows.append(_ours("python", agentkv, head, "agentkv", every_100ms)[0])
    progress("ours, compiled, the same calls")
    out.rows.append(_ours("compiled", f"lru, GPU, {first}", head, "lru", gpu)[0])
    return out


def oracle_cost(workload: Workload, concurrency: int, gpu_blocks: int) -> OracleCost:
    """An LRU replay recording its order, then Belady given it, on the compiled model."""
    config = SimConfig(
        concurrency=concurrency, gpu_blocks=gpu_blocks, host_blocks=0, record_requests=True
    )
    simulate(workload, "lru", config, model="compiled")  # the trace's arrays, prepared once
    started = time.process_time()
    lru = simulate(workload, "lru", config, model="compiled")
    lru_s = time.process_time() - started
    started = time.process_time()
    oracle = simulate(workload, "belady", config, lru_report=lru, model="compiled")
    belady_s = time.process_time() - started
    started = time.process_time()
    first = simulate(workload, "belady", config, lru_report=lru, belady_passes=1, model="compiled")
    one_pass_s = time.process_time() - started
    return OracleCost(
        workload.name,
        concurrency,
        gpu_blocks,
        lru_s,
        belady_s,
        lru.hit_rate,
        oracle.hit_rate,
        one_pass_s,
        first.hit_rate,
    )


def _ours(
    model: CacheModel,
    what: str,
    workload: Workload,
    policy: str,
    config: SimConfig,
    *,
    lru_report: Report | None = None,
) -> tuple[Row, Report]:
    """``simulate`` on ``model``, timed in CPU seconds of this process."""
    started = time.process_time()
    report = simulate(workload, policy, config, lru_report=lru_report, model=model)
    cpu_s = time.process_time() - started
    name = "ours, compiled" if model == "compiled" else "ours, Python"
    return Row(name, what, report.prompt_blocks, cpu_s, report.hit_rate), report


# ---- the peers ---------------------------------------------------------------------------------


def _child_cpu_s(command: Sequence[str]) -> tuple[float, str]:
    """CPU seconds (user + system) of ``command`` as a child process, and its stdout."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    done = subprocess.run(command, check=True, capture_output=True, text=True)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    spent = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return spent, done.stdout


def kvcache_simulator_lru(calls: Sequence[Call], capacity_blocks: int) -> Row:
    """kvcache-simulator's CLI (C++ backend) on the calls' prompt blocks, LRU at
    ``capacity_blocks`` (its budget in GiB chosen to give exactly that many blocks)."""
    cli = str(Path(sys.executable).with_name("kvcache-simulator"))
    backend = "cpp" if shutil.which("c++") else "python"  # its C++ core needs a compiler
    with tempfile.TemporaryDirectory() as folder:
        trace = Path(folder) / "trace.jsonl"
        with trace.open("w") as out:
            for c in calls:
                record = {
                    "hash_ids": list(c.block_hashes),
                    "input_length": 16 * len(c.block_hashes),
                    "block_size": 16,
                }
                out.write(json.dumps(record) + "\n")
        base = [cli, "run", "--trace", str(trace), "--model", KVCACHE_MODEL, "--block-size", "16"]
        base += ["--policies", "lru", "--backend", backend, "--no-progress", "--format", "json"]
        gib = (capacity_blocks + 0.5) * _bytes_per_block(base) / 2**30
        budget = ["--budgets-gib", f"{gib:.12f}", "--output", "-"]
        one_s, _ = _child_cpu_s([*base, *budget, "--max-records", "1"])
        all_s, stdout = _child_cpu_s([*base, *budget])
    answer = json.loads(stdout)
    if not answer["points"]:  # it omits a capacity the trace never fills
        distinct = answer["metadata"]["uniqueBlocks"]
        raise SystemExit(f"the trace has {distinct:,} distinct blocks: give fewer --gpu-blocks")
    point = answer["points"][0]
    if point["cacheBlocks"] != capacity_blocks:
        raise RuntimeError(f"kvcache-simulator ran {point['cacheBlocks']} blocks")
    result = point["results"]["lru"]
    refs = sum(len(c.block_hashes) for c in calls)
    hit = result.get("hitRate")
    name = "kvcache-simulator (C++)" if backend == "cpp" else "kvcache-simulator (Python)"
    return Row(name, "lru, one tier", refs, all_s - one_s, hit)


def _bytes_per_block(base: list[str]) -> float:
    _, stdout = _child_cpu_s([*base, "--budgets-gib", "1", "--output", "-", "--max-records", "1"])
    return float(json.loads(stdout)["metadata"]["bytesPerBlock"])


def libcachesim_lru(calls: Sequence[Call], capacity_blocks: int) -> Row:
    """libCacheSim's LRU (``process_trace``, in C) over the calls' blocks, tail first."""
    ids: dict[int, int] = {}
    with tempfile.TemporaryDirectory() as folder:
        trace = Path(folder) / "trace.txt"
        with trace.open("w") as out:
            for c in calls:
                out.writelines(
                    f"{ids.setdefault(b, len(ids) + 1)}\n" for b in reversed(c.block_hashes)
                )
        reader = libcachesim.TraceReader(str(trace), libcachesim.TraceType.PLAIN_TXT_TRACE)
        cache = libcachesim.LRU(cache_size=capacity_blocks)
        started = time.process_time()
        miss_ratio, _ = cache.process_trace(reader)
        cpu_s = time.process_time() - started
    refs = sum(len(c.block_hashes) for c in calls)
    return Row("libCacheSim (C)", "lru, flat block stream", refs, cpu_s, 1.0 - miss_ratio)


# ---- the table ---------------------------------------------------------------------------------


def render(result: Throughput) -> Table:
    peer = result.rows[0]  # kvcache-simulator
    lru = result.row("ours, compiled", "lru, GPU")
    table = Table(
        title=f"what-if replay speed on {result.trace}: {result.calls:,} calls, "
        f"{result.refs:,} block references (16-token blocks), GPU {result.gpu_blocks:,} blocks, "
        f"host {result.host_blocks:,}; loading the trace took {result.load_s:.2f} s",
        title_justify="left",
    )
    for column in ("simulator", "replay", "block refs", "CPU s", "refs/s", "hit rate"):
        table.add_column(column, justify="right")
    table.add_column("x kvcache-simulator", justify="right")
    table.add_column("x our compiled lru", justify="right")
    for row in result.rows:
        table.add_row(
            row.simulator,
            row.what,
            f"{row.refs:,}",
            f"{row.cpu_s:.3f}",
            f"{row.refs_per_s:,.0f}",
            "" if row.hit_rate is None else f"{row.hit_rate:.4f}",
            f"{row.refs_per_s / peer.refs_per_s:.2f}x" if peer.refs_per_s else "",
            f"{row.refs_per_s / lru.refs_per_s:.3f}x" if lru.refs_per_s else "",
        )
    return table


def render_oracle(result: Throughput) -> Table:
    table = Table(
        title="the oracle's cost beside an LRU run (GPU tier; Belady given the LRU run's "
        "order, every pass until its order is a fixed point; target: at most 2x)",
        title_justify="left",
    )
    columns = ("workload", "C", "GPU blocks", "lru hit", "belady hit", "lru CPU s", "belady CPU s")
    for column in (*columns, "belady / lru", "its first pass: hit", "CPU s", "/ lru"):
        table.add_column(column, justify="right")
    for o in result.oracle:
        table.add_row(
            o.workload,
            str(o.concurrency),
            f"{o.gpu_blocks:,}",
            f"{o.lru_hit:.3f}",
            f"{o.belady_hit:.3f}",
            f"{o.lru_s:.3f}",
            f"{o.belady_s:.3f}",
            f"{o.ratio:.2f}x",
            f"{o.one_pass_hit:.3f}",
            f"{o.one_pass_s:.3f}",
            f"{o.one_pass_ratio:.2f}x",
        )
    return table


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="policyd throughput", description=__doc__.split("\n")[0])
    add_arguments(parser)
    parser.add_argument("--json", type=Path, help="also write the rows here")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    result = measure(args, lambda what: print(f"measuring {what} ...", file=sys.stderr, flush=True))
    console = Console() if sys.stdout.isatty() else Console(width=220)
    console.print(render(result))
    if result.oracle:
        console.print(render_oracle(result))
    command = shlex.join(["policyd", "throughput", *argv])
    console.print(f"reproduce: {command}", highlight=False)
    if args.json:
        rows = [{**dataclasses.asdict(r), "refs_per_s": r.refs_per_s} for r in result.rows]
        payload = {**dataclasses.asdict(result), "rows": rows, "command": command}
        payload["oracle"] = [dataclasses.asdict(o) for o in result.oracle]
        args.json.write_text(json.dumps(payload, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
