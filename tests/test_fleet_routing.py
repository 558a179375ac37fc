"""Workflow-aware routing for a fleet of replicas (policyd/fleet/residency.py, routing.py,
router_service.py, examples/fleet_proxy.py): the index and the routers on hand-built updates,
a ResidencyFeed's updates round-tripped through bytes into a PrefixIndex, gaps healed by a full
state, and end to end: real nats-server, real feeds fed real events, the route service in
process, and the example proxy in front of two stand-in upstreams."""

from __future__ import annotations

import asyncio
import importlib.util
import random
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import httpx
import msgspec
import nats
import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

from policyd.core.types import (
    TIERS,
    AllBlocksCleared,
    BlocksLoaded,
    BlocksRemoved,
    BlocksStored,
    Event,
    RequestFinished,
    RequestStarted,
    Tier,
    WorkflowFinished,
)
from policyd.fleet.residency import (
    ResidencyFeed,
    ResidencyPublisher,
    ResidencyState,
    ResidencyUpdate,
    TierChange,
    WorkflowCall,
    decode,
    join_parts,
    split_state,
    subject,
)
from policyd.fleet.router_service import (
    RouteClient,
    RouteState,
    RouteUnavailableError,
    bind,
    start_route_service,
)
from policyd.fleet.routing import (
    Decision,
    NoReplicaError,
    PrefixAware,
    PrefixIndex,
    RoundRobin,
    RouteQuery,
    SessionSticky,
    WorkflowAware,
    overloaded,
)
from tests.nats_servers import NatsCluster

ROOT = Path(__file__).resolve().parents[1]


def update(replica: str, seq: int, epoch: int = 7, **fields: Any) -> ResidencyUpdate:
    return ResidencyUpdate(replica=replica, epoch=epoch, seq=seq, ts=0.0, **fields)


def state(replica: str, seq: int, epoch: int = 7, **fields: Any) -> ResidencyState:
    return ResidencyState(replica=replica, epoch=epoch, seq=seq, ts=0.0, **fields)


def gpu(*hashes: int) -> TierChange:
    return TierChange("gpu", stored=hashes)


# ---- the index ---------------------------------------------------------------------------------


def test_index_counts_a_prefix_as_vllm_serves_it() -> None:
    index = PrefixIndex()
    index.apply("a", state("a", 0, gpu=(1, 2), host=(3, 4, 9)))
    index.apply("b", state("b", 0, gpu=(1, 3), host=(2,)))
    # a: GPU 1, 2 then host 3, 4, then a miss (5); b: GPU 1, host 2, then 3 is GPU only: stop
    assert index.longest_prefix((1, 2, 3, 4, 5, 9)) == {"a": 4, "b": 2}
    assert index.longest_prefix((1, 2), ["a", "zz"]) == {"a": 2, "zz": 0}
    assert index.longest_prefix((8, 1)) == {"a": 0, "b": 0}


def test_updates_apply_in_order_and_old_ones_are_ignored() -> None:
    index = PrefixIndex()
    assert index.apply("a", state("a", 0, gpu=(1,)))
    assert index.apply("a", update("a", 1, tiers=(gpu(2, 3),)))
    assert index.apply("a", update("a", 2, tiers=(TierChange("gpu", removed=(3,)),)))
    assert not index.apply("a", update("a", 2, tiers=(gpu(99),)))  # repeated
    assert not index.apply("a", update("b", 3))  # names another replica
    view = index.replicas["a"]
    assert view.gpu == {1, 2} and view.seq == 2 and not view.stale and view.gaps == 0
    # cleared first, then removed, then stored
    change = TierChange("gpu", cleared=True, stored=(5, 6), removed=(6,))
    index.apply("a", update("a", 3, tiers=(change,)))
    assert view.gpu == {5, 6}


def test_a_gap_marks_the_replica_stale_until_a_full_state() -> None:
    index = PrefixIndex()
    index.apply("a", state("a", 4, gpu=(1,)))
    index.apply("a", update("a", 6, tiers=(gpu(2),)))  # 5 was lost
    view = index.replicas["a"]
    assert view.stale and view.gaps == 1 and view.gpu == {1, 2}
    index.apply("a", state("a", 6, gpu=(1, 2, 3)))
    assert not view.stale and view.gpu == {1, 2, 3}
    index.apply("a", update("a", 7, epoch=8, tiers=(gpu(4),)))  # a restart we missed the start of
    assert view.stale and view.gaps == 2


def test_a_new_feed_starts_clean() -> None:
    index = PrefixIndex()
    index.apply("a", state("a", 9, gpu=(1, 2), workflows=(WorkflowCall("w", "x", (1, 2)),)))
    index.apply("a", update("a", 1, epoch=99, tiers=(gpu(5),)))  # the daemon restarted
    view = index.replicas["a"]
    assert view.gpu == {5} and not view.stale and index.workflow("w") is None


def test_workflow_records_follow_the_newest_call() -> None:
    now = [0.0]
    index = PrefixIndex(clock=lambda: now[0])
    index.apply("a", update("a", 1, calls=(WorkflowCall("w", "planner", (1, 2)),)))
    now[0] = 1.0
    index.apply("b", update("b", 1, calls=(WorkflowCall("w", "coder", (1, 2, 3)),)))
    record = index.workflow("w")
    assert record is not None and (record.replica, record.agent) == ("b", "coder")
    index.apply("a", update("a", 2, finished=("w",)))  # a's idle finish: not the newest call
    assert index.workflow("w") is not None
    # a full state of a repeats its old call: it must not take the workflow back
    index.apply("a", state("a", 2, workflows=(WorkflowCall("w", "planner", (1, 2)),)))
    assert index.workflow("w").replica == "b"  # type: ignore[union-attr]
    index.apply("b", update("b", 2, finished=("w",)))
    assert index.workflow("w") is None
    index.call("a", "v", "x", (7,))
    index.drop_replica("a")
    assert index.workflow("v") is None and "a" not in index.replicas


# ---- routers -----------------------------------------------------------------------------------


def test_round_robin_and_sticky() -> None:
    rr = RoundRobin()
    loads = {"a": 0.0, "b": 0.0, "c": 0.0}
    assert [rr.choose(RouteQuery("w"), loads).replica for _ in range(4)] == ["a", "b", "c", "a"]
    sticky = SessionSticky()
    first = {f"w{i}": sticky.choose(RouteQuery(f"w{i}"), loads).replica for i in range(200)}
    assert len(set(first.values())) == 3
    assert first == {w: sticky.choose(RouteQuery(w), loads).replica for w in first}
    # rendezvous hashing: removing c moves only c's workflows
    fewer = {"a": 0.0, "b": 0.0}
    for w, replica in first.items():
        if replica != "c":
            assert sticky.choose(RouteQuery(w), fewer).replica == replica
    with pytest.raises(NoReplicaError):
        rr.choose(RouteQuery("w"), {})


def test_prefix_aware_takes_the_longest_prefix_of_the_call() -> None:
    index = PrefixIndex()
    index.apply("a", state("a", 0, gpu=(1, 2)))
    index.apply("b", state("b", 0, gpu=(1, 2, 3)))
    router = PrefixAware(index)
    loads = {"a": 0.0, "b": 1.0, "c": 0.0}
    assert router.choose(RouteQuery("w", block_hashes=(1, 2, 3, 4)), loads) == Decision(
        "b", 3, "prefix"
    )
    assert router.choose(RouteQuery("w", block_hashes=(9,)), loads).reason == "least-loaded"
    assert router.choose(RouteQuery("w"), loads).replica in ("a", "c")
    busy = {"a": 1.0, "b": 10.0, "c": 1.0}  # b holds the most but is overloaded
    assert overloaded(busy) == {"b"}
    assert router.choose(RouteQuery("w", block_hashes=(1, 2, 3)), busy) == Decision("a", 2, "spill")


def test_workflow_aware_follows_the_transcript() -> None:
    index = PrefixIndex()
    prompt = tuple(range(100, 140))
    index.apply("a", state("a", 0, gpu=prompt[:10]))  # a shared system prompt
    index.apply("b", state("b", 0, gpu=prompt, workflows=(WorkflowCall("w", "planner", prompt),)))
    router = WorkflowAware(index)
    loads = {"a": 0.0, "b": 2.0, "c": 0.0}
    # another agent calls next: it carries the same transcript, so b still holds its prefix
    assert router.choose(RouteQuery("w", agent="coder"), loads) == Decision(
        "b", 40, "workflow-prefix"
    )
    assert router.stage_for("w", "coder", loads) == "b"
    # a new workflow goes to the least-loaded replica and stays there until the index sees it
    first = router.choose(RouteQuery("new"), loads)
    assert first.reason == "least-loaded" and first.replica in ("a", "c")
    assert router.choose(RouteQuery("new"), {**loads, first.replica: 1.0}) == Decision(
        first.replica, 0, "placed"
    )
    assert router.stage_for("new", None, loads) == first.replica
    assert router.stage_for("unknown", None, loads) is None
    # b overloaded: the next-best holder (a, the system prompt)
    assert router.choose(RouteQuery("w"), {"a": 1.0, "b": 12.0, "c": 1.0}) == Decision(
        "a", 10, "spill"
    )
    # the holder left the fleet (not a candidate): the record's prefix is nowhere else whole
    assert router.choose(RouteQuery("w"), {"a": 0.0, "c": 0.0}).replica == "a"


def test_workflow_aware_follows_the_agents_own_prompt() -> None:
    """Agents whose prompts start with their own system prompt (code-writing): the next call of
    an agent extends that agent's previous prompt in the workflow, not the workflow's last
    prompt; an agent's first call in a workflow goes where its system prompt is cached."""
    index = PrefixIndex()
    coder_sys, tester_sys = tuple(range(10)), tuple(range(50, 60))
    coder_w = coder_sys + tuple(range(200, 220))
    tester_w = tester_sys + tuple(range(300, 330))
    index.apply("a", state("a", 0, gpu=coder_w, workflows=(WorkflowCall("w", "coder", coder_w),)))
    index.apply("b", state("b", 0, gpu=tester_w))
    index.call("b", "w", "tester", tester_w)  # the workflow's last call: the tester's, on b
    router = WorkflowAware(index)
    loads = {"a": 0.0, "b": 0.0}
    assert router.choose(RouteQuery("w", agent="coder"), loads) == Decision(
        "a", 30, "workflow-prefix"
    )
    assert router.choose(RouteQuery("w", agent="tester"), loads).replica == "b"
    # the coder calls in a second workflow on b: what its prompts share is its system prompt
    index.call("b", "v", "coder", (*coder_sys, 999))
    index.stored("b", (*coder_sys, 999))
    assert index.agent_prefixes["coder"] == coder_sys
    # a third workflow, whose last call was the tester's (on b): the coder's first call there
    # re-sends only its system prompt, which a and b both hold: the less-loaded one
    index.call("b", "u", "tester", (*tester_sys, 7))
    assert router.choose(RouteQuery("u", agent="coder"), {"a": 0.0, "b": 1.0}) == Decision(
        "a", 10, "workflow-prefix"
    )


# ---- the feed, round-tripped -------------------------------------------------------------------


def random_events(rng: random.Random, n: int) -> list[Event]:
    """Block and request events over a small hash space, so stores, removes and clears of the
    same blocks interleave within one drain window."""
    events: list[Event] = []
    for i in range(n):
        roll = rng.random()
        hashes = tuple(rng.sample(range(60), rng.randint(1, 6)))
        tier: Tier = rng.choice(TIERS)
        if roll < 0.35:
            events.append(BlocksStored(ts=i, tier=tier, block_hashes=hashes))
        elif roll < 0.6:
            events.append(BlocksRemoved(ts=i, tier=tier, block_hashes=hashes))
        elif roll < 0.65:
            events.append(BlocksLoaded(ts=i, block_hashes=hashes))
        elif roll < 0.67:
            events.append(AllBlocksCleared(ts=i, tier=tier))
        elif roll < 0.85:
            wf = f"w{rng.randrange(8)}"
            agent = rng.choice(("planner", "coder", "critic"))
            events.append(
                RequestStarted(
                    ts=i, request_id=f"r{i}", workflow_id=wf, agent=agent, block_hashes=hashes
                )
            )
        elif roll < 0.95:
            events.append(RequestFinished(ts=i, request_id=f"r{rng.randrange(max(i, 1))}"))
        else:
            events.append(WorkflowFinished(ts=i, workflow_id=f"w{rng.randrange(8)}"))
    return events


def index_matches(index: PrefixIndex, feed: ResidencyFeed) -> None:
    truth = feed.state()
    view = index.replicas[feed.replica]
    assert view.gpu == set(truth.gpu)
    assert view.host == set(truth.host)
    assert view.running == truth.running
    held = {w: (r.agent, r.block_hashes) for w, r in index.workflows.items()}
    assert held == {c.workflow_id: (c.agent, c.block_hashes) for c in truth.workflows}


@pytest.mark.parametrize("seed", range(5))
def test_feed_updates_rebuild_the_feeds_state(seed: int) -> None:
    rng = random.Random(seed)
    feed = ResidencyFeed("r1", endpoint="http://r1:8000", epoch=1)
    index = PrefixIndex()
    index.apply("r1", decode(feed.full()))
    events = random_events(rng, 3000)
    at = 0
    while at < len(events):
        step = rng.randint(1, 60)
        if rng.random() < 0.5:
            feed.observe_all(events[at : at + step])
        else:
            for event in events[at : at + step]:
                feed.observe(event)
        at += step
        if rng.random() < 0.15:  # a full state between two drains (idempotent with the next)
            index.apply("r1", decode(feed.full()))
        frame = feed.drain()
        if frame is not None:
            assert index.apply("r1", decode(frame))
        index_matches(index, feed)
    assert not index.replicas["r1"].stale and index.replicas["r1"].gaps == 0
    assert index.replicas["r1"].endpoint == "http://r1:8000"
    fresh = PrefixIndex()  # a router that joins late converges on one full state
    fresh.apply("r1", decode(feed.full()))
    index_matches(fresh, feed)


def test_a_lost_update_is_detected_and_healed_by_a_full_state() -> None:
    feed = ResidencyFeed("r1", epoch=3)
    index = PrefixIndex()
    feed.observe(BlocksStored(ts=0, tier="gpu", block_hashes=(1, 2)))
    index.apply("r1", decode(feed.drain() or b""))
    feed.observe(BlocksStored(ts=1, tier="gpu", block_hashes=(3,)))
    feed.observe(BlocksRemoved(ts=1, tier="gpu", block_hashes=(1,)))
    assert feed.drain() is not None  # lost on the way
    feed.observe(BlocksStored(ts=2, tier="host", block_hashes=(1,)))
    index.apply("r1", decode(feed.drain() or b""))
    view = index.replicas["r1"]
    assert view.stale and view.gaps == 1  # seq 1 started the feed cleanly; seq 2 was lost
    assert view.gpu == {1, 2}  # wrong until healed
    assert feed.drain() is None  # nothing changed: no number used
    index.apply("r1", decode(feed.full()))
    assert not view.stale
    index_matches(index, feed)


def test_a_full_state_too_large_for_one_message_travels_in_parts() -> None:
    """A replica holding more blocks than a NATS message takes (1 MiB by default) sends its
    full state in parts, each under the limit; the index applies it once all parts are in,
    whatever their order, and drops the parts of a split a newer one replaced."""
    feed = ResidencyFeed("r1", epoch=7, endpoint="http://r1:8000")
    feed.observe(BlocksStored(ts=0, tier="gpu", block_hashes=tuple(range(30_000))))
    feed.observe(BlocksStored(ts=0, tier="host", block_hashes=tuple(range(50_000, 70_000))))
    for w in range(50):
        feed.observe(RequestStarted(ts=0, request_id=f"q{w}", workflow_id=f"w{w}", agent="a",
                                    block_hashes=tuple(range(w, w + 400))))  # fmt: skip
    frames = feed.full_parts(max_bytes=100_000)
    assert len(frames) > 2 and all(len(f) <= 100_000 for f in frames)
    assert len(feed.full_parts()) == 1  # under the default limit: one message
    parts = [decode(f) for f in frames]
    random.Random(3).shuffle(parts)
    index = PrefixIndex()
    stale = split_state(feed.state(), 3)[0]  # a part of an older split, never completed
    index.apply("r1", msgspec.structs.replace(stale, seq=stale.seq - 1))
    for part in parts[:-1]:
        index.apply("r1", part)
        assert index.replica("r1").gpu == set() and not index.workflows  # not yet
    index.apply("r1", parts[-1])
    index_matches(index, feed)
    assert join_parts(split_state(feed.state(), 5)).gpu == feed.state().gpu


def test_publisher_sends_updates_and_a_full_state_now_and_then() -> None:
    now = [0.0]
    feed = ResidencyFeed("r1", epoch=1)
    publish = ResidencyPublisher(feed, full_interval_s=3.0, clock=lambda: now[0])
    assert [type(decode(p)) for _, p in publish()] == [ResidencyState]
    feed.observe(BlocksStored(ts=0, tier="gpu", block_hashes=(1,)))
    now[0] = 1.0
    sent = publish()
    assert [(s, type(decode(p))) for s, p in sent] == [("agentkv.residency.r1", ResidencyUpdate)]
    now[0] = 3.5
    assert [type(decode(p)) for _, p in publish()] == [ResidencyState]
    with pytest.raises(ValueError):
        ResidencyFeed("a.b")


# ---- end to end: NATS, the route service, the proxy --------------------------------------------


class ThreadServer:
    """A FastAPI app served by uvicorn on a free loopback port, in a thread."""

    def __init__(self, app: FastAPI) -> None:
        sock = bind("127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
        self.thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [sock]}, daemon=True
        )
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started and time.monotonic() < deadline:
            time.sleep(0.01)
        assert self.server.started

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


def upstream(name: str) -> FastAPI:
    """A stand-in for a vLLM replica: echoes its name and the body it got."""
    app = FastAPI()

    async def answer(request: Request) -> Any:
        body = await request.json()
        if body.get("stream"):

            async def chunks() -> Any:
                for i in range(3):
                    yield f"data: {name}-{i}\n\n".encode()
                yield b"data: [DONE]\n\n"

            return StreamingResponse(chunks(), media_type="text/event-stream")
        return {"replica": name, "body": body}

    app.post("/v1/completions")(answer)
    app.post("/v1/chat/completions")(answer)
    return app


def publish(url: str, messages: list[tuple[str, bytes]]) -> None:
    async def send() -> None:
        nc = await nats.connect(url)
        for subj, payload in messages:
            await nc.publish(subj, payload)
        await nc.flush()
        await nc.close()

    asyncio.run(send())


def eventually(check: Any, timeout_s: float = 10.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return check()
        except AssertionError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def load_proxy() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "fleet_proxy", ROOT / "examples" / "fleet_proxy.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def nats_url(tmp_path: Path) -> Iterator[str]:
    with NatsCluster(tmp_path, nodes=1, jetstream=False) as cluster:
        yield cluster.url


def fleet_feeds(endpoints: dict[str, str]) -> dict[str, ResidencyFeed]:
    """Two replicas: r1 served workflow w1 (its prompt on GPU), r2 served w2 (on host)."""
    feeds = {name: ResidencyFeed(name, endpoint=url) for name, url in endpoints.items()}
    for name, wf, tier, blocks in (
        ("r1", "w1", "gpu", tuple(range(1000, 1040))),
        ("r2", "w2", "host", tuple(range(2000, 2030))),
    ):
        feeds[name].observe_all(
            [
                RequestStarted(
                    ts=1.0, request_id=f"{wf}-1", workflow_id=wf, agent="planner",
                    block_hashes=blocks,
                ),
                BlocksStored(ts=1.1, tier=tier, block_hashes=blocks),  # type: ignore[arg-type]
                RequestFinished(ts=2.0, request_id=f"{wf}-1"),
            ]
        )  # fmt: skip
    return feeds


def test_route_service_over_nats(nats_url: str) -> None:
    feeds = fleet_feeds({"r1": "http://r1:8000", "r2": "http://r2:8000"})
    with start_route_service([nats_url]) as service:
        client = RouteClient(service.url, timeout_s=2.0)
        eventually(lambda: httpx.get(f"{service.url}/healthz").json()["nats"] is True)
        # full states first, then an update: what a link sends
        publish(nats_url, [(subject(f.replica), f.full()) for f in feeds.values()])
        feeds["r2"].observe(RequestStarted(ts=3, request_id="x", workflow_id="w9", agent="a"))
        publish(
            nats_url,
            [(subject("r2"), feeds["r2"].drain() or b""), ("agentkv.residency.r3", b"junk")],
        )

        def routed() -> Decision:
            decision = client.route("w1", agent="coder")
            assert decision.replica == "r1"
            return decision

        decision = eventually(routed)
        assert decision == Decision("r1", 40, "workflow-prefix", "http://r1:8000", "r1")
        assert client.route("w2").replica == "r2"
        assert client.route("w2").prefix_blocks == 30  # host blocks count too
        # a new workflow: least loaded (r2 reports one running request)
        assert client.route("brand-new") == Decision(
            "r1", 0, "least-loaded", "http://r1:8000", "r1"
        )
        answer = httpx.get(f"{service.url}/route", params={"workflow_id": "w2", "next_agent": "c"})
        assert answer.json()["stage"] == "r2" and answer.json()["router"] == "workflow"
        replicas = {
            r["replica"]: r for r in httpx.get(f"{service.url}/replicas").json()["replicas"]
        }
        assert replicas["r1"]["gpu_blocks"] == 40 and replicas["r2"]["host_blocks"] == 30
        assert replicas["r2"]["seq"] == 1 and not replicas["r2"]["stale"]
        health = httpx.get(f"{service.url}/healthz").json()
        assert health["replicas"] == 2 and health["invalid"] == 1
        assert httpx.get(f"{service.url}/route").status_code == 422
        post = httpx.post(
            f"{service.url}/route", json={"workflow_id": "zz", "block_hashes": [2000, 2001]}
        )
        assert post.status_code == 200
    with pytest.raises(RouteUnavailableError):
        client.route("w1")


def test_route_service_says_503_without_replicas() -> None:
    with start_route_service(None) as service:
        assert httpx.get(f"{service.url}/route", params={"workflow_id": "w"}).status_code == 503
        assert httpx.get(f"{service.url}/healthz").json()["nats"] is None


def test_a_silent_replica_takes_no_calls() -> None:
    now = [0.0]
    route = RouteState("workflow", replica_ttl_s=5.0, forget_after_s=60.0, clock=lambda: now[0])
    for name in ("r1", "r2"):
        route.on_message(subject(name), ResidencyFeed(name, epoch=1).full())
    now[0] = 4.0
    route.on_message(subject("r2"), ResidencyFeed("r2", epoch=1).full())
    now[0] = 8.0
    assert route.loads() == {"r2": 0.0}
    assert route.route("w").replica == "r2"
    assert route.loads() == {"r2": 1.0}  # routed since its last report
    now[0] = 100.0
    route.live()
    assert set(route.index.replicas) == set()


def test_proxy_routes_by_the_index_and_falls_back(nats_url: str) -> None:
    proxy_module = load_proxy()
    ups = {name: ThreadServer(upstream(name)) for name in ("r1", "r2")}
    feeds = fleet_feeds({name: server.url for name, server in ups.items()})
    service = start_route_service([nats_url])
    proxy = ThreadServer(
        proxy_module.create_app(
            service.url, {n: s.url for n, s in ups.items()}, route_timeout_s=1.0
        )
    )
    try:
        eventually(lambda: httpx.get(f"{service.url}/healthz").json()["nats"] is True)
        publish(nats_url, [(subject(f.replica), f.full()) for f in feeds.values()])
        eventually(lambda: httpx.get(f"{service.url}/healthz").json()["replicas"] == 2)

        # w2 lives on r2: tagged by header, the body gains kv_transfer_params for the connector
        answer = httpx.post(
            f"{proxy.url}/v1/chat/completions",
            json={"model": "m", "messages": [{"role": "user", "content": "hi"}]},
            headers={"X-Workflow-Id": "w2", "X-Agent": "coder"},
        )
        assert answer.status_code == 200
        assert answer.json()["replica"] == "r2"
        assert answer.json()["body"]["kv_transfer_params"] == {
            "workflow_id": "w2",
            "agent": "coder",
        }
        assert answer.headers["x-agentkv-route"] == "workflow-prefix"
        # w1 lives on r1: tagged as the connector expects; streamed through
        body = {"model": "m", "prompt": "x", "stream": True,
                "kv_transfer_params": {"workflow_id": "w1", "agent": "planner"}}  # fmt: skip
        with httpx.stream("POST", f"{proxy.url}/v1/completions", json=body) as streamed:
            text = b"".join(streamed.iter_raw()).decode()
            assert streamed.headers["x-agentkv-replica"] == "r1"
        assert "r1-0" in text and "[DONE]" in text

        service.stop()  # the route service goes away: round-robin, never an error
        seen = set()
        for _ in range(4):
            answer = httpx.post(
                f"{proxy.url}/v1/completions",
                json={"model": "m", "prompt": "x", "metadata": {"workflow_id": "w1"}},
            )
            assert answer.status_code == 200
            assert answer.headers["x-agentkv-route"] == "fallback"
            seen.add(answer.json()["replica"])
        assert seen == {"r1", "r2"}

        ups["r1"].stop()  # a replica down: the next one takes the call
        for _ in range(2):
            answer = httpx.post(f"{proxy.url}/v1/completions", json={"prompt": "x"})
            assert answer.status_code == 200 and answer.json()["replica"] == "r2"
    finally:
        proxy.stop()
        service.stop()
        for server in ups.values():
            server.stop()


def test_proxy_reads_tags_as_the_connector_does() -> None:
    proxy_module = load_proxy()
    tags = proxy_module.call_tags
    assert tags({"kv_transfer_params": {"workflow_id": "a", "agent": "x"}}, {}) == ("a", "x")
    assert tags({}, {"x-workflow-id": "h", "x-agent": "y"}) == ("h", "y")
    assert tags({"extra_body": {"kv_transfer_params": {"workflow_id": "e"}}}, {}) == ("e", None)
    assert tags({"metadata": {"workflow_id": "m", "agent": "z"}}, {}) == ("m", "z")
    assert tags({"session_id": "s"}, {}) == ("s", None)
    assert tags({}, {"x-session-id": "s2"}) == ("s2", None)
    assert tags({"kv_transfer_params": "bad"}, {}) == (None, None)
