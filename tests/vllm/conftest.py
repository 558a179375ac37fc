"""Engine tests: vLLM 0.32 on the CPU platform with a tiny local Llama.

They run only where vLLM imports (the ``.venv-vllm`` venv, ``make test`` runs them there); in the
main venv this folder is not collected. Engines start once per module (45-120 s each on 2 cores):
a baseline without the connector and one with ``AgentKVConnector`` talking to a stand-in daemon
process on ephemeral loopback ports.
"""

from __future__ import annotations

import gc
import importlib.util
import json
import random
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import pytest

from policyd.core.types import Event, PolicySnapshot

if importlib.util.find_spec("vllm") is None:  # the main venv: nothing here to run
    collect_ignore_glob = ["test_*.py"]

ROOT = Path(__file__).resolve().parents[2]
BLOCK_TOKENS = 32  # the CPU attention backend wants a multiple of 32
GPU_BLOCKS = 24  # small, so that four 10-block prompts force GPU evictions
HOST_CHUNKS = 64
KV_BYTES_PER_BLOCK = 2 * 2 * BLOCK_TOKENS * 64 * 4  # layers x (K, V) x tokens x head_dim x fp32
MAX_TOKENS = 8
VOCAB_LOW, VOCAB_HIGH = 3, 1003


def tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(VOCAB_LOW, VOCAB_HIGH) for _ in range(n)]


@dataclass(frozen=True)
class Prompt:
    name: str
    token_ids: tuple[int, ...]
    params: dict[str, Any] = field(default_factory=dict)


def prompt(name: str, seed: int, n: int, **params: Any) -> Prompt:
    return Prompt(name, tuple(tokens(seed, n)), params)


def solo(name: str, seed: int) -> Prompt:
    return prompt(name, seed, 330, workflow_id=f"wf-{name}", agent="solo")


A, B, C, D = (solo(name, seed) for name, seed in (("A", 1), ("B", 2), ("C", 3), ("D", 4)))
E = prompt("E", 5, 330, workflow_id="wf-big", agent="refill")
G = prompt("G", 7, 140, workflow_id="wf-old", agent="planner", workflow_done=True)
H = prompt("H", 8, 140, workflow_id="wf-live", agent="planner")
FILL = [solo(name, seed) for name, seed in (("I", 9), ("J", 10), ("K", 11))]
L, M = solo("L", 12), solo("M", 13)

# the calls every engine makes, in order; a test runs its phases on the connector engine
PHASES: dict[str, list[list[Prompt]]] = {
    "offload": [[A, B, C, D], [A, B, C, D]],
    "write_filter": [[E]],
    "retire": [[G], [H], FILL],
    "daemon_killed": [[A, L, B, M, C, D], [A, B, C, D, L, M]],
}


class Engine:
    """One vLLM ``LLM`` (greedy, 8 new tokens) and the outputs of every call it made."""

    def __init__(self, model: Path, kv_transfer: dict[str, Any] | None) -> None:
        from vllm import LLM  # noqa: PLC0415 - vLLM is imported only where it runs
        from vllm.config import KVTransferConfig  # noqa: PLC0415

        self.llm = LLM(
            model=str(model),
            dtype="float32",
            block_size=BLOCK_TOKENS,
            max_model_len=512,
            num_gpu_blocks_override=GPU_BLOCKS,
            kv_cache_memory_bytes=GPU_BLOCKS * KV_BYTES_PER_BLOCK,
            enforce_eager=True,
            max_num_seqs=4,
            seed=0,
            kv_transfer_config=KVTransferConfig(**kv_transfer) if kv_transfer else None,
        )

    def generate(self, prompts: Sequence[Prompt]) -> list[tuple[tuple[int, ...], int]]:
        """(generated token ids, prompt tokens served from a cache) per prompt."""
        from vllm import SamplingParams  # noqa: PLC0415

        params = [
            SamplingParams(
                temperature=0.0, max_tokens=MAX_TOKENS, extra_args={"kv_transfer_params": p.params}
            )
            for p in prompts
        ]
        outs = self.llm.generate(
            [{"prompt_token_ids": list(p.token_ids)} for p in prompts], params, use_tqdm=False
        )
        return [(tuple(o.outputs[0].token_ids), o.num_cached_tokens or 0) for o in outs]

    def close(self) -> None:
        self.llm.llm_engine.engine_core.shutdown()
        del self.llm
        gc.collect()


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from connector.tiny_model import build_tiny_llama  # noqa: PLC0415

    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def baseline(
    tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, list[list[tuple[int, ...]]]]:
    """Every phase's generated tokens from vLLM without any connector (a process of its own:
    one engine per process is what vLLM is built for)."""
    out = tmp_path_factory.mktemp("baseline") / "baseline.json"
    result = subprocess.run(
        [sys.executable, "-m", "tests.vllm.baseline", str(tiny_model), str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    if result.returncode != 0:
        pytest.fail(f"baseline engine failed:\n{result.stderr[-4000:]}")
    raw = json.loads(out.read_text())
    return {
        name: [[tuple(tokens) for tokens in call] for call in calls] for name, calls in raw.items()
    }


def free_port() -> int:
    import socket  # noqa: PLC0415

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


_EVENT = msgspec.json.Decoder(Event)


class StandInDaemon:
    """The stand-in daemon process (tests/vllm/standin_daemon.py): start, kill, restart, read."""

    def __init__(self, workdir: Path) -> None:
        self.events_endpoint = f"tcp://127.0.0.1:{free_port()}"
        self.snapshot_endpoint = f"tcp://127.0.0.1:{free_port()}"
        self.events_path = workdir / "events.jsonl"
        self.snapshot_path = workdir / "snapshot.json"
        self.proc: subprocess.Popen[bytes] | None = None
        self.version = 0

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [
                sys.executable,
                str(Path(__file__).with_name("standin_daemon.py")),
                self.events_endpoint,
                self.snapshot_endpoint,
                str(self.events_path),
                str(self.snapshot_path),
            ],
            cwd=ROOT,
        )

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=30)

    def publish(self, **fields: Any) -> PolicySnapshot:
        self.version += 1
        snap = PolicySnapshot(
            version=self.version, ts=time.monotonic(), ttl_s=3600.0, policy="test", **fields
        )
        tmp = self.snapshot_path.with_suffix(".tmp")
        tmp.write_bytes(msgspec.json.encode(snap))
        tmp.replace(self.snapshot_path)
        return snap

    def publish_garbage(self) -> None:
        self.snapshot_path.write_bytes(b"GARBAGE")

    def events(self) -> list[Event]:
        if not self.events_path.exists():
            return []
        lines = self.events_path.read_bytes().splitlines()
        return [_EVENT.decode(line) for line in lines if line.strip()]

    def wait_for(self, cond: Callable[[list[Event]], bool], timeout_s: float = 30.0) -> list[Event]:
        deadline = time.monotonic() + timeout_s
        while True:
            got = self.events()
            if cond(got) or time.monotonic() > deadline:
                return got
            time.sleep(0.1)


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StandInDaemon]:
    d = StandInDaemon(tmp_path_factory.mktemp("daemon"))
    d.start()
    yield d
    d.kill()


@pytest.fixture(scope="module")
def engine(tiny_model: Path, daemon: StandInDaemon, baseline: dict[str, Any]) -> Iterator[Engine]:
    """vLLM with AgentKVConnector, a 24-block GPU pool and a 64-chunk host tier."""
    eng = Engine(
        tiny_model,
        {
            "kv_connector": "AgentKVConnector",
            "kv_connector_module_path": "connector.vllm_adapter",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {
                "cpu_bytes_to_use": HOST_CHUNKS * KV_BYTES_PER_BLOCK,
                "agentkv_events_endpoint": daemon.events_endpoint,
                "agentkv_snapshot_endpoint": daemon.snapshot_endpoint,
                "agentkv_max_pinned_blocks": 2,
                # the step deadline makes the plan's pace depend on this machine's clock (on two
                # shared cores most steps are cut): these tests check what the decisions do, with
                # a fixed number of warm-up steps, so they lift it (tests/vllm/test_gpu_tier.py
                # checks the deadline itself; connector.replay measures the lag it causes)
                "agentkv_step_deadline_us": 1_000_000,
            },
        },
    )
    yield eng
    eng.close()
