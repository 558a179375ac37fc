"""End-to-end replay: the real vLLM engine (CPU) + ``policyd serve`` + a small agent workload.

    .venv-vllm/bin/python -m connector.replay [--workflows 8] [--concurrency 4] [--seed 0]

Multi-agent workflows (planner -> searcher -> verifier, the verifier sending work back to the
searcher with probability ``--retry``, then a writer) run ``--concurrency`` at a time against a
tiny local Llama whose GPU pool is small. Every call carries ``kv_transfer_params`` (workflow,
agent, type, ``workflow_done`` on the last call). An agent's prompt is its system prompt, the
workflow's task and the workflow's transcript so far, so an agent called again reuses its own
earlier prompt - after the other agents' calls may have evicted it.

The same workload runs once per ``--runs`` entry: ``gpu-only`` (vLLM without a connector: GPU
prefix cache only), ``vllm-default`` (AgentKVConnector with no daemon: the host tier with vLLM's
LRU and store-everything) and a policy name (``agentkv``, ``pbkv``, ...: the connector talking
to ``policyd serve --policy NAME``). It prints hit and recomputed prompt tokens per run as a
table and checks that every run generated the same tokens. ``policyd serve`` runs from the main
venv (``--policyd``, default ``.venv/bin/policyd``).

Requests go in rounds: each round sends one call of every active workflow as one batch. Between
rounds the daemon publishes a snapshot once it has taken in every event of the round
(``POST /api/snapshot/publish``; its timer is set to an hour), so the connector adopts it when the
next round's first request is looked up: the decisions are a function of the requests, not of
thread timing. ``--record PATH`` writes every request (prompt, generated tokens, the GPU and host
hit the connector traced at allocation) and every snapshot with the request it preceded, for
``policyd engine-check PATH`` (main venv) to replay through the simulator. A recorded run is
deterministic: the same requests give the same hits, request by request (``DETERMINISTIC_ENV``
says what it takes), so two runs' hits differ only by what their policies did.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from connector.tiny_model import build_tiny_llama
from policyd.core.profiles import get_profile
from policyd.tiers.budget import DEFAULT_STEP_DEADLINE_US, STEP_BUDGET_P99_US
from policyd.tiers.gpu import DEFAULT_STEP_OPS, gpu_caps

ROOT: Final = Path(__file__).resolve().parents[1]
BLOCK_TOKENS: Final = 32
KV_BYTES_PER_BLOCK: Final = 2 * 2 * BLOCK_TOKENS * 64 * 4  # tiny Llama, fp32
MAX_MODEL_LEN: Final = 1024
SYSTEM_TOKENS: Final = 96
TASK_TOKENS: Final = 128
TOOL_TOKENS: Final = 48
OUTPUT_TOKENS: Final = 8
AGENTS: Final = ("planner", "searcher", "verifier", "writer")
DAEMON_PROFILE: Final = "h200-llama3.1-8b"  # the daemon's bytes per block (sizing only)
ON_DEMAND_S: Final = 3600.0  # the daemon's timer and TTL: snapshots come between rounds
RECEIVE_S: Final = 0.5  # time for the connector's client to receive a published snapshot


@dataclass
class GeneratedFlow:
    """A generated research workflow, closed loop: each prompt is the agent's system prompt,
    the task and the transcript so far (every earlier output and tool answer)."""

    workflow_id: str
    system: dict[str, list[int]]
    task: list[int]
    rng: random.Random
    retry: float
    vocab: int
    workflow_type: str = "research"
    transcript: list[int] = field(default_factory=list)
    agent: str | None = "planner"
    calls: int = 0

    def next_agent(self, agent: str) -> str | None:
        if agent == "planner":
            return "searcher"
        if agent == "searcher":
            return "verifier"
        if agent == "verifier":
            return "searcher" if self.rng.random() < self.retry and self.calls < 8 else "writer"
        return None

    def next_call(self) -> tuple[str, list[int], bool]:
        """(agent, prompt, last call of the workflow)."""
        assert self.agent is not None
        agent = self.agent
        tokens = self.system[agent] + self.task + self.transcript
        nxt = self.next_agent(agent)
        done = nxt is None or len(tokens) + TOOL_TOKENS + 2 * OUTPUT_TOKENS >= MAX_MODEL_LEN
        self.agent = None if done else nxt
        return agent, tokens, done

    def took(self, generated: Sequence[int]) -> None:
        self.transcript += list(generated) + _tokens(self.rng, TOOL_TOKENS, self.vocab)
        self.calls += 1

    @property
    def finished(self) -> bool:
        return self.agent is None


@dataclass
class TraceFlow:
    """A workflow of a real trace: fixed prompts (``policyd.traces.engine_prompts``), open loop
    (what the engine generates is not fed back: the trace's next prompt already holds it)."""

    workflow_id: str
    workflow_type: str
    calls: list[tuple[str, list[int]]]
    index: int = 0

    def next_call(self) -> tuple[str, list[int], bool]:
        agent, prompt = self.calls[self.index]
        self.index += 1
        return agent, prompt, self.index == len(self.calls)

    def took(self, generated: Sequence[int]) -> None:
        pass

    @property
    def finished(self) -> bool:
        return self.index >= len(self.calls)


Flow = GeneratedFlow | TraceFlow


def generated_flows(n_workflows: int, seed: int, retry: float, vocab: int = 1000) -> list[Flow]:
    rng = random.Random(seed)
    systems = {agent: _tokens(rng, SYSTEM_TOKENS, vocab) for agent in AGENTS}
    return [
        GeneratedFlow(
            f"wf{i}",
            systems,
            _tokens(rng, TASK_TOKENS, vocab),
            random.Random(seed * 1000 + i),
            retry,
            vocab,
        )
        for i in range(n_workflows)
    ]


def trace_flows(path: Path) -> list[Flow]:
    data = json.loads(path.read_text())
    return [
        TraceFlow(
            w["workflow_id"],
            w.get("workflow_type", ""),
            [(c["agent"], list(c["prompt"])) for c in w["calls"]],
        )
        for w in data["workflows"]
        if w["calls"]
    ]


@dataclass
class Run:
    name: str
    prompt_tokens: int = 0
    hit_tokens: int = 0
    output_tokens: int = 0
    requests: int = 0
    wall_s: float = 0.0
    outputs: list[tuple[int, ...]] = field(default_factory=list)
    daemon: dict[str, Any] = field(default_factory=dict)
    policy: str | None = None
    calls: list[dict[str, Any]] = field(default_factory=list)  # what was sent, in order
    script: dict[int, dict[str, Any]] = field(default_factory=dict)  # request index -> snapshot
    trace: list[dict[str, Any]] = field(default_factory=list)  # the connector's, per request
    step_us: list[float] = field(default_factory=list)  # AgentKV's time per scheduler step
    step_cpu_us: list[float] = field(default_factory=list)  # the same, its thread's CPU time
    hook_cpu_us: dict[str, float] = field(default_factory=dict)  # that CPU time, by hook
    hook_calls: dict[str, int] = field(default_factory=dict)
    queued_hooks: dict[str, int] = field(default_factory=dict)  # run inside the next timed call
    deferred_cpu_us: float = 0.0  # the bookkeeping moved off vLLM's thread: its thread's CPU
    deferred_jobs: int = 0
    worst_steps: list[dict[str, Any]] = field(default_factory=list)  # costliest, by hook
    plan: dict[str, Any] = field(default_factory=dict)  # the GPU plan's ops, deadline cuts

    @property
    def recomputed_tokens(self) -> int:
        return self.prompt_tokens - self.hit_tokens


def _tokens(rng: random.Random, n: int, vocab: int = 1000) -> list[int]:
    return [rng.randrange(3, 3 + vocab) for _ in range(n)]


Generate = Callable[[list[list[int]], list[dict[str, Any]], int], list[tuple[tuple[int, ...], int]]]
"""(prompt token ids, kv_transfer_params per request, tokens to generate) -> (generated ids,
cached prompt tokens) per request."""


def llm_generate(llm: Any) -> Generate:
    """Requests through an in-process ``vllm.LLM``, one batch per round."""
    from vllm import SamplingParams  # noqa: PLC0415 - vLLM only in .venv-vllm

    def generate(
        prompts: list[list[int]], kv: list[dict[str, Any]], max_tokens: int
    ) -> list[tuple[tuple[int, ...], int]]:
        params = [
            SamplingParams(
                temperature=0.0,
                max_tokens=max_tokens,
                ignore_eos=True,
                extra_args={"kv_transfer_params": p},
            )
            for p in kv
        ]
        outs = llm.generate([{"prompt_token_ids": t} for t in prompts], params, use_tqdm=False)
        _drain(llm)
        return [(tuple(o.outputs[0].token_ids), o.num_cached_tokens or 0) for o in outs]

    return generate


def _drain(llm: Any, max_steps: int = 10_000) -> None:
    """With the engine core in this process, step it until the connector has no transfer in
    flight and no finished request holds blocks, as vLLM's own core process does when idle
    (``LLM.generate`` returns once the outputs are out)."""
    client = llm.llm_engine.engine_core
    core = getattr(client, "engine_core", None)  # InprocClient only
    if core is None:
        return
    for _ in range(max_steps):
        if not core.scheduler.has_requests():
            return
        client.get_output()
    raise RuntimeError(f"the engine core still has work after {max_steps} idle steps")


def http_generate(base_url: str, model: str, timeout_s: float = 300.0) -> Generate:
    """Requests to a running vLLM OpenAI server (``/v1/completions``), a round concurrently.

    ``kv_transfer_params`` is a top-level body field; cached prompt tokens come back in
    ``usage.prompt_tokens_details.cached_tokens`` (start vLLM with
    ``--enable-prompt-tokens-details``)."""

    def one(tokens: list[int], kv: dict[str, Any], max_tokens: int) -> tuple[tuple[int, ...], int]:
        body = {
            "model": model,
            "prompt": tokens,
            "max_tokens": max_tokens,
            "ignore_eos": True,
            "temperature": 0.0,
            "return_token_ids": True,
            "kv_transfer_params": kv,
        }
        req = urllib.request.Request(
            f"{base_url}/v1/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            out = json.loads(resp.read())
        choice = out["choices"][0]
        details = (out.get("usage") or {}).get("prompt_tokens_details") or {}
        return tuple(choice.get("token_ids") or ()), int(details.get("cached_tokens") or 0)

    def generate(
        prompts: list[list[int]], kv: list[dict[str, Any]], max_tokens: int
    ) -> list[tuple[tuple[int, ...], int]]:
        with ThreadPoolExecutor(max_workers=max(1, len(prompts))) as pool:
            return list(pool.map(one, prompts, kv, [max_tokens] * len(prompts)))

    return generate


def replay(
    generate: Generate,
    name: str,
    flows: Sequence[Flow],
    *,
    concurrency: int,
    output_tokens: int = OUTPUT_TOKENS,
    between_rounds: Callable[[Run], None] | None = None,
) -> Run:
    """Drive the flows through one engine in rounds: one call of every active flow a round,
    ``concurrency`` flows active at once. ``between_rounds`` runs before every round (the
    daemon's snapshot, for the record)."""
    pending = list(flows)
    active: list[Flow] = []
    run = Run(name)
    t0 = time.perf_counter()
    paused = 0.0  # between rounds: not the engine's time
    n_round = 0
    while pending or active:
        while pending and len(active) < concurrency:
            active.append(pending.pop(0))
        if between_rounds is not None:
            p0 = time.perf_counter()
            between_rounds(run)
            paused += time.perf_counter() - p0
        prompts: list[list[int]] = []
        params: list[dict[str, Any]] = []
        for flow in active:
            agent, tokens, done = flow.next_call()
            prompts.append(tokens)
            kv: dict[str, Any] = {
                "workflow_id": flow.workflow_id,
                "agent": agent,
                "workflow_type": flow.workflow_type,
            }
            if done:
                kv["workflow_done"] = True
            params.append(kv)
            run.calls.append({"round": n_round, "prompt": tokens, **kv})
        first = len(run.calls) - len(prompts)
        results = generate(prompts, params, output_tokens)
        for i, (flow, tokens, (generated, cached)) in enumerate(
            zip(active, prompts, results, strict=True)
        ):
            run.calls[first + i]["generated"] = list(generated)
            run.outputs.append(generated)
            run.requests += 1
            run.prompt_tokens += len(tokens)
            run.output_tokens += len(generated)
            run.hit_tokens += cached
            flow.took(generated)
        active = [flow for flow in active if not flow.finished]
        n_round += 1
    run.wall_s = time.perf_counter() - t0 - paused
    return run


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def make_llm(
    model: Path,
    gpu_blocks: int,
    kv_transfer: dict[str, Any] | None,
    max_num_seqs: int = 8,
    max_model_len: int = MAX_MODEL_LEN,
) -> Any:
    from vllm import LLM  # noqa: PLC0415 - vLLM only in .venv-vllm
    from vllm.config import KVTransferConfig  # noqa: PLC0415

    return LLM(
        model=str(model),
        dtype="float32",
        block_size=BLOCK_TOKENS,
        max_model_len=max_model_len,
        num_gpu_blocks_override=gpu_blocks,
        kv_cache_memory_bytes=gpu_blocks * KV_BYTES_PER_BLOCK,
        enforce_eager=True,
        max_num_seqs=max_num_seqs,
        seed=0,
        kv_transfer_config=KVTransferConfig(**kv_transfer) if kv_transfer else None,
    )


def close_llm(llm: Any) -> None:
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()


def connector_config(host_chunks: int, extra: dict[str, Any]) -> dict[str, Any]:
    return {
        "kv_connector": "AgentKVConnector",
        "kv_connector_module_path": "connector.vllm_adapter",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "cpu_bytes_to_use": host_chunks * KV_BYTES_PER_BLOCK,
            **extra,
        },
    }


def tunable(text: str) -> tuple[str, Any]:
    """``--tunable KEY=VALUE``: the value as JSON reads it (a number, true/false), else text.

    >>> tunable("recency_guard=off"), tunable("write_filter_theta=0.9")
    (('recency_guard', 'off'), ('write_filter_theta', 0.9))
    """
    key, eq, value = text.partition("=")
    if not eq or not key.strip():
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    try:
        parsed: Any = json.loads(value)
    except ValueError:
        parsed = value
    return key.strip(), parsed


class Daemon:
    """``policyd serve`` from the main venv on ephemeral loopback ports, publishing snapshots
    when asked (its timer set to an hour, the snapshots' TTL too)."""

    def __init__(
        self,
        policyd: Path,
        policy: str,
        gpu_blocks: int,
        host_blocks: int,
        workdir: Path,
        *,
        tunables: dict[str, Any] | None = None,
    ) -> None:
        self.events = f"tcp://127.0.0.1:{_free_port()}"
        self.snapshots = f"tcp://127.0.0.1:{_free_port()}"
        self.http = f"http://127.0.0.1:{_free_port()}"
        cmd = [
            str(policyd),
            "serve",
            "--db",
            str(workdir / f"history-{policy}.duckdb"),
            "--events",
            self.events,
            "--snapshots",
            self.snapshots,
            "--http-port",
            self.http.rsplit(":", 1)[1],
            "--policy",
            policy,
            "--gpu-blocks",
            str(gpu_blocks),
            "--profile",
            DAEMON_PROFILE,
        ]
        env = {**os.environ, "POLICYD_SNAPSHOT_TTL_S": str(ON_DEMAND_S)}
        self.log = (workdir / f"policyd-{policy}.log").open("wb")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + 120
        while not self._ready():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"policyd serve did not become ready; see {workdir}")
            time.sleep(0.5)
        # the daemon sizes its decisions by the host tier in GiB of its profile's blocks
        host_gib = host_blocks * get_profile(DAEMON_PROFILE).kv_bytes_per_block / 2**30
        settings = {"snapshot_interval_s": ON_DEMAND_S, "host_tier_gib": host_gib}
        self._request("PUT", "/api/settings", {**settings, **(tunables or {})})

    def _ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.http}/readyz", timeout=2) as resp:
                return int(resp.status) == 200
        except OSError:
            return False

    def _request(self, method: str, path: str, body: Any = None) -> Any:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(
            self.http + path, data=data, method=method, headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(req, timeout=60) as resp:
            return json.loads(resp.read())

    def _get(self, path: str) -> dict[str, Any]:
        out: dict[str, Any] = self._request("GET", path)
        return out

    def stats(self) -> dict[str, Any]:
        return self._get("/api/stats")

    def publish(self) -> dict[str, Any]:
        """A snapshot of everything taken in so far, published; returns it."""
        self._request("POST", "/api/snapshot/publish", {})
        return self._get("/api/snapshot")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


def run_record(r: Run) -> dict[str, Any]:
    return {
        "run": r.name,
        "requests": r.requests,
        "prompt_tokens": r.prompt_tokens,
        "hit_tokens": r.hit_tokens,
        "recomputed_tokens": r.recomputed_tokens,
        "output_tokens": r.output_tokens,
        "wall_s": round(r.wall_s, 3),
        **_step_percentiles(r.step_us, "connector_step"),
        **_step_percentiles(r.step_cpu_us, "connector_step_cpu"),
        "hook_cpu_us": {k: round(v, 1) for k, v in r.hook_cpu_us.items()},
        "hook_calls": r.hook_calls,
        "queued_hooks": r.queued_hooks,
        "deferred_cpu_us": round(r.deferred_cpu_us, 1),
        "deferred_jobs": r.deferred_jobs,
        "worst_steps": r.worst_steps,
        "plan": r.plan,
    }


def _step_percentiles(step_us: Sequence[float], key: str) -> dict[str, float]:
    """AgentKV's added time per scheduler step, p50 and p99 (us), when the run traced it."""
    if len(step_us) < 2:
        return {}
    q = statistics.quantiles(step_us, n=100)
    return {f"{key}_p50_us": round(q[49], 1), f"{key}_p99_us": round(q[98], 1)}


def table(records: Sequence[dict[str, Any]]) -> str:
    """Hit / recomputed prompt tokens per run, and recomputation relative to vLLM's default."""
    base = next((r for r in records if r["run"] == "vllm-default"), records[0])
    lines = [
        f"{'run':<14} {'requests':>8} {'prompt tok':>10} {'hit tok':>9} {'recomputed tok':>14} "
        f"{'vs default':>10} {'wall s':>7} {'out tok/s':>9} {'step p50/p99 us':>16} "
        f"{'cpu p50/p99 us':>15}",
    ]
    for r in records:
        ratio = (
            r["recomputed_tokens"] / base["recomputed_tokens"] if base["recomputed_tokens"] else 0
        )
        rate = r["output_tokens"] / r["wall_s"] if r["wall_s"] else 0.0
        step, cpu = (
            f"{r[f'{key}_p50_us']:.0f}/{r[f'{key}_p99_us']:.0f}" if f"{key}_p50_us" in r else "-"
            for key in ("connector_step", "connector_step_cpu")
        )
        lines.append(
            f"{r['run']:<14} {r['requests']:>8} {r['prompt_tokens']:>10} {r['hit_tokens']:>9} "
            f"{r['recomputed_tokens']:>14} {ratio:>9.2f}x {r['wall_s']:>7.1f} {rate:>9.1f} "
            f"{step:>16} {cpu:>15}"
        )
    return "\n".join(lines)


def hooks_table(records: Sequence[dict[str, Any]]) -> str:
    """Where the connector's CPU time on vLLM's thread goes: per hook, calls and mean us a call
    for each run, heaviest hook first."""
    traced = [r for r in records if r.get("hook_calls")]
    if not traced:
        return ""
    total = {
        h: sum(r["hook_cpu_us"].get(h, 0.0) for r in traced)
        for r in traced
        for h in r["hook_calls"]
    }
    lines = ["hook" + "".join(f" | {r['run']}: calls, us a call, share" for r in traced)]
    run_total = [sum(r["hook_cpu_us"].values()) or 1.0 for r in traced]
    for hook in sorted(total, key=total.__getitem__, reverse=True):
        cells = []
        for r, whole in zip(traced, run_total, strict=True):
            n, us = r["hook_calls"].get(hook, 0), r["hook_cpu_us"].get(hook, 0.0)
            share = us / whole
            cells.append(f" | {n}, {us / n if n else 0.0:.1f}, {share:.0%}")
        lines.append(hook + "".join(cells))
    off = [(r.get("deferred_jobs", 0), r.get("deferred_cpu_us", 0.0)) for r in traced]
    lines.append(
        "(off vLLM's thread: deferred jobs)"
        + "".join(f" | {n}, {us / n if n else 0.0:.1f}, -" for n, us in off)
    )
    for r in traced:
        if queued := r.get("queued_hooks"):
            counts = ", ".join(f"{hook} {n}" for hook, n in queued.items())
            lines.append(f"{r['run']}: queued, timed inside the next call: {counts}")
    return "\n".join(lines)


def repeats_table(records: Sequence[dict[str, Any]], budget_us: float = STEP_BUDGET_P99_US) -> str:
    """Each configuration over repeated runs: the connector's CPU p99 a scheduler step (every
    run's, the median, the worst, against the budget) and the recomputed prompt tokens (median
    and range), each median beside vLLM's default's measured in the same invocation."""
    by_run: dict[str, list[dict[str, Any]]] = {}
    for r in records:
        by_run.setdefault(r["run"], []).append(r)
    recomputed = {name: [r["recomputed_tokens"] for r in runs] for name, runs in by_run.items()}
    base = statistics.median(recomputed["vllm-default"]) if "vllm-default" in by_run else None
    lines = [f"over {max(map(len, by_run.values()), default=0)} runs of each, interleaved"]
    for name, runs in by_run.items():
        tokens = recomputed[name]
        median = statistics.median(tokens)
        cells = [f"recomputed tokens median {median:.0f} (range {min(tokens)}-{max(tokens)})"]
        if base and name != "vllm-default":
            cells.append(f"{median / base:.3f}x vLLM's default's median")
        p99s = [r["connector_step_cpu_p99_us"] for r in runs if "connector_step_cpu_p99_us" in r]
        if p99s:
            p99 = statistics.median(p99s)
            verdict = "within" if p99 <= budget_us else "OVER"
            cells.append(
                f"CPU p99 us a step: runs {', '.join(f'{v:.0f}' for v in p99s)}, median {p99:.0f} "
                f"(budget {budget_us:.0f}: {verdict}), worst {max(p99s):.0f}"
            )
        lines.append(f"{name}: " + "; ".join(cells))
    return "\n".join(lines)


def worst_steps_table(records: Sequence[dict[str, Any]]) -> str:
    """The costliest scheduler steps of each run (the connector keeps 64): their CPU us, and
    the hooks that made it, as calls' CPU us summed over those steps, heaviest first."""
    lines = []
    for r in records:
        worst = r.get("worst_steps") or []
        if not worst:
            continue
        by_hook: dict[str, float] = {}
        for step in worst:
            for hook, us in step["by_hook_us"].items():
                by_hook[hook] = by_hook.get(hook, 0.0) + us / len(worst)
        cpu = [step["cpu_us"] for step in worst]
        top = ", ".join(f"{h} {us:.0f}" for h, us in sorted(by_hook.items(), key=lambda x: -x[1]))
        lines.append(
            f"{r['run']}: the {len(worst)} costliest steps, {min(cpu):.0f}-{max(cpu):.0f} us; "
            f"mean us a step by hook: {top}"
        )
        plan = r.get("plan") or {}
        if plan.get("lookups"):
            n = plan["lookups"]
            parts = ", ".join(f"{k} {v / n:.1f}" for k, v in plan["lookup_parts_us"].items())
            lines.append(
                f"{r['run']}: inside a lookup (wall us a call): {parts}; operations: GPU plan "
                f"{plan['ops']}, host re-keying {plan.get('host_units', 0)}; steps the deadline "
                f"cut short: {plan['cut_steps']} of {plan['steps']}"
            )
    return "\n".join(lines)


def _in_process(args: argparse.Namespace) -> list[Run]:
    work = Path(tempfile.mkdtemp(prefix="agentkv-replay-"))
    model = build_tiny_llama(work / "tiny-llama", max_len_tokens=max(args.max_model_len, 4096))
    runs: list[Run] = []
    for name in args.runs.split(","):
        print(f"[replay] {name}: starting vLLM ...", file=sys.stderr, flush=True)
        daemon: Daemon | None = None
        kv: dict[str, Any] | None = None
        trace_path = work / f"trace-{name}.jsonl"
        extra: dict[str, Any] = {
            **_caps(args),
            **_step_budget(args),
            "agentkv_trace_path": str(trace_path),
            "agentkv_trace_tiers": args.trace_tiers,
        }
        if name == "vllm-default":
            kv = connector_config(args.host_chunks, {**extra, "agentkv_daemon": False})
        elif name != "gpu-only":
            daemon = Daemon(
                args.policyd,
                name,
                args.gpu_blocks,
                args.host_chunks,
                work,
                tunables=dict(args.tunable),
            )
            extra["agentkv_events_endpoint"] = daemon.events
            extra["agentkv_snapshot_endpoint"] = daemon.snapshots
            kv = connector_config(args.host_chunks, extra)
        llm: Any = make_llm(
            model,
            args.gpu_blocks,
            kv,
            max_num_seqs=max(args.concurrency, 1),
            max_model_len=args.max_model_len,
        )
        try:
            run = replay(
                llm_generate(llm),
                name,
                flows_of(args),
                concurrency=args.concurrency,
                output_tokens=args.output_tokens,
                between_rounds=None if daemon is None else _snapshot_between_rounds(daemon),
            )
            run.policy = None if kv is None or daemon is None else name
            if daemon is not None:
                time.sleep(1.0)  # let the last events arrive
                run.daemon = daemon.stats()
            close_llm(llm)  # the connector writes its step times when vLLM shuts it down
            llm = None
            if trace_path.exists():
                lines = [json.loads(line) for line in trace_path.read_text().splitlines()]
                run.trace = [t for t in lines if "step_us" not in t]
                run.step_us = [x for t in lines for x in t.get("step_us", ())]
                run.step_cpu_us = [x for t in lines for x in t.get("step_cpu_us", ())]
                for t in lines:
                    run.hook_cpu_us.update(t.get("hook_cpu_us", {}))
                    run.hook_calls.update(t.get("hook_calls", {}))
                    run.queued_hooks.update(t.get("queued_hooks", {}))
                    run.deferred_cpu_us += t.get("deferred_cpu_us") or 0.0
                    run.deferred_jobs += t.get("deferred_jobs") or 0
                    run.worst_steps += t.get("worst_steps") or []
                    run.plan.update(t.get("plan") or {})
            runs.append(run)
            print(
                f"[replay] {name}: {run.requests} requests in {run.wall_s:.1f} s", file=sys.stderr
            )
        finally:
            if llm is not None:
                close_llm(llm)
            if daemon is not None:
                daemon.stop()
    return runs


def _caps(args: argparse.Namespace) -> dict[str, int]:
    """The connector's GPU caps for this run (the defaults unless given), as it applies them."""
    pinned, ranked = gpu_caps(args.gpu_blocks - 1, args.max_pinned_blocks, args.max_ranked_blocks)
    return {"agentkv_max_pinned_blocks": pinned, "agentkv_max_ranked_blocks": ranked}


def _step_budget(args: argparse.Namespace) -> dict[str, int]:
    """The plan operations per scheduler step (``--step-ops``) and the step's deadline
    (``--step-deadline-us``), else the connector's defaults."""
    return {
        "agentkv_step_ops": args.step_ops or DEFAULT_STEP_OPS,
        "agentkv_step_deadline_us": args.step_deadline_us or DEFAULT_STEP_DEADLINE_US,
    }


def flows_of(args: argparse.Namespace) -> list[Flow]:
    """The workload: a real trace's prompts (``--prompts``) or generated research workflows."""
    if args.prompts is not None:
        return trace_flows(args.prompts)
    return generated_flows(args.workflows, args.seed, args.retry, args.vocab)


def _snapshot_between_rounds(daemon: Daemon) -> Callable[[Run], None]:
    def publish(run: Run) -> None:
        run.script[len(run.calls)] = daemon.publish()
        time.sleep(RECEIVE_S)

    return publish


def record(runs: Sequence[Run], args: argparse.Namespace) -> dict[str, Any]:
    """Everything ``policyd.sim.engine_check`` needs to replay the runs through the simulator:
    the engine's capacities, and per run every request with the hit the connector traced."""
    out: dict[str, Any] = {
        "block_tokens": BLOCK_TOKENS,
        "gpu_blocks": args.gpu_blocks - 1,  # vLLM keeps one block as its null block
        "host_blocks": args.host_chunks,
        "concurrency": args.concurrency,
        "max_pinned_blocks": _caps(args)["agentkv_max_pinned_blocks"],
        "max_ranked_blocks": _caps(args)["agentkv_max_ranked_blocks"],
        "step_ops": _step_budget(args)["agentkv_step_ops"],
        "runs": [],
    }
    for run in runs:
        if not run.trace:
            continue  # gpu-only: no connector, nothing traced
        allocated = [t for t in run.trace if not t.get("finished")]
        finished = {t["request_id"]: t["block_hashes"] for t in run.trace if t.get("finished")}
        if len(allocated) != len(run.calls):
            raise RuntimeError(
                f"{run.name}: {len(allocated)} traced requests for {len(run.calls)} sent"
            )
        # vLLM numbers requests in the order they were added: the k-th call sent is request k
        # (vLLM may allocate them in another order, e.g. one waiting for a host load)
        by_order = sorted(allocated, key=lambda t: int(str(t["request_id"]).split("-")[0]))
        requests = []
        for call, traced in zip(run.calls, by_order, strict=True):
            if traced["workflow_id"] != call["workflow_id"]:
                raise RuntimeError(f"{run.name}: trace out of order at {traced['request_id']}")
            kept: dict[str, Any] = {k: traced[k] for k in (*TRACED, *TIERS) if k in traced}
            # vLLM's block hashes (as the connector sends them): the prompt's full blocks, and
            # every full block once the request ended (the generated tokens' included)
            kept["full_block_hashes"] = finished.get(traced["request_id"], [])
            requests.append({**call, **kept})
        out["runs"].append(
            {"name": run.name, "policy": run.policy, "requests": requests, "script": run.script}
        )
    return out


# What makes a recorded run a function of the requests (``--record``):
DETERMINISTIC_ENV: Final = {
    # the engine core in this process: a round's requests all reach the scheduler before its
    # first step (vLLM's default, a core process of its own, takes them in as they arrive)
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    # vLLM appends 8 random characters to every request id, and its offloading scheduler tells
    # the host tier's policy of the requests that finished in one scheduler step in the
    # iteration order of a set of those ids; that order is the host tier's LRU order among
    # them, so random ids (or a random string hash) changed later host hits from run to run
    "VLLM_DISABLE_REQUEST_ID_RANDOMIZATION": "1",
    "PYTHONHASHSEED": "0",
}


def _make_deterministic(argv: list[str]) -> None:
    """Set ``DETERMINISTIC_ENV`` (a value the caller gave is kept); the string hash's seed is
    read when Python starts, so without a fixed one this process starts again with it."""
    for name, value in DETERMINISTIC_ENV.items():
        if name != "PYTHONHASHSEED":
            os.environ.setdefault(name, value)
    if os.environ.get("PYTHONHASHSEED", "random") == "random":
        env = {**os.environ, "PYTHONHASHSEED": DETERMINISTIC_ENV["PYTHONHASHSEED"]}
        sys.stdout.flush()
        os.execve(sys.executable, [sys.executable, "-m", "connector.replay", *argv], env)


TRACED: Final = ("block_hashes", "gpu_tokens", "host_tokens", "view_version", "may_store")
TIERS: Final = ("gpu_free_order", "gpu_held", "host")


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m connector.replay", description=__doc__)
    ap.formatter_class = argparse.RawDescriptionHelpFormatter
    ap.add_argument("--workflows", type=int, default=8)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--retry", type=float, default=0.5, help="verifier -> searcher probability")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--prompts",
        type=Path,
        help="replay a real trace's prompts (policyd engine-prompts) instead",
    )
    ap.add_argument("--output-tokens", type=int, default=OUTPUT_TOKENS, help="per request")
    ap.add_argument("--max-pinned-blocks", type=int, help="agentkv_max_pinned_blocks")
    ap.add_argument("--max-ranked-blocks", type=int, help="agentkv_max_ranked_blocks")
    ap.add_argument("--step-ops", type=int, help="agentkv_step_ops (default: the connector's)")
    ap.add_argument(
        "--step-deadline-us",
        type=int,
        help="agentkv_step_deadline_us (default: the connector's)",
    )
    ap.add_argument("--max-model-len", type=int, default=MAX_MODEL_LEN)
    ap.add_argument("--gpu-blocks", type=int, default=40)
    ap.add_argument("--host-chunks", type=int, default=96)
    ap.add_argument("--policy", default="agentkv", help="policyd serve --policy")
    ap.add_argument("--policyd", type=Path, default=ROOT / ".venv" / "bin" / "policyd")
    ap.add_argument("--runs", default="gpu-only,vllm-default,agentkv")
    ap.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="run --runs this many times, interleaved, and summarise the step budget over them "
        "(a p99 over ~2,000 steps moves by tens of us between runs on a shared machine)",
    )
    ap.add_argument("--server", help="replay against this running vLLM server instead")
    ap.add_argument("--model", help="the served model name (with --server)")
    ap.add_argument("--label", default="server", help="the run's name in the table (--server)")
    ap.add_argument("--vocab", type=int, default=1000, help="token ids used: 3 .. 3+vocab")
    ap.add_argument("--table", nargs="+", type=Path, help="print the table of saved --json runs")
    ap.add_argument("--json", type=Path, help="also write the figures here")
    ap.add_argument("--record", type=Path, help="write the requests and snapshots here")
    ap.add_argument(
        "--trace-tiers", action="store_true", help="record both tiers' blocks at every request"
    )
    ap.add_argument(
        "--tunable",
        type=tunable,
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a daemon tunable for every daemon run (PUT /api/settings; e.g. recency_guard=off)",
    )
    args = ap.parse_args(argv)
    if args.repeat < 1:
        ap.error("--repeat must be >= 1")
    if args.repeat > 1 and (args.record or args.server):
        ap.error("--repeat is for in-process timing runs (not with --record or --server)")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # the table, not vLLM's start-up log
    if args.record:
        _make_deterministic(list(argv) if argv is not None else sys.argv[1:])

    if args.table:
        records = [rec for path in args.table for rec in json.loads(path.read_text())]
        print(table(records))
        return 0
    if args.server:
        if not args.model:
            ap.error("--server needs --model")
        runs = [
            replay(
                http_generate(args.server.rstrip("/"), args.model),
                args.label,
                flows_of(args),
                concurrency=args.concurrency,
                output_tokens=args.output_tokens,
            )
        ]
    else:
        runs = [run for _ in range(args.repeat) for run in _in_process(args)]
    records = [run_record(r) for r in runs]
    print(table(records))
    if args.repeat > 1:
        print("\n" + repeats_table(records))
    hooks = hooks_table(records)
    if hooks:
        print("\nthe connector's CPU time on vLLM's thread, by hook\n" + hooks)
        print(worst_steps_table(records))
    same = all(r.outputs == runs[0].outputs for r in runs)
    if len(runs) > 1:
        print(f"generated tokens identical across runs: {'yes' if same else 'NO'}")
    for r in runs:
        if r.daemon:
            keys = ("events", "requests", "seq_gaps", "malformed_frames", "policy")
            print(f"policyd ({r.name}): " + ", ".join(f"{k}={r.daemon.get(k)}" for k in keys))
    if args.json:
        args.json.write_text(json.dumps(records, indent=2))
    if args.record:
        args.record.write_text(json.dumps(record(runs, args)))
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
