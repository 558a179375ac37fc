"""The simulator against the real engine: a recorded vLLM run replayed request by request.

    .venv-vllm/bin/python -m connector.replay --record run.json ...   (the engine, recorded)
    .venv/bin/policyd engine-check run.json [--tolerance 0.02]

``connector.replay --record`` writes every request the engine served (its prompt tokens, the
tokens it generated, the GPU and host hit the connector traced when vLLM allocated its blocks)
and every snapshot the daemon published, with the request before which the connector adopted it.
Here each run is replayed three ways:

* **applied** - the same requests in the same rounds (one fan-out step per round), the same
  capacities and block size, and the *same snapshots* adopted before the same requests: what
  the simulator credits for the decisions the connector applied. Per request the GPU and host
  hits must equal the engine's; the first request that differs is named, with both tiers'
  contents when the record carries them (``agentkv_trace_tiers``), and so is the first
  request after whose allocation the tiers' contents differ (where a difference began: a
  hit often differs only many requests later);
* **predicted** - one stream per workflow at the run's concurrency, the policy deciding live in
  the simulator (its own snapshots, every ``snapshot_interval_s`` of simulated time): the
  simulator's prediction for the run, in hit and recomputed tokens beside the engine's;
* **decided on the rounds** - the engine's rounds as in *applied*, the policy deciding live
  (each workflow ending with its call sent ``workflow_done``): beside *applied*, how the
  simulator's own decisions and the daemon's differ on the same calls in the same order.

With ``--policies`` (names, or variants ``name[param=value,...]``) each of those policies also
decides on its own, as *predicted*, on the record's requests: what another policy, or another
setting of one, would have the simulator credit on the same workload.

Exit status 1 when an applied replay differs from the engine (beyond ``--tolerance`` in total
hit tokens; per request, exactly, when ``--exact``).
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from policyd.core.names import ORACLE_POLICY_NAMES, split_policies
from policyd.core.types import PolicySnapshot
from policyd.policies import make_policy, policy_variant
from policyd.sim.replay import SimConfig, Simulator
from policyd.workloads.calls import Call, Workload


@dataclass(frozen=True, slots=True)
class Capacities:
    block_tokens: int
    gpu_blocks: int
    host_blocks: int
    concurrency: int
    max_pinned_blocks: int
    max_ranked_blocks: int
    step_ops: int

    @classmethod
    def of(cls, rec: dict[str, Any]) -> Capacities:
        return cls(**{k: int(rec[k]) for k in cls.__dataclass_fields__})

    def config(self, concurrency: int, **kw: Any) -> SimConfig:
        return SimConfig(
            concurrency=concurrency,
            gpu_blocks=self.gpu_blocks,
            host_blocks=self.host_blocks,
            block_tokens=self.block_tokens,
            max_pinned_blocks=self.max_pinned_blocks,
            max_ranked_blocks=self.max_ranked_blocks,
            step_ops=self.step_ops,
            record_requests=True,
            **kw,
        )


def call_of(req: dict[str, Any], block_tokens: int, parallel: bool = False) -> Call:
    """A recorded request as the simulator's ``Call``, named by vLLM's own block hashes (as
    the connector sends them, so the snapshots name the same blocks): its prompt's full blocks,
    and the full blocks its generated tokens complete (the simulator caches those whose KV
    vLLM computed: all but the last token's)."""
    prompt: list[int] = req["prompt"]
    generated: list[int] = req.get("generated", [])
    blocks: list[int] = req["block_hashes"]
    full: list[int] = req.get("full_block_hashes", [])
    return Call(
        workflow_id=req["workflow_id"],
        agent=req["agent"],
        block_hashes=tuple(blocks),
        prompt_tokens=len(prompt),
        output_tokens=len(generated),
        workflow_type=req.get("workflow_type", ""),
        output_block_hashes=tuple(full[len(blocks) :]),
        last=bool(req.get("workflow_done", False)),
        parallel=parallel,
    )


def rounds_workload(requests: Sequence[dict[str, Any]], block_tokens: int) -> Workload:
    """The requests as the engine got them: one stream, each round a fan-out step."""
    calls: list[Call] = []
    for i, req in enumerate(requests):
        same_round = i > 0 and requests[i - 1]["round"] == req["round"]
        calls.append(call_of(req, block_tokens, parallel=same_round))
    return Workload(name="engine-rounds", streams=[calls])


def workflows_workload(requests: Sequence[dict[str, Any]], block_tokens: int) -> Workload:
    """The same calls, one stream per workflow in the order they started (a closed loop)."""
    streams: dict[str, list[Call]] = {}
    for req in requests:
        streams.setdefault(req["workflow_id"], []).append(call_of(req, block_tokens))
    return Workload(name="engine-workflows", streams=list(streams.values()))


@dataclass
class RunCheck:
    name: str
    policy: str | None
    requests: int
    prompt_tokens: int
    engine_gpu_tokens: int
    engine_host_tokens: int
    applied_gpu_tokens: int
    applied_host_tokens: int
    predicted_gpu_tokens: int
    predicted_host_tokens: int
    rounds_gpu_tokens: int
    rounds_host_tokens: int
    mismatches: int
    first_mismatch: str = ""
    details: list[str] = field(default_factory=list)
    # the first request after whose allocation the tiers' contents differ (records with
    # tier contents only): often well before the first hit that differs
    first_divergence: str = ""
    divergence_details: list[str] = field(default_factory=list)
    first_mismatch_at: int = -1
    first_divergence_at: int = -1

    @property
    def engine_hit_tokens(self) -> int:
        return self.engine_gpu_tokens + self.engine_host_tokens

    @property
    def applied_hit_tokens(self) -> int:
        return self.applied_gpu_tokens + self.applied_host_tokens

    @property
    def predicted_hit_tokens(self) -> int:
        return self.predicted_gpu_tokens + self.predicted_host_tokens

    @property
    def rounds_hit_tokens(self) -> int:
        return self.rounds_gpu_tokens + self.rounds_host_tokens

    def total_gap(self) -> float:
        """Applied vs engine hit tokens, relative to the engine's."""
        base = max(self.engine_hit_tokens, 1)
        return abs(self.applied_hit_tokens - self.engine_hit_tokens) / base


RUN_KEYS = ("name", "requests", "script")
REQUEST_KEYS = (
    "round",
    "workflow_id",
    "agent",
    "prompt",
    "block_hashes",
    "gpu_tokens",
    "host_tokens",
)


def read_record(path: Path) -> tuple[dict[str, Any], Capacities]:
    """The record ``connector.replay --record`` wrote at ``path``, and its capacities;
    ``ValueError`` naming what is missing when it is not one (``OSError`` when unreadable)."""
    try:
        rec = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not JSON ({exc})") from None
    what = f"{path}: not a record of connector.replay --record"
    if not isinstance(rec, dict) or not isinstance(rec.get("runs"), list):
        raise ValueError(f"{what} (no list of runs)")
    missing = [k for k in Capacities.__dataclass_fields__ if k not in rec]
    if missing:
        raise ValueError(f"{what} (missing {', '.join(missing)})")
    try:
        caps = Capacities.of(rec)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{what} (capacities: {exc})") from None
    for n, run in enumerate(rec["runs"]):
        if not isinstance(run, dict) or any(k not in run for k in RUN_KEYS):
            raise ValueError(f"{what} (run {n} lacks one of {', '.join(RUN_KEYS)})")
        for i, req in enumerate(run["requests"]):
            if not isinstance(req, dict) or any(k not in req for k in REQUEST_KEYS):
                keys = ", ".join(REQUEST_KEYS)
                raise ValueError(f"{what} (run {n}, request {i} lacks one of {keys})")
    return rec, caps


def _snapshots(script: dict[str, Any]) -> dict[int, PolicySnapshot]:
    return {int(k): msgspec.convert(v, PolicySnapshot) for k, v in script.items()}


def check_run(run: dict[str, Any], caps: Capacities) -> RunCheck:
    requests: list[dict[str, Any]] = run["requests"]
    bt = caps.block_tokens
    tier_log: list[dict[str, list[int]]] = []
    sim = Simulator(
        rounds_workload(requests, bt),
        make_policy("lru"),  # bookkeeping only: every decision comes from the script
        caps.config(1),
        script=_snapshots(run["script"]),
    )
    sim.tier_log = tier_log
    applied = sim.run()
    policy = run.get("policy") or "lru"
    predicted = Simulator(
        workflows_workload(requests, bt), make_policy(policy), caps.config(caps.concurrency)
    ).run()
    on_rounds = Simulator(rounds_workload(requests, bt), make_policy(policy), caps.config(1))
    on_rounds.workflow_ends_at_last_call = True
    decided = on_rounds.run()
    out = RunCheck(
        name=run["name"],
        policy=run.get("policy"),
        requests=len(requests),
        prompt_tokens=sum(len(r["prompt"]) for r in requests),
        engine_gpu_tokens=sum(r["gpu_tokens"] for r in requests),
        engine_host_tokens=sum(r["host_tokens"] for r in requests),
        applied_gpu_tokens=applied.gpu_hit_blocks * bt,
        applied_host_tokens=applied.host_hit_blocks * bt,
        predicted_gpu_tokens=predicted.gpu_hit_blocks * bt,
        predicted_host_tokens=predicted.host_hit_blocks * bt,
        rounds_gpu_tokens=decided.gpu_hit_blocks * bt,
        rounds_host_tokens=decided.host_hit_blocks * bt,
        mismatches=0,
    )
    for i, (req, rec) in enumerate(zip(requests, applied.records, strict=True)):
        engine = (req["gpu_tokens"] // bt, req["host_tokens"] // bt)
        ours = (rec.gpu_hit_blocks, rec.host_hit_blocks)
        if engine == ours:
            continue
        out.mismatches += 1
        if out.first_mismatch:
            continue
        out.first_mismatch_at = i
        out.first_mismatch = f"{_describe(i, req)}: engine GPU/host hit {engine}, simulator {ours}"
        out.details = _tier_diff(req, tier_log[i] if i < len(tier_log) else None)
    for i, (req, sim_tiers) in enumerate(zip(requests, tier_log, strict=False)):
        if "gpu_free_order" in req and _tiers_differ(req, sim_tiers):
            out.first_divergence_at = i
            out.first_divergence = _describe(i, req)
            out.divergence_details = _tier_diff(req, sim_tiers)
            break
    return out


def _describe(i: int, req: dict[str, Any]) -> str:
    return (
        f"request {i} (round {req['round']}, {req['workflow_id']}/{req['agent']}, "
        f"{len(req['block_hashes'])} prompt blocks)"
    )


def _tiers_differ(req: dict[str, Any], sim_tiers: dict[str, list[int]]) -> bool:
    """Whether the blocks either tier holds, or the GPU free queue's order, differ."""
    return (
        req["gpu_free_order"] != sim_tiers["gpu_free_order"]
        or set(req["gpu_held"]) != set(sim_tiers["gpu_held"])
        or set(req.get("host", [])) != set(sim_tiers["host"])
    )


def _tier_diff(req: dict[str, Any], sim_tiers: dict[str, list[int]] | None) -> list[str]:
    """Both tiers right after the request was allocated, engine against simulator."""
    if sim_tiers is None or "gpu_free_order" not in req:
        return ["(no tier contents recorded: run the engine with agentkv_trace_tiers)"]
    lines = []
    engine_gpu = set(req["gpu_free_order"]) | set(req["gpu_held"])
    sim_gpu = set(sim_tiers["gpu_free_order"]) | set(sim_tiers["gpu_held"])
    for tier, engine, ours in (
        ("GPU", engine_gpu, sim_gpu),
        ("host", set(req.get("host", [])), set(sim_tiers["host"])),
    ):
        lines.append(
            f"{tier}: engine {len(engine)} blocks, simulator {len(ours)}; only in the engine "
            f"{sorted(engine - ours)[:8]}, only in the simulator {sorted(ours - engine)[:8]}"
        )
    if req["gpu_free_order"] != sim_tiers["gpu_free_order"]:
        lines.append(
            f"GPU free queue (next victim first): engine {req['gpu_free_order'][:8]}..., "
            f"simulator {sim_tiers['gpu_free_order'][:8]}..."
        )
    return lines


def what_if(rec: dict[str, Any], caps: Capacities, labels: Sequence[str]) -> str:
    """Each of ``labels`` deciding on its own in the simulator, one stream per workflow of the
    record's requests at the record's concurrency (as a run's *predicted*): a table of hit
    tokens (GPU + host)."""
    requests: list[dict[str, Any]] = rec["runs"][0]["requests"]  # the same prompts in every run
    workload = workflows_workload(requests, caps.block_tokens)
    lines = [
        "| policy, deciding on its own | simulator hit (GPU + host) |",
        "|---|---|",
    ]
    for label in labels:
        name, params = policy_variant(label)
        report = Simulator(
            workload, make_policy(name, **params), caps.config(caps.concurrency)
        ).run()
        gpu, host = (
            report.gpu_hit_blocks * caps.block_tokens,
            report.host_hit_blocks * caps.block_tokens,
        )
        lines.append(f"| {label} | {gpu + host} ({gpu} + {host}) |")
    return "\n".join(lines)


def table(checks: Sequence[RunCheck]) -> str:
    lines = [
        "| run | requests | prompt tokens | engine hit (GPU + host) | simulator, same decisions "
        "| simulator, its own decisions | its own decisions on these rounds "
        "| requests that differ |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for c in checks:
        lines.append(
            f"| {c.name} | {c.requests} | {c.prompt_tokens} | {c.engine_hit_tokens} "
            f"({c.engine_gpu_tokens} + {c.engine_host_tokens}) | {c.applied_hit_tokens} "
            f"({c.applied_gpu_tokens} + {c.applied_host_tokens}) | {c.predicted_hit_tokens} "
            f"({c.predicted_gpu_tokens} + {c.predicted_host_tokens}) | {c.rounds_hit_tokens} "
            f"({c.rounds_gpu_tokens} + {c.rounds_host_tokens}) | {c.mismatches} |"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="policyd engine-check",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("record", type=Path, help="written by connector.replay --record")
    ap.add_argument("--exact", action="store_true", help="every request must match")
    ap.add_argument("--tolerance", type=float, default=0.02, help="on total hit tokens")
    ap.add_argument("--json", type=Path, help="also write the results here")
    ap.add_argument(
        "--policies",
        type=split_policies,
        default=[],
        help="also simulate these deciding on their own on the record's requests "
        "(comma-separated names or name[param=value,...])",
    )
    args = ap.parse_args(argv)
    rec, caps = read_record(args.record)
    for label in args.policies:  # (refused before any replay runs)
        if policy_variant(label)[0] in ORACLE_POLICY_NAMES:
            raise ValueError(f"{label} is an offline oracle: --policies takes online policies")
    checks = [check_run(run, caps) for run in rec["runs"]]
    print(
        f"simulator vs vLLM engine: {caps.gpu_blocks} GPU blocks, {caps.host_blocks} host "
        f"blocks, {caps.block_tokens}-token blocks, concurrency {caps.concurrency}\n"
    )
    print(table(checks))
    if args.policies:
        print(f"\n{what_if(rec, caps, args.policies)}")
    failed = False
    for c in checks:
        bad = c.mismatches > 0 if args.exact else c.total_gap() > args.tolerance
        failed |= bad
        if c.first_mismatch:
            verdict = "FAIL" if bad else "within tolerance"
            print(f"\n{c.name} ({verdict}): first difference at {c.first_mismatch}")
            for line in c.details:
                print(f"  {line}")
        if c.first_divergence and c.first_divergence_at != c.first_mismatch_at:
            print(f"\n{c.name}: the tiers first differ after {c.first_divergence}")
            for line in c.divergence_details:
                print(f"  {line}")
    if args.json:
        args.json.write_text(json.dumps([c.__dict__ for c in checks], indent=2))
    given = sys.argv[1:] if argv is None else argv  # (the subcommand's own arguments)
    print(f"\ncommand: {shlex.join(['policyd', 'engine-check', *given])}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
