"""Real traces as token prompts for the real engine's tiny model (``connector.replay --prompts``).

    policyd engine-prompts --swe PATH --whowhen PATH --out prompts.json
    policyd engine-prompts --workload financial --param workflows=24 --out prompts.json

The engine replays need token ids, not block hashes, and the tiny test model reads a context of
a few thousand tokens with a 1,000-word vocabulary. Each 16-token block of a trace call (its
chained hash, as the readers make it) becomes ``tokens_per_block`` token ids drawn from that hash,
so two prompts that share a prefix of blocks in the trace share it token for token here, and
the engine's own 32-token blocks share exactly what the trace's pairs of blocks share (a scale
model: every 16 trace tokens become ``tokens_per_block`` engine tokens). A prompt longer than
``max_tokens`` keeps its first ``max_tokens`` (the model's context). Workflows are taken in turn
from each trace (SWE-bench trajectories, Who&When chats) until ``requests`` calls are reached.
``--workload`` takes a generated workload instead (or beside them; ``--param KEY=INT`` passes
its generator's integer parameters, ``--seed`` its seed), so a point where the simulator
credits a policy a gain can be replayed on the engine.
"""

from __future__ import annotations

import argparse
import json
import random
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from policyd.traces import load_trace
from policyd.workloads import make_workload
from policyd.workloads.calls import Call, Workload

VOCAB_LOW = 3  # the tiny model's first three ids are special tokens


def block_tokens(block_hash: int, n: int, vocab: int) -> list[int]:
    """``n`` token ids in the tiny model's vocabulary, a function of the block's hash."""
    rng = random.Random(block_hash)
    return [VOCAB_LOW + rng.randrange(vocab) for _ in range(n)]


def call_prompt(call: Call, tokens_per_block: int, max_tokens: int, vocab: int) -> list[int]:
    out: list[int] = []
    for block in call.block_hashes:
        if len(out) + tokens_per_block > max_tokens:
            break
        out.extend(block_tokens(block, tokens_per_block, vocab))
    return out


def workflows(
    workload: Workload, source: str, tokens_per_block: int, max_tokens: int, vocab: int
) -> Iterator[dict[str, Any]]:
    for i, stream in enumerate(workload):
        calls = [
            {"agent": c.agent, "prompt": call_prompt(c, tokens_per_block, max_tokens, vocab)}
            for c in stream
        ]
        calls = [c for c in calls if c["prompt"]]
        if calls:
            first = stream[0]
            yield {
                "workflow_id": f"{source}-{i}-{first.workflow_id}",
                "workflow_type": first.workflow_type or source,
                "calls": calls,
            }


def interleave(sources: Sequence[list[dict[str, Any]]], requests: int) -> list[dict[str, Any]]:
    """One workflow from each source in turn until ``requests`` calls are taken."""
    out: list[dict[str, Any]] = []
    taken = 0
    iters = [iter(s) for s in sources]
    while taken < requests and iters:
        for it in list(iters):
            wf = next(it, None)
            if wf is None:
                iters.remove(it)
                continue
            out.append(wf)
            taken += len(wf["calls"])
            if taken >= requests:
                break
    return out


def _params(ap: argparse.ArgumentParser, given: Sequence[str]) -> dict[str, int]:
    out: dict[str, int] = {}
    for item in given:
        key, _, value = item.partition("=")
        if not key or not value.lstrip("-").isdigit():
            ap.error(f"--param {item!r}: give KEY=INT")
        out[key] = int(value)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="policyd engine-prompts",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--swe", type=Path, help="mini-swe-agent trajectories (folder or .tar.gz)")
    ap.add_argument("--whowhen", type=Path, help="Who&When group chats (folder)")
    ap.add_argument("--workload", help="a generated workload's name (policyd.workloads)")
    ap.add_argument(
        "--param",
        action="append",
        default=[],
        metavar="KEY=INT",
        help="a parameter of --workload's generator (repeatable), e.g. workflows=24",
    )
    ap.add_argument("--seed", type=int, default=0, help="--workload's seed")
    ap.add_argument("--requests", type=int, default=500, help="at least this many calls")
    ap.add_argument("--tokens-per-block", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=3968, help="a prompt's context")
    ap.add_argument("--vocab", type=int, default=1000)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    sources: list[list[dict[str, Any]]] = []
    for name, path in (("swe", args.swe), ("whowhen", args.whowhen)):
        if path is not None:
            wl = load_trace(path)
            sources.append(
                list(workflows(wl, name, args.tokens_per_block, args.max_tokens, args.vocab))
            )
    if args.workload is not None:
        try:
            wl = make_workload(args.workload, seed=args.seed, **_params(ap, args.param))
        except TypeError as exc:  # a parameter its generator does not take
            ap.error(f"--param: {exc}")
        sources.append(
            list(workflows(wl, args.workload, args.tokens_per_block, args.max_tokens, args.vocab))
        )
    if not sources:
        ap.error("give --swe, --whowhen or --workload")
    chosen = interleave(sources, args.requests)
    n_calls = sum(len(w["calls"]) for w in chosen)
    args.out.write_text(json.dumps({"workflows": chosen}))
    longest = max(len(c["prompt"]) for w in chosen for c in w["calls"])
    print(f"{len(chosen)} workflows, {n_calls} calls, longest prompt {longest} tokens: {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
