"""End-to-end replay: the real vLLM engine (CPU) + ``policyd serve`` + a small agent workload.

    .venv-vllm/bin/python -m connector.replay [--workflows 8] [--concurrency 4] [--seed 0]

Multi-agent workflows (planner -> searcher -> verifier, the verifier sending work back to the
searcher with probability ``--retry``, then a writer) run ``--concurrency`` at a time against a
tiny local Llama whose GPU pool is small. Every call carries ``kv_transfer_params`` (workflow,
agent, type, ``workflow_done`` on the last call). An agent's prompt is its system prompt, the
workflow's task and the workflow's transcript so far, so an agent called again reuses its own
earlier prompt - after the other agents' calls may have evicted it.

The same workload runs three times: ``gpu-only`` (vLLM without a connector: GPU prefix cache
only), ``vllm-default`` (AgentKVConnector with no daemon: the host tier with vLLM's LRU and
store-everything) and ``agentkv`` (the connector talking to ``policyd serve``). It prints hit
and recomputed prompt tokens per run as a table and checks that every run generated the same
tokens. ``policyd serve`` runs from the main venv (``--policyd``, default ``.venv/bin/policyd``).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import socket
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

ROOT: Final = Path(__file__).resolve().parents[1]
BLOCK_TOKENS: Final = 32
KV_BYTES_PER_BLOCK: Final = 2 * 2 * BLOCK_TOKENS * 64 * 4  # tiny Llama, fp32
MAX_MODEL_LEN: Final = 1024
SYSTEM_TOKENS: Final = 96
TASK_TOKENS: Final = 128
TOOL_TOKENS: Final = 48
OUTPUT_TOKENS: Final = 8
AGENTS: Final = ("planner", "searcher", "verifier", "writer")


@dataclass
class Workflow:
    workflow_id: str
    task: list[int]
    rng: random.Random
    retry: float
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

    @property
    def recomputed_tokens(self) -> int:
        return self.prompt_tokens - self.hit_tokens


def _tokens(rng: random.Random, n: int, vocab: int = 1000) -> list[int]:
    return [rng.randrange(3, 3 + vocab) for _ in range(n)]


Generate = Callable[[list[list[int]], list[dict[str, Any]]], list[tuple[tuple[int, ...], int]]]
"""(prompt token ids, kv_transfer_params) per request -> (generated ids, cached prompt tokens)."""


def llm_generate(llm: Any) -> Generate:
    """Requests through an in-process ``vllm.LLM``, one batch per round."""
    from vllm import SamplingParams  # noqa: PLC0415 - vLLM only in .venv-vllm

    def generate(
        prompts: list[list[int]], kv: list[dict[str, Any]]
    ) -> list[tuple[tuple[int, ...], int]]:
        params = [
            SamplingParams(
                temperature=0.0, max_tokens=OUTPUT_TOKENS, extra_args={"kv_transfer_params": p}
            )
            for p in kv
        ]
        outs = llm.generate([{"prompt_token_ids": t} for t in prompts], params, use_tqdm=False)
        return [(tuple(o.outputs[0].token_ids), o.num_cached_tokens or 0) for o in outs]

    return generate


def http_generate(base_url: str, model: str, timeout_s: float = 300.0) -> Generate:
    """Requests to a running vLLM OpenAI server (``/v1/completions``), a round concurrently.

    ``kv_transfer_params`` is a top-level body field; cached prompt tokens come back in
    ``usage.prompt_tokens_details.cached_tokens`` (start vLLM with
    ``--enable-prompt-tokens-details``)."""

    def one(tokens: list[int], kv: dict[str, Any]) -> tuple[tuple[int, ...], int]:
        body = {
            "model": model,
            "prompt": tokens,
            "max_tokens": OUTPUT_TOKENS,
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
        prompts: list[list[int]], kv: list[dict[str, Any]]
    ) -> list[tuple[tuple[int, ...], int]]:
        with ThreadPoolExecutor(max_workers=max(1, len(prompts))) as pool:
            return list(pool.map(one, prompts, kv))

    return generate


def replay(
    generate: Generate,
    name: str,
    *,
    n_workflows: int,
    concurrency: int,
    seed: int,
    retry: float,
    vocab: int = 1000,
) -> Run:
    """Drive the workload through one engine; closed loop (outputs join the transcript)."""
    rng = random.Random(seed)
    systems = {agent: _tokens(rng, SYSTEM_TOKENS, vocab) for agent in AGENTS}
    pending = [
        Workflow(f"wf{i}", _tokens(rng, TASK_TOKENS, vocab), random.Random(seed * 1000 + i), retry)
        for i in range(n_workflows)
    ]
    active: list[Workflow] = []
    run = Run(name)
    t0 = time.perf_counter()
    while pending or active:
        while pending and len(active) < concurrency:
            active.append(pending.pop(0))
        prompts: list[list[int]] = []
        params: list[dict[str, Any]] = []
        for wf in active:
            assert wf.agent is not None
            tokens = systems[wf.agent] + wf.task + wf.transcript
            nxt = wf.next_agent(wf.agent)
            done = nxt is None or len(tokens) + TOOL_TOKENS + 2 * OUTPUT_TOKENS >= MAX_MODEL_LEN
            prompts.append(tokens)
            kv: dict[str, Any] = {
                "workflow_id": wf.workflow_id,
                "agent": wf.agent,
                "workflow_type": "research",
            }
            if done:
                kv["workflow_done"] = True
            params.append(kv)
            wf.agent = None if done else nxt
        for wf, tokens, (generated, cached) in zip(
            active, prompts, generate(prompts, params), strict=True
        ):
            run.outputs.append(generated)
            run.requests += 1
            run.prompt_tokens += len(tokens)
            run.output_tokens += len(generated)
            run.hit_tokens += cached
            wf.transcript += list(generated) + _tokens(wf.rng, TOOL_TOKENS, vocab)  # tool answer
            wf.calls += 1
        active = [wf for wf in active if wf.agent is not None]
    run.wall_s = time.perf_counter() - t0
    return run


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def make_llm(model: Path, gpu_blocks: int, kv_transfer: dict[str, Any] | None) -> Any:
    from vllm import LLM  # noqa: PLC0415 - vLLM only in .venv-vllm
    from vllm.config import KVTransferConfig  # noqa: PLC0415

    return LLM(
        model=str(model),
        dtype="float32",
        block_size=BLOCK_TOKENS,
        max_model_len=MAX_MODEL_LEN,
        num_gpu_blocks_override=gpu_blocks,
        kv_cache_memory_bytes=gpu_blocks * KV_BYTES_PER_BLOCK,
        enforce_eager=True,
        max_num_seqs=8,
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


class Daemon:
    """``policyd serve`` from the main venv on ephemeral loopback ports."""

    def __init__(self, policyd: Path, policy: str, gpu_blocks: int, workdir: Path) -> None:
        self.events = f"tcp://127.0.0.1:{_free_port()}"
        self.snapshots = f"tcp://127.0.0.1:{_free_port()}"
        self.http = f"http://127.0.0.1:{_free_port()}"
        cmd = [
            str(policyd),
            "serve",
            "--db",
            str(workdir / "history.duckdb"),
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
        ]
        self.log = (workdir / "policyd.log").open("wb")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 120
        while not self._ready():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"policyd serve did not become ready; see {workdir}/policyd.log")
            time.sleep(0.5)

    def _ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.http}/readyz", timeout=2) as resp:
                return int(resp.status) == 200
        except OSError:
            return False

    def stats(self) -> dict[str, Any]:
        with urllib.request.urlopen(f"{self.http}/api/stats", timeout=5) as resp:
            out: dict[str, Any] = json.loads(resp.read())
            return out

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
    }


def table(records: Sequence[dict[str, Any]]) -> str:
    """Hit / recomputed prompt tokens per run, and recomputation relative to vLLM's default."""
    base = next((r for r in records if r["run"] == "vllm-default"), records[0])
    lines = [
        f"{'run':<14} {'requests':>8} {'prompt tok':>10} {'hit tok':>9} {'recomputed tok':>14} "
        f"{'vs default':>10} {'wall s':>7} {'out tok/s':>9}",
    ]
    for r in records:
        ratio = (
            r["recomputed_tokens"] / base["recomputed_tokens"] if base["recomputed_tokens"] else 0
        )
        rate = r["output_tokens"] / r["wall_s"] if r["wall_s"] else 0.0
        lines.append(
            f"{r['run']:<14} {r['requests']:>8} {r['prompt_tokens']:>10} {r['hit_tokens']:>9} "
            f"{r['recomputed_tokens']:>14} {ratio:>9.2f}x {r['wall_s']:>7.1f} {rate:>9.1f}"
        )
    return "\n".join(lines)


def _in_process(args: argparse.Namespace) -> list[Run]:
    work = Path(tempfile.mkdtemp(prefix="agentkv-replay-"))
    model = build_tiny_llama(work / "tiny-llama", max_len_tokens=MAX_MODEL_LEN * 4)
    runs: list[Run] = []
    for name in args.runs.split(","):
        print(f"[replay] {name}: starting vLLM ...", file=sys.stderr, flush=True)
        daemon: Daemon | None = None
        kv: dict[str, Any] | None = None
        if name == "vllm-default":
            kv = connector_config(args.host_chunks, {"agentkv_daemon": False})
        elif name == "agentkv":
            daemon = Daemon(args.policyd, args.policy, args.gpu_blocks, work)
            extra = {"agentkv_events_endpoint": daemon.events}
            extra["agentkv_snapshot_endpoint"] = daemon.snapshots
            kv = connector_config(args.host_chunks, extra)
        elif name != "gpu-only":
            raise SystemExit(f"unknown run {name!r}: choose from gpu-only, vllm-default, agentkv")
        llm = make_llm(model, args.gpu_blocks, kv)
        try:
            run = replay(
                llm_generate(llm),
                name,
                n_workflows=args.workflows,
                concurrency=args.concurrency,
                seed=args.seed,
                retry=args.retry,
            )
            if daemon is not None:
                time.sleep(1.0)  # let the last events arrive
                run.daemon = daemon.stats()
            runs.append(run)
            print(
                f"[replay] {name}: {run.requests} requests in {run.wall_s:.1f} s", file=sys.stderr
            )
        finally:
            close_llm(llm)
            if daemon is not None:
                daemon.stop()
    return runs


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m connector.replay", description=__doc__)
    ap.formatter_class = argparse.RawDescriptionHelpFormatter
    ap.add_argument("--workflows", type=int, default=8)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--retry", type=float, default=0.5, help="verifier -> searcher probability")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--gpu-blocks", type=int, default=40)
    ap.add_argument("--host-chunks", type=int, default=96)
    ap.add_argument("--policy", default="agentkv", help="policyd serve --policy")
    ap.add_argument("--policyd", type=Path, default=ROOT / ".venv" / "bin" / "policyd")
    ap.add_argument("--runs", default="gpu-only,vllm-default,agentkv")
    ap.add_argument("--server", help="replay against this running vLLM server instead")
    ap.add_argument("--model", help="the served model name (with --server)")
    ap.add_argument("--label", default="server", help="the run's name in the table (--server)")
    ap.add_argument("--vocab", type=int, default=1000, help="token ids used: 3 .. 3+vocab")
    ap.add_argument("--table", nargs="+", type=Path, help="print the table of saved --json runs")
    ap.add_argument("--json", type=Path, help="also write the figures here")
    args = ap.parse_args(argv)
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # the table, not vLLM's start-up log

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
                n_workflows=args.workflows,
                concurrency=args.concurrency,
                seed=args.seed,
                retry=args.retry,
                vocab=args.vocab,
            )
        ]
    else:
        runs = _in_process(args)
    records = [run_record(r) for r in runs]
    print(table(records))
    same = all(r.outputs == runs[0].outputs for r in runs)
    if len(runs) > 1:
        print(f"generated tokens identical across runs: {'yes' if same else 'NO'}")
    for r in runs:
        if r.daemon:
            keys = ("events", "requests", "seq_gaps", "malformed_frames", "policy")
            print(f"policyd ({r.name}): " + ", ".join(f"{k}={r.daemon.get(k)}" for k in keys))
    if args.json:
        args.json.write_text(json.dumps(records, indent=2))
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
