"""``agentkv``: ours - three learned rankings judged online (the chosen one orders the GPU tier,
their sum the host tier), and a host-tier write filter that generalises EfficientAgent's.

* Rankings of the live blocks (retired blocks first in all of them: PBKV's lifecycle):
  ``lookahead`` - PBKV's expected discounted calls in the next K steps (``pbkv``);
  ``steps`` - KVFlow's ``1 / steps-to-execution`` on an agent step graph *learned online*
  (``stepgraph``; before a position has been seen followed by anything, the workflow's own
  agents by recency); ``both`` - their sum. Each call's output blocks score as its prompt
  (the agent's next prompt repeats them; PBKV and KVFlow leave them below every live prompt).
* ``steps`` breaks its ties by the lookahead (``steps_ties``): within a class of equal
  ``1 / steps`` (and among the blocks no step reaches) the block the forecast expects more goes
  last; KVFlow breaks them by recency alone. By default only without a host tier, only for
  workflow types whose learned graph has structure (in single-agent pools it stays recency),
  and never while the predictor is degraded.
  Measured without a host tier: code-writing from 1% behind the best baseline to 1.2-1.3%
  ahead at 32 workflows (two sets of ten seeds) and 0.5% at 128; financial unchanged; the
  mixed workload 0.4 points lower, still ahead (docs/RESULTS.md, *steps tie-broken*).
* The referee (``referee``) judges the three on the calls that follow: when an agent is called
  again in a workflow, it records where each ranking kept that agent's private prompt (its
  lowest percentile since the previous call, ties by recency). The snapshot publishes the
  ranking with the best rolling mean; ``steps`` until there is evidence (it is learned from a
  handful of workflows, the predictor's probabilities are not). Why: on a young predictor
  (a short run, a new workflow type) the lookahead ranks worse than the structure, on a
  trained one it ranks better (iterations, survival); measured, not assumed.
* ``referee="virtual"`` (an option; the marks above are the default): one virtual copy of the
  GPU tier per ranking (``virtual``), the referee preferring the copy that hit most. It counts
  each ranking's hits exactly on the calls seen, and still is not better: a ranking also
  changes when calls arrive, which no copy sees (docs/RESULTS.md, *virtual tiers*).
  ``gpu_ranking`` holds one ranking through a run and ``score_outputs=False`` leaves the output
  blocks unscored, for experiments (both measured in docs/RESULTS.md, not better).
* Between snapshots, the blocks a call stores (its output, the new part of its prompt) take
  its prompt's score on the GPU (``inherit_scores``, ``PolicySnapshot.inherit_scores``), not
  the default below every live prompt: a tool call's gap is often shorter than the snapshot
  interval, and a call's output, left at the default, is the first thing a contended GPU
  evicts, though the next call starts with it (on the large host tier of the SWE-bench pool the
  output is the only part of the next prompt the host does not hold).
* Graceful degradation: while the predictor is degraded (too few calls, rolling accuracy below
  ``min_accuracy``) only ``steps`` is published, never worse than recency on an unknown graph.
* Host tier eviction: its own order, published as the snapshot's ``host_scores``: the sum of
  the two rankings (``host_ranking``), retired blocks first, and - while the tier thrashes
  (EfficientAgent's pressure: full, evicting, a working set above it) - a block already in the
  tier raised by ``host_residency_bonus`` (x1.2) over a newcomer of about the same value. Why not
  the GPU's order: a host copy is used only after the GPU dropped the block, and the GPU
  keeps what its order ranks highest, so under the same order the tier mostly duplicates the
  GPU (code-writing, 4,096 host blocks: 113 host hits when the host followed the referee's
  steps ranking, 1,754 under the sum with the bonus). Why the bonus: when more equal-value
  prompts cycle through the tier than it holds (financial's analyst loops), replacing equals
  by equals evicts each copy just before its reuse; a stable set is reused every round. Why
  only then: in a tier that is not thrashing, a stale copy would outrank fresher equals
  (SWE-bench pool, 32 agents, the recommended tier: 24% more recomputed tokens with the bonus
  always on). In a flat type (one agent per workflow: a coding-agent pool) the sum takes the
  workflow's ``pace`` in place of the lookahead, which there is only a survival forecast
  without skill (``host_pace``, ``_paced``; docs/RESULTS.md, *The host tier ordered by pace*).
* Host tier admission, per request on the daemon's synchronous path (``admit``, see its docstring: a
  write into free space, or one that displaces only blocks ranked below the request's own
  prompt, is always made (it cannot cost a hit the tier would otherwise have); a finished
  workflow's private blocks, or a prompt the ranking gives less than ``min_reuse``, are
  declined; the rest follows EfficientAgent's rule with its threshold replaced by Proposition
  1's condition estimated online (expected stack distance below the capacity).
  an API answer, ``POST /api/decide/admit``). The connector and the simulator decide locally
  from the snapshot (no call into the daemon from inside vLLM): EfficientAgent's rule, the
  snapshot's write filter.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable, Mapping, Sequence
from typing import ClassVar, TypeVar

import msgspec

from policyd.core.state import EngineState
from policyd.core.types import (
    BLOCK_SIZE_TOKENS,
    Admit,
    BlocksStored,
    Event,
    PolicySnapshot,
    RequestFinished,
    RequestStarted,
    ScoredBlocks,
    WorkflowFinished,
    WriteFilter,
    score_map,
)
from policyd.models.mrc import Sizing
from policyd.models.predictor import MIN_BRANCH, Predictor
from policyd.models.stepgraph import StepGraph
from policyd.policies.efficientagent import WorkingSet
from policyd.policies.guard import RecencyGuard
from policyd.policies.pbkv import PBKV
from policyd.policies.referee import RankingReferee
from policyd.policies.virtual import VirtualReferee

_K = TypeVar("_K")
Key = tuple[str, str]  # (workflow, agent): one agent's private prompt in one workflow
RANKINGS = ("steps", "lookahead", "both")
REFEREES = ("marks", "virtual")
STEPS_TIES = ("auto", "lookahead", "recency")
TIE_SHARE = 1e-6  # the lookahead's share of a steps score: below any gap between 1/k and 1/(k+1)


class AgentKV(PBKV):
    name: ClassVar[str] = "agentkv"
    description: ClassVar[str] = (
        "ours: referee-chosen ranking on GPU, summed rankings on host + reuse-before-eviction "
        "host write filter"
    )

    def __init__(
        self,
        *,
        k: int = 3,
        discount: float = 0.8,
        min_accuracy: float = 0.3,
        min_observations: int = 20,
        prefetch_min_probability: float = 0.5,
        noise: float = 0.0,
        seed: int = 0,
        predictor: Predictor | None = None,
        min_branch: float = MIN_BRANCH,
        kappa_chunks: int = 8,
        chunk_tokens: int = 1024,
        theta: float = 0.95,
        window_s: float = 60.0,
        coverage: float = 0.9,
        shards_rate: float = 0.1,
        min_reuse: float = 0.05,
        survival: bool = True,
        interval_smoothing: float = 0.5,
        host_blocks: int = 0,
        gpu_blocks: int = 0,
        referee: str = "marks",
        gpu_ranking: str = "referee",
        score_outputs: bool = True,
        steps_ties: str = "auto",
        referee_window: int = 256,
        referee_min_samples: int = 32,
        host_ranking: str = "both",
        host_residency_bonus: float = 0.2,
        host_pace: bool = True,
        inherit_scores: bool = True,
        guard: bool = True,
    ) -> None:
        super().__init__(
            k=k,
            discount=discount,
            min_accuracy=min_accuracy,
            min_observations=min_observations,
            prefetch_min_probability=prefetch_min_probability,
            noise=noise,
            seed=seed,
            predictor=predictor,
            min_branch=min_branch,
        )
        if kappa_chunks < 0:
            raise ValueError(f"kappa_chunks must be >= 0, got {kappa_chunks}")
        if not 0.0 <= theta <= 1.0:
            raise ValueError(f"theta must be in [0, 1], got {theta}")
        if not 0.0 < interval_smoothing <= 1.0:
            raise ValueError(f"interval_smoothing must be in (0, 1], got {interval_smoothing}")
        if host_ranking not in RANKINGS:
            raise ValueError(
                f"unknown host_ranking {host_ranking!r}; valid rankings: {', '.join(RANKINGS)}"
            )
        if gpu_ranking != "referee" and gpu_ranking not in RANKINGS:
            raise ValueError(
                f"unknown gpu_ranking {gpu_ranking!r}; valid: referee, {', '.join(RANKINGS)}"
            )
        if referee not in REFEREES:
            raise ValueError(f"unknown referee {referee!r}; valid referees: {', '.join(REFEREES)}")
        if steps_ties not in STEPS_TIES:
            raise ValueError(f"unknown steps_ties {steps_ties!r}; valid: {', '.join(STEPS_TIES)}")
        if host_residency_bonus < 0.0:
            raise ValueError(f"host_residency_bonus must be >= 0, got {host_residency_bonus}")
        self.host_ranking = host_ranking
        self.host_residency_bonus = host_residency_bonus
        self.host_pace = host_pace  # flat types: the host sums steps and pace, not lookahead
        self.max_new_blocks = kappa_chunks * (chunk_tokens // BLOCK_SIZE_TOKENS)
        self.theta = theta
        self.min_reuse = min_reuse
        self.survival = survival
        self.interval_smoothing = interval_smoothing
        self.working_set = WorkingSet(
            window_s=window_s, coverage=coverage, shards_rate=shards_rate, seed=seed
        )
        self.working_set.configure(gpu_blocks=gpu_blocks, host_blocks=host_blocks)
        # vLLM's default while the learned decisions lose to it (policies/guard.py)
        self.guard = RecencyGuard() if guard else None
        if self.guard is not None:
            self.guard.configure(gpu_blocks=gpu_blocks, host_blocks=host_blocks)
        self.now_ts = 0.0
        self._refs: deque[tuple[float, int]] = deque()  # (ts, prompt blocks) in the window
        self._refs_in_window = 0
        self._last_call_ts: dict[str, float] = {}
        self._interval_s: dict[str, float] = {}  # workflow -> smoothed time between its calls
        self._mean_interval_s = 0.0
        # (workflow, agent) -> (its latest prompt, the blocks that call's output completed):
        # the agent's next prompt in the workflow starts with both
        self._output: dict[tuple[str, str], tuple[tuple[int, ...], tuple[int, ...]]] = {}
        self.graph = StepGraph()
        self.referee_kind = referee
        self.gpu_ranking = gpu_ranking  # "referee": its choice; a ranking's name: that one always
        self.score_outputs = score_outputs  # False: outputs left unscored, as PBKV leaves them
        # blocks stored between snapshots take their request's score on the GPU (with outputs
        # scored): PolicySnapshot.inherit_scores
        self.inherit_scores = inherit_scores
        # within a steps class: "lookahead" first, or "recency" only; "auto": the lookahead
        # without a host tier, recency with one (the host is ordered by the lookahead's sum)
        self.steps_ties = steps_ties
        self.referee = RankingReferee(
            RANKINGS, window=referee_window, min_samples=referee_min_samples
        )
        self.virtual: VirtualReferee | None = None  # with the GPU tier's size (configure_tiers)
        self._referee_window = referee_window
        self._referee_min_samples = referee_min_samples
        self._configure_virtual(gpu_blocks)
        self.ranking = "steps"
        self._host_groups: list[ScoredBlocks] = []  # the host ranking's groups, this snapshot
        self._published: dict[int, float] = {}  # block -> host score in the last snapshot
        self.decisions = {
            "room": 0,
            "value": 0,
            "all": 0,
            "dead": 0,
            "extension": 0,
            "survives": 0,
            "declined": 0,
        }

    def snapshot(
        self, state: EngineState, *, now: float, version: int, ttl_s: float
    ) -> PolicySnapshot:
        """The referee's ranking as ``scores`` (GPU), the host ranking as ``host_scores``
        (resident blocks raised), retired blocks lowest in both, each block said once; plus
        EfficientAgent's rule as the write filter: what a connector that applies snapshots
        only (no per-request ``admit`` call) can enforce on its own."""
        snap = super().snapshot(state, now=now, version=version, ttl_s=ttl_s)
        gpu_scores, _ = _disjoint(snap.scores)
        pressure = self.working_set.pressure(state, now, theta=self.theta, source="shards")
        # resident copies are favoured only while the tier thrashes (EfficientAgent's pressure)
        host_groups = (
            self._resident_first(self._host_groups, state) if pressure else list(self._host_groups)
        )
        retired = self.retired_group(host_groups)
        if retired is not None:
            host_groups.append(retired)
        host_scores, self._published = _disjoint(host_groups)
        write_filter = WriteFilter(
            mode="conditioned", max_new_blocks=self.max_new_blocks, pressure=pressure
        )
        if self._holding_default:
            # computed all the same (the referee and the forecasts keep learning from what
            # they publish), but vLLM's default applies: nothing ranked, retired or declined
            return PolicySnapshot(version=version, ts=now, ttl_s=ttl_s, policy=self.name)
        return msgspec.structs.replace(
            snap,
            scores=gpu_scores,
            host_scores=host_scores,
            write_filter=write_filter,
            inherit_scores=self.inherit_scores and self.score_outputs,
        )

    def _resident_first(
        self, groups: Sequence[ScoredBlocks], state: EngineState
    ) -> list[ScoredBlocks]:
        """``groups`` with their host-resident blocks' scores raised by the factor
        ``1 + host_residency_bonus``: a copy already in the tier keeps its place against a
        newcomer of about the same value (relative: values more than 20% apart keep their order).
        Why: when more prompts of equal value cycle through the tier than it holds, replacing
        equals by equals only churns (each copy is evicted just before its reuse, LRU's
        thrash); a stable set is reused every round - what Belady and a write filter get by
        declining writes. ``snapshot`` applies it only under pressure."""
        bonus = self.host_residency_bonus
        if bonus <= 0.0:
            return list(groups)
        resident = state.resident["host"]
        out: list[ScoredBlocks] = []
        for group in groups:
            kept = tuple(b for b in group.block_hashes if b in resident)
            if not kept or group.score <= 0.0:
                out.append(group)
                continue
            out.append(ScoredBlocks(group.score * (1.0 + bonus), kept))
            rest = tuple(b for b in group.block_hashes if b not in resident)
            if rest:
                out.append(ScoredBlocks(group.score, rest))
        return out

    @property
    def _holding_default(self) -> bool:
        """The guard holds vLLM's default: no ranking, retiring, declining or prefetching."""
        return self.guard is not None and not self.guard.learned

    def configure_tiers(self, *, gpu_blocks: int, host_blocks: int) -> None:
        self.working_set.configure(gpu_blocks=gpu_blocks, host_blocks=host_blocks)
        if self.guard is not None:
            self.guard.configure(gpu_blocks=gpu_blocks, host_blocks=host_blocks)
        self._configure_virtual(gpu_blocks)

    def _configure_virtual(self, gpu_blocks: int) -> None:
        """The virtual tiers need the GPU tier's size; without it the marks referee judges."""
        if self.referee_kind != "virtual" or gpu_blocks <= 0:
            self.virtual = None
        elif self.virtual is None:
            self.virtual = VirtualReferee(
                RANKINGS,
                capacity_blocks=gpu_blocks,
                window=self._referee_window,
                min_samples=self._referee_min_samples,
            )
        else:
            self.virtual.resize(gpu_blocks)

    def sizing(self) -> Sizing:
        return self.working_set.sizing()

    # -- learning ------------------------------------------------------------------------------

    def observe(self, event: Event, state: EngineState) -> None:
        super().observe(event, state)
        self.working_set.observe(event)
        if self.guard is not None:
            self.guard.observe(event)
        self.now_ts = max(self.now_ts, event.ts)
        kind = type(event)
        if kind is RequestStarted:
            assert isinstance(event, RequestStarted)
            wid = event.workflow_id
            self.graph.observe_call(wid, event.workflow_type, event.agent)
            if self.virtual is None:
                self.referee.referenced((wid, event.agent))
            else:
                self.virtual.started(event.request_id, event.block_hashes)
            last = self._last_call_ts.get(wid)
            self._last_call_ts[wid] = event.ts
            if last is not None:
                gap = event.ts - last
                a = self.interval_smoothing
                old = self._interval_s.get(wid)
                self._interval_s[wid] = gap if old is None else a * gap + (1 - a) * old
                self._mean_interval_s = 0.02 * gap + 0.98 * self._mean_interval_s
            self._refs.append((event.ts, len(event.block_hashes)))
            self._refs_in_window += len(event.block_hashes)
        elif kind is BlocksStored:
            assert isinstance(event, BlocksStored)
            req = state.requests.get(event.request_id or "")
            if event.tier == "gpu" and req is not None:
                prompt = set(req.block_hashes)
                out = tuple(b for b in event.block_hashes if b not in prompt)
                if out:
                    self._output[req.workflow_id, req.agent] = (req.block_hashes, out)
                    if self.virtual is not None:
                        self.virtual.stored(req.request_id, out)
        elif kind is RequestFinished:
            assert isinstance(event, RequestFinished)
            if self.virtual is not None:
                self.virtual.finished(event.request_id, event.output_tokens)
        elif kind is WorkflowFinished:
            assert isinstance(event, WorkflowFinished)
            self.graph.observe_finished(event.workflow_id)
            self._last_call_ts.pop(event.workflow_id, None)
            self._interval_s.pop(event.workflow_id, None)
            for key in [k for k in self._output if k[0] == event.workflow_id]:
                del self._output[key]

    def score_groups(self, state: EngineState) -> list[ScoredBlocks]:
        """The ranking the referee prefers - PBKV's lookahead, the learned graph's steps or
        their sum - as groups; every ranking is given to the referee, to be judged on the
        calls that follow (each orders its virtual tier, or is marked where it kept prompts)."""
        steps = self._values(state, lookahead=False)
        ahead = self._values(state, lookahead=True)
        both = (_added(steps[0], ahead[0]), _added(steps[1], ahead[1]))
        paced = self._paced(steps, ahead, state)
        if self._ties_by_lookahead():
            steps = _tie_broken(steps, self._structured(ahead, state))
        rankings = {"steps": steps, "lookahead": ahead, "both": both}
        host = rankings[self.host_ranking] if paced is None else paced
        if self.virtual is not None:
            by_name = {name: self._to_groups(values, state) for name, values in rankings.items()}
            for name, ranked in by_name.items():
                self.virtual.rescore(name, self._tier_scores(ranked))
            self.ranking = self._judged(self.virtual.best())
            self._host_groups = (
                by_name[self.host_ranking] if paced is None else self._to_groups(host, state)
            )
            return by_name[self.ranking]
        self._publish(state, {name: values[0] for name, values in rankings.items()})
        self.ranking = self._judged(self.referee.best())
        groups = self._to_groups(rankings[self.ranking], state)
        self._host_groups = (
            groups
            if paced is None and self.host_ranking == self.ranking
            else self._to_groups(host, state)
        )
        return groups

    def _paced(
        self,
        steps: tuple[dict[Key, float], dict[str, float]],
        ahead: tuple[dict[Key, float], dict[str, float]],
        state: EngineState,
    ) -> tuple[dict[Key, float], dict[str, float]] | None:
        """The host ranking ``both`` with, in flat types (one agent per workflow), the
        workflow's pace in place of its lookahead; None when that changes nothing (no host
        tier, ``host_pace`` off, another host ranking, no flat type live).

        Why: in a flat type the lookahead is only the forecast's survival mass, and the
        forecast of a workflow's end has no skill there (step-1 cross-entropy 0.118 against the
        base rate's 0.116 on the SWE-bench pool, 0.122 / 0.116 against 0.122 / 0.112 on the
        coding pool): it orders the tier by noise. The pace is what sets a host copy's reuse
        distance (EfficientAgent's model: the references that come between, about the pool's
        reference rate times the time until reuse), so the tier keeps the prompts of the
        workflows that call again soonest. The shared prefixes of flat types take ``steps``
        alone: every live call references them, so they stay on the GPU and a host copy of
        them is the least useful (docs/RESULTS.md, *The host tier ordered by pace*)."""
        if not self.host_pace or self.host_ranking != "both" or self.working_set.host_blocks <= 0:
            return None
        workflows = state.workflows
        flat = self._flat_types(steps[0], state)
        if not flat:
            return None
        structured = self._structured(ahead, state)
        private = _added(steps[0], structured[0])
        for key in steps[0]:
            if workflows[key[0]].workflow_type in flat:
                private[key] += self.pace(key[0])
        return private, _added(steps[1], structured[1])

    def pace(self, workflow_id: str) -> float:
        """How soon the workflow calls again, against the pool: ``1 / (1 + its smoothed time
        between calls / the pool's mean)``, in (0, 1); 1/2 for an average or unknown one.

        >>> policy = AgentKV()
        >>> policy._mean_interval_s = 10.0
        >>> policy._interval_s.update({"quick": 5.0, "slow": 30.0})
        >>> policy.pace("quick"), policy.pace("slow"), policy.pace("new")
        (0.6666666666666666, 0.25, 0.5)
        """
        mean = self._mean_interval_s
        if mean <= 0.0:
            return 0.5
        return 1.0 / (1.0 + self._interval_s.get(workflow_id, mean) / mean)

    def _judged(self, best: str) -> str:
        """The GPU ranking: the referee's ``best``, or the one ``gpu_ranking`` holds fixed (an
        experiment: what a ranking does through a whole run, judged all the same)."""
        return best if self.gpu_ranking == "referee" else self.gpu_ranking

    def degraded_groups(self, state: EngineState) -> list[ScoredBlocks]:
        """KVFlow's ``1 / steps`` priority on the learned step graph (the referee judges it
        alone while the predictor is degraded: every virtual tier is ordered by it)."""
        steps = self._values(state, lookahead=False)
        self.ranking = "steps"
        groups = self._host_groups = self._to_groups(steps, state)
        if self.virtual is not None:
            scores = self._tier_scores(groups)
            for name in RANKINGS:
                self.virtual.rescore(name, scores)
        else:
            self._publish(state, {"steps": steps[0], "lookahead": {}, "both": steps[0]})
        return groups

    def _tier_scores(self, groups: list[ScoredBlocks]) -> dict[int, float]:
        """Every block's score as a tier ordered by ``groups`` would have it: the retired
        blocks lowest, as the snapshot publishes them."""
        retired = self.retired_group(groups)
        return score_map(groups if retired is None else [*groups, retired])

    def _publish(self, state: EngineState, rankings: dict[str, dict[Key, float]]) -> None:
        prefixes = state.agent_prefix
        sizes: dict[Hashable, int] = {}
        for wf in state.active_workflows():
            for agent, blocks in wf.agent_blocks.items():
                size = len(blocks) - len(prefixes.get(agent, ()))
                if size > 0:
                    sizes[wf.workflow_id, agent] = size
        self.referee.publish(sizes, rankings)

    def _values(
        self, state: EngineState, *, lookahead: bool
    ) -> tuple[dict[Key, float], dict[str, float]]:
        """Per (workflow, agent) private prompt and per agent's shared prefix, a value.

        Lookahead (PBKV): the agent's expected discounted calls in the workflow's next K steps;
        a shared prefix sums them over active workflows. Steps (KVFlow on the learned graph):
        ``1 / steps-to-execution`` from where the workflow stands; a shared prefix takes the
        nearest workflow's. Agents left out score 0 (below every live prompt)."""
        private: dict[Key, float] = {}
        shared: dict[str, float] = {}
        running: dict[str, set[str]] = {}
        if not lookahead:
            for req in state.requests.values():
                running.setdefault(req.workflow_id, set()).add(req.agent)
        for wf in state.active_workflows():
            wid = wf.workflow_id
            if lookahead:
                forecast = self._forecast(wid)
                if forecast is None:
                    continue
                for agent, mass in self.agent_mass(forecast).items():
                    shared[agent] = shared.get(agent, 0.0) + mass
                    private[wid, agent] = mass
                continue
            here = running.get(wid, set())
            if wf.agents:
                here = here | {wf.agents[-1]}
            for agent, k in self.graph.steps(wf.workflow_type, here, wf.agents).items():
                private[wid, agent] = 1.0 / k
                shared[agent] = max(shared.get(agent, 0.0), 1.0 / k)
        return private, shared

    def _ties_by_lookahead(self) -> bool:
        """Whether the steps ranking breaks its ties by the lookahead (``steps_ties``). With a
        host tier, ``auto`` keeps recency: the host is ordered by the sum of both rankings, and
        a GPU order that ties by recency keeps a different set from it (measured: code-writing
        and the mixed workload with 4,096 host blocks lose 0.3-2 points with the lookahead
        tie-break, docs/RESULTS.md, *steps tie-broken*)."""
        if self.steps_ties == "auto":
            return self.working_set.host_blocks <= 0
        return self.steps_ties == "lookahead"

    def _structured(
        self, ahead: tuple[dict[Key, float], dict[str, float]], state: EngineState
    ) -> tuple[dict[Key, float], dict[str, float]]:
        """The lookahead of the workflows whose type's learned graph has structure (the steps
        ranking's tie-break): in a flat type (single-agent workflows) the steps ranking is
        recency, which stays one of the referee's choices (with a host tier, recency is what
        the coding pool's GPU tier needs: docs/RESULTS.md, *steps tie-broken*)."""
        workflows = state.workflows
        flat = self._flat_types(ahead[0], state)
        if not flat:
            return ahead
        private = {
            key: mass
            for key, mass in ahead[0].items()
            if workflows[key[0]].workflow_type not in flat
        }
        shared: dict[str, float] = {}
        for (_, agent), mass in private.items():
            shared[agent] = shared.get(agent, 0.0) + mass
        return private, shared

    def _flat_types(self, private: Mapping[Key, float], state: EngineState) -> set[str]:
        """The types of the workflows keyed in ``private`` (active ones) whose learned graph
        is flat (``StepGraph.flat``)."""
        workflows = state.workflows
        kinds = {workflows[wid].workflow_type for wid, _ in private}
        return {kind for kind in kinds if self.graph.flat(kind)}

    def _to_groups(
        self, values: tuple[dict[Key, float], dict[str, float]], state: EngineState
    ) -> list[ScoredBlocks]:
        private, shared = values
        prefixes = state.agent_prefix
        workflows = state.workflows
        groups: list[ScoredBlocks] = []
        for (wid, agent), score in private.items():
            wf = workflows.get(wid)
            blocks = None if wf is None else wf.agent_blocks.get(agent)
            if blocks is not None:
                tail = blocks[len(prefixes.get(agent, ())) :]
                if tail:
                    groups.append(ScoredBlocks(score, tail))
        for agent, score in shared.items():
            prefix = prefixes.get(agent)
            if prefix:
                groups.append(ScoredBlocks(score, prefix))
        return self._with_outputs(groups, state) if self.score_outputs else groups

    def _with_outputs(self, groups: list[ScoredBlocks], state: EngineState) -> list[ScoredBlocks]:
        """``groups`` plus each call's output blocks at the score of its prompt's tail."""
        if not self._output:
            return groups
        by_last = {g.block_hashes[-1]: g.score for g in groups}
        extra: list[ScoredBlocks] = []
        for (wid, agent), (prompt, out) in self._output.items():
            wf = state.workflows.get(wid)
            if wf is None or wf.agent_blocks.get(agent) != prompt or not prompt:
                continue
            score = by_last.get(prompt[-1])
            if score is not None:
                extra.append(ScoredBlocks(score, out))
        return groups + extra

    def reference_rate_blocks_per_s(self) -> float:
        """Prompt blocks referenced per second over the window: in an LRU-like tier a block's
        stack distance grows by the distinct blocks written or touched, which under pressure
        is about every prompt block referenced (the other workflows' prompts)."""
        horizon = self.now_ts - self.working_set.window_s
        refs = self._refs
        while refs and refs[0][0] < horizon:
            self._refs_in_window -= refs.popleft()[1]
        return self._refs_in_window / self.working_set.window_s

    def expected_reuse_s(self, workflow_id: str) -> float:
        return self._interval_s.get(workflow_id, self._mean_interval_s)

    # -- admission -----------------------------------------------------------------------------

    def _reuse_value(self, workflow_id: str, agent: str, state: EngineState) -> float | None:
        """The value the host tier's ranking gives ``agent``'s private prompt in the workflow
        now (None: nothing to go by): the lookahead's expected discounted calls in the next K
        steps, ``1 / steps`` on the learned graph (0 when unreachable), or their sum; steps
        alone while the predictor is degraded (what the snapshot publishes then)."""
        wf = state.workflows.get(workflow_id)
        if wf is None:
            return None
        ranking = "steps" if self.degraded else self.host_ranking
        ahead = 0.0
        if ranking == "both" and self.host_pace and self.graph.flat(wf.workflow_type):
            ahead = self.pace(workflow_id)  # the host tier's order there (``_paced``)
        elif ranking != "steps":
            forecast = self._forecast(workflow_id)
            if forecast is None:
                if ranking == "lookahead":
                    return None
            else:
                ahead = self.agent_mass(forecast).get(agent, 0.0)
            if ranking == "lookahead":
                return ahead
        here = {r.agent for r in state.requests.values() if r.workflow_id == workflow_id}
        k = self.graph.steps(wf.workflow_type, here | {agent}, wf.agents).get(agent)
        return ahead + (0.0 if k is None else 1.0 / k)

    def displaced_below(self, value: float, n_blocks: int, state: EngineState) -> bool:
        """Would writing ``n_blocks`` into the host tier evict only blocks ranked below
        ``value``? The tier evicts its lowest-scored blocks first (the published scores,
        unscored blocks at 0), so it is enough that ``n_blocks`` of them score below."""
        if n_blocks <= 0:
            return True
        scores = self._published
        below = 0
        for b in state.resident["host"]:
            if scores.get(b, 0.0) < value:
                below += 1
                if below >= n_blocks:
                    return True
        return False

    def prefetch(self, budget_blocks: int, state: EngineState) -> list[int]:
        """PBKV's conservative prefetch; none while the guard holds vLLM's default."""
        if self._holding_default:
            return []
        return super().prefetch(budget_blocks, state)

    def admit(self, request_id: str, block_hashes: Sequence[int], state: EngineState) -> Admit:
        """Host admission, per request (everything while the guard holds vLLM's default): is
        each written block reused before the tier would evict it, and is it worth more than
        what it displaces? In order:

        1. lifecycle: the workflow finished - only the agent's shared prefix is kept;
        2. room: the tier holds the write without evicting anything - written (it can cost
           no hit: Proposition 1's loss needs an eviction);
        3. value: everything the write would evict ranks below the request's private prompt
           under the host tier's ranking (the tier evicts by the same ``host_scores``) -
           written;
        4. prediction: the ranking gives the prompt less than ``min_reuse`` - declined;
        5. then EfficientAgent's rule generalised: no pressure, a small extension, or an
           expected stack distance below the capacity (it survives until reused) - written;
           otherwise declined."""
        blocks = tuple(block_hashes)
        if self._holding_default:
            return Admit(request_id=request_id, block_hashes=blocks, reason="guard: vLLM's default")
        req = state.requests.get(request_id)
        if req is None:  # unknown request: store everything (vLLM's behaviour)
            return Admit(request_id=request_id, block_hashes=blocks, reason="unknown request")
        wf = state.workflows.get(req.workflow_id)
        shared = set(state.agent_prefix.get(req.agent, ()))
        ws = self.working_set
        if wf is not None and wf.done:
            return self._dead(request_id, blocks, shared, "workflow finished (lifecycle)")
        resident = state.resident["host"]
        new = len(set(blocks).difference(resident))
        overflow = len(resident) + new - ws.host_blocks
        if overflow <= 0:
            self.decisions["room"] += 1
            return Admit(request_id=request_id, block_hashes=blocks, reason="room in the tier")
        value = self._reuse_value(req.workflow_id, req.agent, state)
        if value is not None and self.displaced_below(value, overflow, state):
            self.decisions["value"] += 1
            return Admit(
                request_id=request_id,
                block_hashes=blocks,
                reason=f"displaces only blocks ranked below {value:.2f}",
            )
        if value is not None and value < self.min_reuse:
            return self._dead(request_id, blocks, shared, "no reuse expected (prediction)")
        if not ws.pressure(state, self.now_ts, theta=self.theta, source="shards"):
            self.decisions["all"] += 1
            return Admit(request_id=request_id, block_hashes=blocks, reason="no pressure")
        if len(blocks) <= self.max_new_blocks:
            self.decisions["extension"] += 1
            return Admit(request_id=request_id, block_hashes=blocks, reason="small extension")
        if self.survival:
            distance = self.reference_rate_blocks_per_s() * self.expected_reuse_s(req.workflow_id)
            if distance < ws.host_blocks:
                self.decisions["survives"] += 1
                return Admit(
                    request_id=request_id,
                    block_hashes=blocks,
                    reason=f"expected distance {distance:.0f} < host {ws.host_blocks}",
                )
        self.decisions["declined"] += 1
        return Admit(
            request_id=request_id,
            block_hashes=(),
            declined=blocks,
            reason="refill under pressure, evicted before reuse",
        )

    def _dead(self, request_id: str, blocks: tuple[int, ...], shared: set[int], why: str) -> Admit:
        self.decisions["dead"] += 1
        return Admit(
            request_id=request_id,
            block_hashes=tuple(b for b in blocks if b in shared),
            declined=tuple(b for b in blocks if b not in shared),
            reason=why,
        )


def _disjoint(
    groups: Sequence[ScoredBlocks],
) -> tuple[tuple[ScoredBlocks, ...], dict[int, float]]:
    """``groups`` with each block said once, and every block's score. A block in two groups
    (prompts sharing blocks across workflows, a retired block still in a live agent's prompt)
    takes the later group's score, as a tier applying the groups in order would."""
    scores = score_map(groups)
    if len(scores) == sum(len(g.block_hashes) for g in groups):
        return tuple(groups), scores
    claimed: set[int] = set()
    unique: list[ScoredBlocks] = []
    for group in reversed(groups):
        blocks = tuple(b for b in dict.fromkeys(group.block_hashes) if b not in claimed)
        claimed.update(blocks)
        if blocks:
            unique.append(ScoredBlocks(group.score, blocks))
    return tuple(reversed(unique)), scores


def _tie_broken(
    steps: tuple[dict[Key, float], dict[str, float]],
    ahead: tuple[dict[Key, float], dict[str, float]],
) -> tuple[dict[Key, float], dict[str, float]]:
    """``steps`` with the lookahead as its tie-break: each value raised by the lookahead's,
    scaled to under ``TIE_SHARE``, so the steps classes keep their order and within a class
    (and among the blocks no step reaches, which the lookahead may still expect) the block the
    forecast expects more goes last; recency decides only what both leave equal.

    >>> steps = {("w", "a"): 0.5, ("w", "b"): 0.5, ("w", "d"): 1.0}, {}
    >>> private, shared = _tie_broken(steps, ({("w", "b"): 2.0, ("w", "d"): 0.1}, {"c": 1.0}))
    >>> sorted(private, key=private.__getitem__), 0.0 < shared["c"] < 1e-6
    ([('w', 'a'), ('w', 'b'), ('w', 'd')], True)
    """
    top = max(max(ahead[0].values(), default=0.0), max(ahead[1].values(), default=0.0))
    if top <= 0.0:
        return steps
    scale = TIE_SHARE / (1.0 + top)
    private = _added(steps[0], {key: scale * v for key, v in ahead[0].items()})
    shared = _added(steps[1], {agent: scale * v for agent, v in ahead[1].items()})
    return private, shared


def _added(a: Mapping[_K, float], b: Mapping[_K, float]) -> dict[_K, float]:
    out = dict(a)
    for key, value in b.items():
        out[key] = out.get(key, 0.0) + value
    return out
