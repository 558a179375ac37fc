"""Prequential evaluation of the next-agent predictor, next to a first-order Markov baseline.

Workflows arrive as they would concurrently: ``concurrency`` of them are active, served
round-robin one call at a time (a fan-out's calls in the order they start, by their tool
time), and a new one starts when one finishes. At every position of an active workflow (after
each of its calls) both models first forecast steps 1..K, then learn what happened; the
forecast made at a position for step k is checked against the label k transitions later (an
agent, or ``END`` for the transition out of the last call). Steps past the end are not
checked; neither is the first call of a workflow (nothing of it was seen yet). Both models
start empty, so the figures over all workflows include the cold start; the second row of each
workload counts only the checks of its second half of workflows.

The baseline counts agent -> next label per workflow type and rolls the transition matrix
forward (``END`` absorbing): the marginal's most likely label at each step. After an agent it
never saw followed, it names the type's most frequent label.

Cost per call is the CPU time (this thread's: time the scheduler gives other processes is not
counted) of ``predict`` (K steps) plus ``observe_call`` / ``observe_finished`` (learning,
scoring, drift), the only place the predictor meets a clock. Beside every ``COST_CHUNK`` calls a
fixed pure-Python loop (the reference) is timed the same way; the cost is reported as a ratio to
it (the median over chunks), which holds on a shared, noisy machine where absolute microseconds
do not, and as microseconds at the machine's quietest reference (``--cost``).

Run ``policyd eval-predictor`` (``--help`` for the knobs).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import shlex
import statistics
import sys
import time
import timeit
from collections import Counter, deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from itertools import product
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from policyd.cli.arguments import fraction_list, int_list
from policyd.models.predictor import BUILD, END, START, Predictor
from policyd.traces.location import TRACES_ENV, WHO_AND_WHEN, local_trace, missing_trace_message
from policyd.traces.whowhen import whowhen_workload
from policyd.workloads.calls import Call, Workload, arrival_order
from policyd.workloads.chats import group_chat
from policyd.workloads.pbkv import code_writing, fact_checking, financial


def group_chats(*, seed: int, workflows: int, agents: int = 5) -> Workload:
    """``workflows`` orchestrator-routed group chats among ``agents`` agent names (the
    orchestrator and ``agents - 1`` workers): the predictor's cost against the agents it sees."""
    if agents < 2:
        raise ValueError(f"a group chat needs at least 2 agents, got {agents}")
    return group_chat(seed=seed, chats=workflows, workers=agents - 1)


GENERATORS: dict[str, Callable[..., Workload]] = {
    "fact-checking": fact_checking,
    "code-writing": code_writing,
    "financial": financial,
    "group-chat": group_chats,
}
WORKLOADS = (*GENERATORS, "who-and-when")
PAPER_FACT_CHECKING = ((0.935, 0.848, 0.771), (0.752, 0.555, 0.295))
COST_CHUNK = 64  # calls between two timings of the reference loop
TARGET_US = 100.0  # the budget for predict + learn per call


class MarkovBaseline:
    """First-order transition counts per workflow type, rolled forward for k > 1.

    >>> m = MarkovBaseline(k=2)
    >>> for _ in range(3):
    ...     m.learn("t", START, "a"); m.learn("t", "a", "b"); m.learn("t", "b", END)
    >>> m.predict("t", "a")
    ['b', '<end>']
    """

    def __init__(self, k: int) -> None:
        self.k = k
        self.counts: dict[tuple[str, str], Counter[str]] = {}
        self.unigram: dict[str, Counter[str]] = {}

    def learn(self, kind: str, last: str, label: str) -> None:
        self.counts.setdefault((kind, last), Counter())[label] += 1
        self.unigram.setdefault(kind, Counter())[label] += 1

    def _next(self, kind: str, last: str) -> dict[str, float]:
        if last == END:
            return {END: 1.0}
        counts = self.counts.get((kind, last))
        if not counts:
            fallback = self.unigram.get(kind)
            return {fallback.most_common(1)[0][0]: 1.0} if fallback else {}
        total = sum(counts.values())
        return {label: n / total for label, n in counts.items()}

    def predict(self, kind: str, last: str) -> list[str]:
        """The most likely label at each step 1..k (marginals of the rolled-forward chain)."""
        tops: list[str] = []
        dist = {last: 1.0}
        for _ in range(self.k):
            nxt: dict[str, float] = {}
            for label, p in dist.items():
                for then, q in self._next(kind, label).items():
                    nxt[then] = nxt.get(then, 0.0) + p * q
            dist = nxt
            tops.append(max(dist, key=dist.__getitem__) if dist else END)
        return tops


@dataclass
class Score:
    """Top-1 hits and checks per step (index 0: step 1)."""

    k: int
    hits: list[int] = field(init=False)
    checked: list[int] = field(init=False)

    def __post_init__(self) -> None:
        self.hits = [0] * self.k
        self.checked = [0] * self.k

    def accuracy(self, step: int) -> float:
        n = self.checked[step - 1]
        return self.hits[step - 1] / n if n else float("nan")


class Scorer:
    """Keeps each workflow's recent top-1 forecasts and scores them as labels arrive, overall
    and for the workflows marked ``late``."""

    def __init__(self, k: int) -> None:
        self.k = k
        self.all = Score(k)
        self.late = Score(k)
        self.pending: dict[str, deque[tuple[int, list[str]]]] = {}

    def forecast(self, workflow_id: str, pos: int, tops: list[str]) -> None:
        self.pending.setdefault(workflow_id, deque()).append((pos, tops))

    def truth(self, workflow_id: str, pos: int, label: str, late: bool) -> None:
        """``label`` followed position ``pos`` (calls so far) of the workflow."""
        pending = self.pending.get(workflow_id)
        if not pending:
            return
        scores = (self.all, self.late) if late else (self.all,)
        for made, tops in pending:
            step = pos - made + 1
            for score in scores:
                score.checked[step - 1] += 1
                score.hits[step - 1] += tops[step - 1] == label
        while pending and (label == END or pos - pending[0][0] + 2 > self.k):
            pending.popleft()
        if label == END:
            del self.pending[workflow_id]


Event = tuple[Call, int, bool]  # a call, the calls before it, whether it is the stream's end


def interleave(workload: Workload, concurrency: int) -> Iterator[Event]:
    """The workload's calls in the order ``concurrency`` round-robin workflows issue them, each
    stream's end right after its last call (``(last call, calls, True)``). A fan-out's calls
    come in the order they start (``arrival_order``: by their tool time), as a server sees
    them, not in the order the generator wrote them."""
    streams = map(arrival_order, workload.streams)
    active: list[tuple[Sequence[Call], int]] = []
    exhausted = False
    while True:
        while not exhausted and len(active) < concurrency:
            arriving = next(streams, None)
            if arriving is None:
                exhausted = True
            elif arriving:
                active.append((arriving, 0))
        if not active:
            return
        still: list[tuple[Sequence[Call], int]] = []
        for stream, index in active:
            yield stream[index], index, False
            if index + 1 < len(stream):
                still.append((stream, index + 1))
            else:
                yield stream[index], len(stream), True
        active = still


@dataclass
class Result:
    name: str
    workflows: int
    calls: int
    ours: Scorer
    markov: Scorer
    cost_us: list[float]  # per event: predict + learn, CPU µs
    cross_entropy: float
    drifts: int
    nodes_per_forecast: float
    predict_us: float = 0.0  # mean CPU µs of predict per forecast
    learn_us: float = 0.0  # mean CPU µs of observe_call / observe_finished per event
    views_per_evaluation: float = 0.0  # evaluations that computed a count-model view anew
    reference_us: list[float] = field(default_factory=list)  # the reference loop, per timing
    ratios: list[float] = field(default_factory=list)  # per chunk: µs per event / reference

    def ratio(self) -> float:
        """Cost per event in reference loops (the median over chunks)."""
        return statistics.median(self.ratios) if self.ratios else float("nan")

    def quiet_us(self) -> float:
        """The cost at the machine's quietest reference timing (ratio x min reference)."""
        return self.ratio() * min(self.reference_us) if self.reference_us else float("nan")


def evaluate(
    workload: Workload,
    predictor: Predictor,
    *,
    concurrency: int = 16,
    advance: Callable[[], None] = lambda: None,
    digest: Any = None,
) -> Result:
    """Prequential run of ``predictor`` and the Markov baseline over ``workload``; every
    forecast, exactly (``repr`` of its floats), updates ``digest`` if one is given (a
    ``hashlib`` object), outside the timings."""
    k = predictor.k
    ours, markov = Scorer(k), Scorer(k)
    baseline = MarkovBaseline(k)
    last: dict[str, str] = {}
    ordinal: dict[str, int] = {}  # arrival order of each workflow
    half = len(workload.streams) // 2
    cost_ns: list[int] = []
    predict_ns = learn_ns = forecasts = 0
    references = [reference_loop_us(repeat=5)]
    ratios: list[float] = []
    clock = time.thread_time_ns
    for call, pos, ended in interleave(workload, concurrency):
        wid, kind = call.workflow_id, call.workflow_type
        label = END if ended else call.agent
        late = ordinal.setdefault(wid, len(ordinal)) >= half
        spent = 0
        if pos > 0:  # an active workflow: forecast first
            markov.forecast(wid, pos, baseline.predict(kind, last[wid]))
            t0 = clock()
            forecast = predictor.predict(wid)
            spent = clock() - t0
            predict_ns += spent
            forecasts += 1
            ours.forecast(wid, pos, [forecast.top(s) for s in range(1, k + 1)])
            if digest is not None:
                digest.update(repr((forecast.agents, forecast.alive)).encode())
        ours.truth(wid, pos, label, late)
        markov.truth(wid, pos, label, late)
        baseline.learn(kind, last.get(wid, START), label)
        t0 = clock()
        if ended:
            predictor.observe_finished(wid)
        else:
            predictor.observe_call(wid, kind, label, call.hints, float(pos))
        learnt = clock() - t0
        learn_ns += learnt
        cost_ns.append(spent + learnt)
        if len(cost_ns) % COST_CHUNK == 0:
            references.append(reference_loop_us(repeat=5))
            chunk_us = sum(cost_ns[-COST_CHUNK:]) / COST_CHUNK / 1000
            ratios.append(chunk_us / statistics.fmean(references[-2:]))
        if ended:
            del last[wid]
        else:
            last[wid] = label
        advance()
    stats = predictor.stats()
    return Result(
        workload.name,
        len(workload.streams),
        workload.calls,
        ours,
        markov,
        [ns / 1000 for ns in cost_ns],
        stats["cross_entropy"],
        sum(stats["drifts"].values()),
        stats["nodes_per_forecast"],
        predict_ns / forecasts / 1000 if forecasts else 0.0,
        learn_ns / len(cost_ns) / 1000 if cost_ns else 0.0,
        stats["views_per_evaluation"],
        references,
        ratios,
    )


def load(name: str, workflows: int, seed: int, whowhen: Path | None, agents: int = 5) -> Workload:
    """A generated workload (``workflows`` of them, seeded; ``agents`` names per group chat)
    or the Who&When chats."""
    if name == "who-and-when":
        if whowhen is None:
            raise SystemExit(missing_trace_message("--whowhen", WHO_AND_WHEN))
        return whowhen_workload(whowhen)
    if name not in GENERATORS:
        raise ValueError(f"unknown workload {name!r}: choose from {', '.join(WORKLOADS)}")
    if name == "group-chat":
        return group_chats(seed=seed, workflows=workflows, agents=agents)
    return GENERATORS[name](seed=seed, workflows=workflows)


def reference_loop_us(repeat: int = 20, number: int = 10) -> float:
    """The machine's speed: one pass of a fixed pure-Python loop, best of ``repeat`` timings
    of ``number`` passes, in µs of this thread's CPU time."""
    timings = timeit.repeat(
        "sum(range(1000))", number=number, repeat=repeat, timer=time.thread_time
    )
    return min(timings) / number * 1e6


def table(results: Sequence[Result], k: int) -> Table:
    out = Table(
        title="Next-agent prediction: prequential top-1 accuracy, ours vs first-order Markov"
    )
    out.add_column("workload", no_wrap=True, min_width=16)
    for name in ("workflows", "checked"):
        out.add_column(name, justify="right")
    for who in ("ours", "Markov"):
        for step in range(1, k + 1):
            out.add_column(f"{who} @{step}", justify="right")
    for name in ("CE @1", "drifts", "evals/fc", "µs/call", "x ref"):
        out.add_column(name, justify="right")
    for r in results:
        cost = sorted(r.cost_us)
        for phase, ours, markov in (
            ("all", r.ours.all, r.markov.all),
            ("2nd half", r.ours.late, r.markov.late),
        ):
            first = phase == "all"
            out.add_row(
                r.name if first else f"  {phase}",
                str(r.workflows) if first else "",
                str(ours.checked[0]),
                *(f"{ours.accuracy(s):.3f}" for s in range(1, k + 1)),
                *(f"{markov.accuracy(s):.3f}" for s in range(1, k + 1)),
                f"{r.cross_entropy:.3f}" if first else "",
                str(r.drifts) if first else "",
                f"{r.nodes_per_forecast:.1f}" if first else "",
                f"{statistics.fmean(cost):.0f}" if first else "",
                f"{r.ratio():.1f}" if first else "",
            )
    return out


def cost_table(results: Sequence[Result]) -> Table:
    """What a call costs: CPU µs, and in reference loops timed beside it."""
    out = Table(title="Predictor cost per call (predict + learn), CPU time of this thread")
    out.add_column("workload", no_wrap=True, min_width=16)
    for name in (
        "calls",
        "views anew",
        "predict µs",
        "learn µs",
        "µs/call mean",
        "p50",
        "p99",
        "reference µs min/med",
        "x ref (IQR)",
        f"µs at min ref (target {TARGET_US:.0f})",
    ):
        out.add_column(name, justify="right")
    for r in results:
        cost = sorted(r.cost_us)
        refs = r.reference_us
        q = statistics.quantiles(r.ratios, n=4) if len(r.ratios) >= 2 else [r.ratio()] * 3
        out.add_row(
            r.name,
            str(len(cost)),
            f"{r.views_per_evaluation:.0%}",
            f"{r.predict_us:.0f}",
            f"{r.learn_us:.0f}",
            f"{statistics.fmean(cost):.0f}",
            f"{cost[len(cost) // 2]:.0f}",
            f"{cost[int(0.99 * (len(cost) - 1))]:.0f}",
            f"{min(refs):.1f} / {statistics.median(refs):.1f}",
            f"{r.ratio():.1f} ({q[0]:.1f}-{q[2]:.1f})",
            f"{r.quiet_us():.0f}",
        )
    return out


def predictor_variants(
    beams: Sequence[int] | None,
    refreshes: Sequence[int] | None,
    alias_shares: Sequence[float] | None = None,
    min_branches: Sequence[float] | None = None,
) -> list[tuple[str, dict[str, Any]]]:
    """(label, Predictor options) for every combination of the values given; the label names
    only the options given (empty when nothing is varied). An alias share of 0 is "never".

    >>> predictor_variants(None, [16, 64])
    [('refresh=16', {'refresh': 16}), ('refresh=64', {'refresh': 64})]
    >>> predictor_variants(None, None, [0.5, 0.0])
    [('alias_share=0.5', {'alias_share': 0.5}), ('alias_share=never', {'alias_share': None})]
    >>> predictor_variants([2], None, None, [0.05])
    [('beam=2 min_branch=0.05', {'beam': 2, 'min_branch': 0.05})]
    >>> predictor_variants(None, None)
    [('', {})]
    """
    variants: list[tuple[str, dict[str, Any]]] = []
    unset: list[Any] = [None]
    for beam, refresh, share, floor in product(
        beams or unset, refreshes or unset, alias_shares or unset, min_branches or unset
    ):
        options: dict[str, Any] = {
            key: value
            for key, value in (("beam", beam), ("refresh", refresh), ("min_branch", floor))
            if value is not None
        }
        if share is not None:
            options["alias_share"] = share or None
        label = " ".join(
            f"{key}={'never' if value is None else value}" for key, value in options.items()
        )
        variants.append((label, options))
    return variants


def result_record(r: Result, k: int, digest: str) -> dict[str, Any]:
    """What ``--json`` writes of one result (``experiments.predictor_builds`` reads it)."""
    return {
        "name": r.name,
        "build": BUILD,
        "checked": r.ours.all.checked[0],
        "ours": [r.ours.all.accuracy(s) for s in range(1, k + 1)],
        "markov": [r.markov.all.accuracy(s) for s in range(1, k + 1)],
        "calls": len(r.cost_us),
        "mean_us": statistics.fmean(r.cost_us) if r.cost_us else float("nan"),
        "ratio": r.ratio(),
        "reference_us": r.reference_us,
        "forecasts": digest,
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="policyd eval-predictor",
        description="Prequential next-agent prediction accuracy, ours vs first-order Markov.",
    )
    parser.add_argument(
        "--workloads", default=",".join(WORKLOADS), help=f"comma-separated: {', '.join(WORKLOADS)}"
    )
    parser.add_argument("--workflows", type=int, default=1000, help="per generated workload")
    parser.add_argument(
        "--agents",
        type=int_list(2),
        default=[5],
        help="agent names per group chat (the orchestrator and the workers); a comma-separated "
        "list runs group-chat once per value, side by side",
    )
    parser.add_argument("--concurrency", type=int, default=16, help="active workflows")
    parser.add_argument("--k", type=int, default=3, help="steps forecast")
    parser.add_argument("--noise", type=float, default=0.0, help="fraction of random forecasts")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--whowhen",
        type=Path,
        default=local_trace(WHO_AND_WHEN),
        help=f"Who&When chats directory (default: ${TRACES_ENV}/{WHO_AND_WHEN})",
    )
    parser.add_argument(
        "--refresh",
        type=int_list(1),
        help="the predictor's count-view refresh (learns of a type); a comma-separated list "
        "runs each value on each workload in this one run, side by side (default: the "
        "predictor's own)",
    )
    parser.add_argument(
        "--beam",
        type=int_list(1),
        help="continuations expanded per roll-out step; a list as for --refresh",
    )
    parser.add_argument(
        "--min-branch",
        type=fraction_list(),
        help="least probability of a continuation the roll-out expands; a list as for --refresh",
    )
    parser.add_argument(
        "--alias-share",
        type=fraction_list(),
        help="share of a workflow type's recent workflows bringing a new agent name past which "
        "it is modelled over aliases (0: never); a list as for --refresh",
    )
    parser.add_argument(
        "--cost",
        action="store_true",
        help="also print the cost table: CPU µs per call (predict, learn), the reference loop "
        "timed beside every chunk of calls, the ratio, and µs at the quietest reference",
    )
    parser.add_argument(
        "--json",
        type=Path,
        help="also write every result to this file: accuracy per step, cost, the predictor's "
        "build (compiled or interpreted) and a SHA-256 of every forecast served",
    )
    args = parser.parse_args(argv)

    console = Console(width=max(160, Console().width))
    names: list[str] = []
    workloads: list[Workload] = []
    for name in (n.strip() for n in args.workloads.split(",") if n.strip()):
        for agents in args.agents if name == "group-chat" else [0]:
            names.append(f"{name} agents={agents}" if agents else name)
            workloads.append(load(name, args.workflows, args.seed, args.whowhen, agents))
    results: list[Result] = []
    records: list[dict[str, Any]] = []
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn())
    with Progress(*columns, TimeElapsedColumn(), console=console, transient=True) as progress:
        variants = predictor_variants(args.beam, args.refresh, args.alias_share, args.min_branch)
        total = len(variants) * sum(w.calls + len(w.streams) for w in workloads)
        task = progress.add_task("events", total=total)
        for name, workload in zip(names, workloads, strict=True):
            for variant, options in variants:
                progress.update(task, description=f"{name} {variant}".strip())
                predictor = Predictor(k=args.k, noise=args.noise, seed=args.seed, **options)
                digest = hashlib.sha256() if args.json else None
                result = evaluate(
                    workload,
                    predictor,
                    concurrency=args.concurrency,
                    advance=lambda: progress.advance(task),
                    digest=digest,
                )
                results.append(dataclasses.replace(result, name=f"{name} {variant}".strip()))
                if digest is not None:
                    records.append(result_record(results[-1], args.k, digest.hexdigest()))
    console.print(table(results, args.k))
    speed = min(min(r.reference_us) for r in results)
    ours, markov = ("/".join(f"{a:.3f}" for a in accs) for accs in PAPER_FACT_CHECKING)
    console.print(f"paper (PBKV, fact-checking): ours {ours}, Markov {markov}")
    console.print(
        "checked: forecasts checked at step 1; evals/fc: one-step model evaluations per "
        "forecast; µs/call: predict (K steps) + learn, mean CPU µs; x ref: the same in units "
        f"of a reference loop (sum(range(1000)), {speed:.1f} µs here at its quietest) timed "
        f"beside every {COST_CHUNK} calls, median over chunks"
    )
    if args.cost:
        console.print(cost_table(results))
        console.print(
            "views anew: the one-step evaluations that computed the count experts' view of "
            "their position (new, or refreshed after its type learnt): the costliest part; "
            f"µs at min ref: x ref times the quietest reference timing of the run - the cost on "
            f"this machine without the other jobs' interference (target {TARGET_US:.0f} µs); "
            f"the predictor's build: {BUILD} (make bench-predictor compares both)"
        )
    if args.json:
        args.json.write_text(json.dumps(records, indent=1) + "\n")
    command = ["policyd", "eval-predictor", *(sys.argv[1:] if argv is None else argv)]
    console.print(f"reproduce: {shlex.join(command)}", soft_wrap=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
