"""EfficientAgent's experiment on the 200 SWE-bench trajectories, in our simulator.

A pool of ``--agents`` concurrent mini-swe-agent tasks (recorded tool gaps, the H200 + Llama-3.1-8B
profile, a GPU tier of ``--gpu-blocks`` that the pool's contexts overflow) is replayed with four
host tiers - none, a small fixed one, the size recommended by the online estimate, a large one -
and, on each, with every host write (``lru``: vLLM's write-all LRU tier), EfficientAgent's
conditioned write filter, its fixed filter, and ``agentkv``. Per run: recomputed prompt tokens,
modelled makespan, host bytes written, blocks declined.

*The recommended tier* is what the daemon would recommend: the ``efficientagent`` policy keeps a
SHARDS estimate fed by every ``RequestStarted`` (``policyd.policies.efficientagent.WorkingSet``);
after the small-tier replay its ``sizing()`` (``policyd.models.mrc.recommend``, ``--coverage`` of
the achievable reuse) gives the size. The large tier is ``--large-factor`` times that.

The paper's claims (EfficientAgent, SWE-bench Verified, Qwen3-Coder-30B-A3B on 8 GPUs): a tier
sized to the working set cuts recomputed prompt tokens 93% and end-to-end time 39% (vs no host
tier); with a small fixed tier the filter cuts recomputation 35% (vs write-all); with a large tier
conditioned admission avoids the 4.3x blow-up of always filtering. They are printed beside ours.

Run ``policyd eval-efficientagent`` (a long run: ``--limit`` for a quicker look).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shlex
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from matplotlib.figure import Figure
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from experiments.mrc_eval import load_swe
from policyd.core.profiles import get_profile
from policyd.policies import make_policy
from policyd.policies.efficientagent import EfficientAgent
from policyd.sim.replay import SimConfig, Simulator
from policyd.sim.report import Report
from policyd.traces.location import SWE_TRAJECTORIES, TRACES_ENV, local_trace, missing_trace_message
from policyd.workloads.calls import Workload


@dataclass(frozen=True, slots=True)
class Variant:
    """A column of the experiment: a policy with its parameters."""

    label: str
    policy: str
    params: tuple[tuple[str, object], ...] = ()


VARIANTS: dict[str, Variant] = {
    v.label: v
    for v in (
        Variant("write-all", "lru"),
        Variant("efficientagent", "efficientagent", (("mode", "conditioned"),)),
        Variant("efficientagent-fixed", "efficientagent", (("mode", "fixed"),)),
        Variant("agentkv", "agentkv"),
        Variant("agentkv-learned", "agentkv", (("guard", False),)),  # without its recency guard
    )
}

# the paper's figures (README of KunmingSHAO/efficientagent_release and the abstract)
PAPER = {
    "sized_recomputed": -0.93,
    "sized_makespan": -0.39,
    "small_filter_recomputed": -0.35,
    "large_fixed_blowup": 4.3,
}


@dataclass(slots=True)
class Row:
    tier: str
    host_blocks: int
    variant: str
    report: Report


def replay(
    workload: Workload,
    variant: Variant,
    config: SimConfig,
    advance: Callable[[int], None],
) -> tuple[Report, Any]:
    policy = make_policy(variant.policy, **dict(variant.params))
    report = Simulator(workload, policy, config).run(advance)
    report.policy = variant.label
    return report, policy


def run(args: argparse.Namespace, console: Console) -> tuple[list[Row], dict[str, Any]]:
    profile = get_profile(args.profile)
    progress = Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        transient=True,
    )
    rows: list[Row] = []
    with progress:
        workload = load_swe(
            args.trace,
            limit=args.limit,
            decode_tokens_per_s=1.0 / profile.decode_s_per_token,
            progress=progress,
        ).reordered(args.seed)
        base = SimConfig(
            concurrency=args.agents,
            gpu_blocks=args.gpu_blocks,
            host_blocks=0,
            profile=args.profile,
            audit_declines=args.audit,
        )
        variants = [VARIANTS[v] for v in args.variants]
        if not any(v.policy == "efficientagent" for v in variants):
            # the recommended and large tiers are sized by efficientagent's online estimate
            raise SystemExit("--variants must include efficientagent (it sizes the tiers)")
        tiers: list[tuple[str, int | None]] = [
            ("none", 0),
            ("small", args.small_host_blocks),
            ("recommended", None),
            ("large", None),
        ]
        total = workload.calls * (2 + 3 * len(variants))
        task = progress.add_task("replaying", total=total)
        sizing = None
        for tier, fixed_host in tiers:
            if fixed_host is None:
                assert sizing is not None
                rec = max(sizing.recommended_host_blocks, sizing.target_blocks)
                host = rec if tier == "recommended" else int(rec * args.large_factor)
            else:
                host = fixed_host
            config = dataclasses.replace(base, host_blocks=host)
            chosen = variants if host else [v for v in variants if v.policy in ("lru", "agentkv")]
            for variant in chosen:
                progress.update(task, description=f"{tier} tier ({host:,} blocks): {variant.label}")
                report, policy = replay(
                    workload, variant, config, lambda n: progress.advance(task, n)
                )
                rows.append(Row(tier, host, variant.label, report))
                if tier == "small" and isinstance(policy, EfficientAgent):
                    sizing = policy.sizing()
        assert sizing is not None  # the small tier ran efficientagent (checked above)
    meta = {
        "workload": workload.description,
        "calls": workload.calls,
        "prompt_tokens": rows[0].report.prompt_tokens,
        "working_set_blocks": sizing.working_set_blocks,
        "recommended_host_blocks": max(sizing.recommended_host_blocks, sizing.target_blocks),
        "closed_form_blocks": sizing.closed_form_blocks,
        "coverage": sizing.coverage,
        "kv_bytes_per_block": profile.kv_bytes_per_block,
    }
    return rows, meta


def _find(rows: Sequence[Row], tier: str, variant: str) -> Report | None:
    for row in rows:
        if row.tier == tier and row.variant == variant:
            return row.report
    return None


def _pct(new: float, old: float) -> str:
    return f"{(new - old) / old:+.1%}" if old else "-"


def results_table(rows: Sequence[Row], meta: dict[str, Any]) -> Table:
    table = Table(title="EfficientAgent experiment (SWE-bench pool)", title_justify="left")
    for column in (
        "host tier",
        "host blk (GiB)",
        "policy",
        "recomputed Mtok",
        "vs no host",
        "makespan s",
        "vs no host",
        "hit GPU",
        "hit host",
        "host W GB",
        "declined blk",
    ):
        table.add_column(column, justify="left" if column in ("host tier", "policy") else "right")
    audited = any(row.report.declined_lost_hits is not None for row in rows)
    if audited:  # --audit: Proposition 1's classes of the declined blocks reused later
        table.add_column("declined, reused while write-all held them", justify="right")
        table.add_column("declined, reused after", justify="right")
    none = _find(rows, "none", "write-all")
    gib = meta["kv_bytes_per_block"] / 1024**3
    for row in rows:
        r = row.report
        table.add_row(
            row.tier,
            f"{row.host_blocks:,} ({row.host_blocks * gib:,.0f})",
            row.variant,
            f"{r.recomputed_tokens / 1e6:,.2f}",
            _pct(r.recomputed_tokens, none.recomputed_tokens) if none else "-",
            f"{r.makespan_s:,.0f}",
            _pct(r.makespan_s, none.makespan_s) if none else "-",
            f"{r.gpu_hit_rate:.3f}",
            f"{r.host_hit_rate:.3f}",
            f"{r.host_write_bytes / 1e9:,.0f}",
            f"{r.host_declined_blocks:,}",
            *((_count(r.declined_lost_hits), _count(r.declined_reused_late)) if audited else ()),
        )
    return table


def _count(n: int | None) -> str:
    return "-" if n is None else f"{n:,}"


def claims(rows: Sequence[Row]) -> list[tuple[str, str, str]]:
    """(claim, paper, ours) for the paper's four headline figures."""
    out: list[tuple[str, str, str]] = []
    none = _find(rows, "none", "write-all")
    sized = _find(rows, "recommended", "write-all")
    if none and sized:
        out.append(
            (
                "sized tier vs no host tier: recomputed tokens",
                f"{PAPER['sized_recomputed']:+.0%}",
                _pct(sized.recomputed_tokens, none.recomputed_tokens),
            )
        )
        out.append(
            (
                "sized tier vs no host tier: end-to-end (makespan)",
                f"{PAPER['sized_makespan']:+.0%}",
                _pct(sized.makespan_s, none.makespan_s),
            )
        )
    small_all, small_ea = _find(rows, "small", "write-all"), _find(rows, "small", "efficientagent")
    if small_all and small_ea:
        out.append(
            (
                "small tier: filter vs write-all, recomputed tokens",
                f"{PAPER['small_filter_recomputed']:+.0%}",
                _pct(small_ea.recomputed_tokens, small_all.recomputed_tokens),
            )
        )
    large_ea, large_fixed = (
        _find(rows, "large", "efficientagent"),
        _find(rows, "large", "efficientagent-fixed"),
    )
    if large_ea and large_fixed:
        ratio = large_fixed.recomputed_tokens / max(large_ea.recomputed_tokens, 1)
        out.append(
            (
                "large tier: fixed / conditioned filter, recomputed tokens",
                f"{PAPER['large_fixed_blowup']:.1f}x",
                f"{ratio:.2f}x",
            )
        )
    for tier in ("none", "small", "recommended", "large"):
        ours = _find(rows, tier, "agentkv")
        others = [
            r.report
            for r in rows
            if r.tier == tier and r.variant in ("write-all", "efficientagent")
        ]
        if ours and others:
            best = min(others, key=lambda r: r.recomputed_tokens)
            out.append(
                (
                    f"{tier} tier: agentkv vs best of write-all/efficientagent ({best.policy}), "
                    "recomputed / makespan",
                    "-",
                    f"{_pct(ours.recomputed_tokens, best.recomputed_tokens)} / "
                    f"{_pct(ours.makespan_s, best.makespan_s)}",
                )
            )
    return out


def claims_table(rows: Sequence[Row]) -> Table:
    table = Table(title="Paper vs ours", title_justify="left")
    for column in ("claim", "EfficientAgent paper", "ours (this run)"):
        table.add_column(column, justify="left" if column == "claim" else "right")
    for claim in claims(rows):
        table.add_row(*claim)
    return table


def plot(rows: Sequence[Row], path: Path, command: str) -> None:
    tiers = list(dict.fromkeys(r.tier for r in rows))
    variants = list(dict.fromkeys(r.variant for r in rows))
    fig = Figure(figsize=(10, 4))
    axes = fig.subplots(1, 2)
    width = 0.8 / len(variants)
    for i, variant in enumerate(variants):
        xs, tok, mk = [], [], []
        for j, tier in enumerate(tiers):
            report = _find(rows, tier, variant)
            if report is not None:
                xs.append(j + i * width)
                tok.append(report.recomputed_tokens / 1e6)
                mk.append(report.makespan_s)
        axes[0].bar(xs, tok, width, label=variant)
        axes[1].bar(xs, mk, width, label=variant)
    for ax, label in zip(
        axes, ("recomputed prompt tokens (M)", "modelled makespan (s)"), strict=True
    ):
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(tiers))], tiers)
        ax.set_ylabel(label)
        ax.set_xlabel("host tier")
        ax.grid(alpha=0.3, axis="y")
    axes[0].legend(fontsize=8)
    fig.suptitle(command, fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="policyd eval-efficientagent",
        description="EfficientAgent's host-tier experiment on the SWE-bench trajectories",
    )
    p.add_argument(
        "--trace",
        type=Path,
        default=local_trace(SWE_TRAJECTORIES),
        help=f"mini-swe-agent trajectories (default: ${TRACES_ENV}/{SWE_TRAJECTORIES})",
    )
    p.add_argument("--limit", type=int, default=None, help="first N trajectories only")
    p.add_argument("--agents", type=int, default=32, help="concurrent agents in the pool")
    p.add_argument(
        "--seed",
        type=int,
        default=0,
        help="order in which the trajectories join the pool: 0 as read, another seed shuffled",
    )
    p.add_argument("--profile", default="h200-llama3.1-8b", help="hardware profile")
    p.add_argument("--gpu-blocks", type=int, default=8192, help="GPU tier, blocks (8,192 = 16 GiB)")
    p.add_argument(
        "--small-host-blocks", type=int, default=16384, help="the small fixed host tier, blocks"
    )
    p.add_argument(
        "--large-factor", type=float, default=4.0, help="large tier = this x the recommended"
    )
    p.add_argument(
        "--variants",
        type=lambda s: [x for x in s.split(",") if x],
        default=list(VARIANTS),
        help=f"comma-separated, of {', '.join(VARIANTS)}",
    )
    p.add_argument("--audit", action="store_true", help="audit declined writes (Proposition 1)")
    p.add_argument("--json", type=Path, help="write every figure here")
    p.add_argument("--plot", type=Path, help="draw recomputed tokens and makespan here")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = _parser().parse_args(argv)
    unknown = [v for v in args.variants if v not in VARIANTS]
    if unknown:
        raise SystemExit(f"unknown variants {unknown}; valid: {', '.join(VARIANTS)}")
    if args.trace is None:
        raise SystemExit(missing_trace_message("--trace", SWE_TRAJECTORIES))
    if not args.trace.exists():
        raise SystemExit(f"no trace at {args.trace}")
    console = Console(stderr=True)
    out = Console()
    command = "policyd eval-efficientagent " + shlex.join(argv)
    started = time.perf_counter()
    rows, meta = run(args, console)
    gib = meta["kv_bytes_per_block"] / 1024**3
    out.print(
        f"{meta['workload']}, {meta['calls']:,} calls, pool of {args.agents} agents, GPU tier "
        f"{args.gpu_blocks:,} blocks ({args.gpu_blocks * gib:.0f} GiB), profile {args.profile}"
    )
    out.print(
        f"online estimate (SHARDS, as the daemon keeps it): {meta['coverage']:.0%} of the "
        f"achievable reuse needs {meta['recommended_host_blocks']:,} blocks "
        f"({meta['recommended_host_blocks'] * gib:,.0f} GiB); working set "
        f"{meta['working_set_blocks']:,} blocks; closed form (A-1) x mean prompt "
        f"{meta['closed_form_blocks']:,.0f} blocks"
    )
    out.print(results_table(rows, meta))
    out.print(claims_table(rows))
    out.print(f"reproduce: {command}  ({time.perf_counter() - started:,.0f} s)")
    if args.json:
        payload = {
            "command": command,
            "meta": meta,
            "rows": [
                {"tier": r.tier, "host_blocks": r.host_blocks, "variant": r.variant}
                | r.report.to_json()
                for r in rows
            ],
            "claims": claims(rows),
        }
        args.json.write_text(json.dumps(payload, indent=2) + "\n", encoding="utf-8")
    if args.plot:
        plot(rows, args.plot, command)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
