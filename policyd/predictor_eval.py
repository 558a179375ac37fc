"""Prequential evaluation of the next-agent predictor, next to a first-order Markov baseline.

Workflows arrive as they would concurrently: ``concurrency`` of them are active, served
round-robin one call at a time, and a new one starts when one finishes. At every position of
an active workflow (after each of its calls) both models first forecast steps 1..K, then learn
what happened; the forecast made at a position for step k is checked against the label k
transitions later (an agent, or ``END`` for the transition out of the last call). Steps past
the end are not checked; neither is the first call of a workflow (nothing of it was seen yet).
Both models start empty, so the figures over all workflows include the cold start; the second
row of each workload counts only the checks of its second half of workflows.

The baseline counts agent -> next label per workflow type and rolls the transition matrix
forward (``END`` absorbing): the marginal's most likely label at each step. After an agent it
never saw followed, it names the type's most frequent label.

Cost per call is the wall time of ``predict`` (K steps) plus ``observe_call`` /
``observe_finished`` (learning, scoring, drift), the only place the predictor meets a clock. The
machine's speed is printed next to it (a fixed pure-Python loop) so that figures from different
machines can be compared.

Run ``python -m policyd.predictor_eval`` (``--help`` for the knobs).
"""

from __future__ import annotations

import argparse
import dataclasses
import shlex
import statistics
import sys
import time
import timeit
from collections import Counter, deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from policyd.predictor import END, START, Predictor
from policyd.traces.whowhen import whowhen_workload
from policyd.workload import Call, Workload
from policyd.workloads.pbkv import code_writing, fact_checking, financial

WHOWHEN = Path(__file__).resolve().parents[2] / "shared" / "traces" / "who_and_when_captainagent"
GENERATORS: dict[str, Callable[..., Workload]] = {
    "fact-checking": fact_checking,
    "code-writing": code_writing,
    "financial": financial,
}
WORKLOADS = (*GENERATORS, "who-and-when")
PAPER_FACT_CHECKING = ((0.935, 0.848, 0.771), (0.752, 0.555, 0.295))


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
    stream's end right after its last call (``(last call, calls, True)``)."""
    streams = iter(workload.streams)
    active: list[tuple[Sequence[Call], int]] = []
    exhausted = False
    while True:
        while not exhausted and len(active) < concurrency:
            stream = next(streams, None)
            if stream is None:
                exhausted = True
            elif stream:
                active.append((stream, 0))
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
    cost_us: list[float]
    cross_entropy: float
    drifts: int
    nodes_per_forecast: float


def evaluate(
    workload: Workload,
    predictor: Predictor,
    *,
    concurrency: int = 16,
    advance: Callable[[], None] = lambda: None,
) -> Result:
    """Prequential run of ``predictor`` and the Markov baseline over ``workload``."""
    k = predictor.k
    ours, markov = Scorer(k), Scorer(k)
    baseline = MarkovBaseline(k)
    last: dict[str, str] = {}
    ordinal: dict[str, int] = {}  # arrival order of each workflow
    half = len(workload.streams) // 2
    cost_ns: list[int] = []
    clock = time.perf_counter_ns
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
            ours.forecast(wid, pos, [forecast.top(s) for s in range(1, k + 1)])
        ours.truth(wid, pos, label, late)
        markov.truth(wid, pos, label, late)
        baseline.learn(kind, last.get(wid, START), label)
        t0 = clock()
        if ended:
            predictor.observe_finished(wid)
        else:
            predictor.observe_call(wid, kind, label, call.hints, float(pos))
        cost_ns.append(spent + clock() - t0)
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
    )


def load(name: str, workflows: int, seed: int, whowhen: Path) -> Workload:
    """A generated workload (``workflows`` of them, seeded) or the Who&When chats."""
    if name == "who-and-when":
        return whowhen_workload(whowhen)
    if name not in GENERATORS:
        raise ValueError(f"unknown workload {name!r}: choose from {', '.join(WORKLOADS)}")
    return GENERATORS[name](seed=seed, workflows=workflows)


def reference_loop_us() -> float:
    """The machine's speed: one pass of a fixed pure-Python loop, best of 20, in µs."""
    return min(timeit.repeat("sum(range(1000))", number=100, repeat=20)) / 100 * 1e6


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
    for name in ("CE @1", "drifts", "evals/fc", "µs/call mean", "p50", "p99"):
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
                f"{cost[len(cost) // 2]:.0f}" if first else "",
                f"{cost[int(0.99 * (len(cost) - 1))]:.0f}" if first else "",
            )
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m policyd.predictor_eval",
        description="Prequential next-agent prediction accuracy, ours vs first-order Markov.",
    )
    parser.add_argument(
        "--workloads", default=",".join(WORKLOADS), help=f"comma-separated: {', '.join(WORKLOADS)}"
    )
    parser.add_argument("--workflows", type=int, default=1000, help="per generated workload")
    parser.add_argument("--concurrency", type=int, default=16, help="active workflows")
    parser.add_argument("--k", type=int, default=3, help="steps forecast")
    parser.add_argument("--noise", type=float, default=0.0, help="fraction of random forecasts")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--whowhen", type=Path, default=WHOWHEN, help="Who&When chats directory")
    args = parser.parse_args(argv)

    console = Console(width=max(160, Console().width))
    names = [n.strip() for n in args.workloads.split(",") if n.strip()]
    workloads = [load(n, args.workflows, args.seed, args.whowhen) for n in names]
    speed = reference_loop_us()
    results: list[Result] = []
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn())
    with Progress(*columns, TimeElapsedColumn(), console=console, transient=True) as progress:
        total = sum(w.calls + len(w.streams) for w in workloads)
        task = progress.add_task("events", total=total)
        for name, workload in zip(names, workloads, strict=True):
            progress.update(task, description=name)
            predictor = Predictor(k=args.k, noise=args.noise, seed=args.seed)
            result = evaluate(
                workload,
                predictor,
                concurrency=args.concurrency,
                advance=lambda: progress.advance(task),
            )
            results.append(dataclasses.replace(result, name=name))
    console.print(table(results, args.k))
    ours, markov = ("/".join(f"{a:.3f}" for a in accs) for accs in PAPER_FACT_CHECKING)
    console.print(f"paper (PBKV, fact-checking): ours {ours}, Markov {markov}")
    console.print(
        "checked: forecasts checked at step 1; evals/fc: one-step model evaluations per "
        "forecast; µs/call: predict (K steps) + learn, wall clock, on a machine where "
        f"sum(range(1000)) takes {speed:.1f} µs"
    )
    command = ["python", "-m", "policyd.predictor_eval", *(sys.argv[1:] if argv is None else argv)]
    console.print(f"reproduce: {shlex.join(command)}", soft_wrap=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
