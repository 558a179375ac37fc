"""The connector's deferred work: jobs off vLLM's thread, in order, never failing the caller."""

from __future__ import annotations

import random
import sys
import threading
from collections.abc import Iterator, Sequence

import pytest

from connector.deferred import Deferred, immediate
from connector.runtime import ConnectorRuntime
from policyd.core.types import Event
from policyd.tiers.view import Ownership
from tests.peers import wait_for
from tests.test_connector import ReferenceOwnership, digests


class ListSink:
    def __init__(self) -> None:
        self.events: list[Event] = []

    def send_many(self, events: Sequence[Event]) -> int:
        self.events.extend(events)
        return len(events)


def test_jobs_run_in_order_off_the_callers_thread_and_a_failure_loses_only_itself() -> None:
    worker = Deferred()
    seen: list[tuple[int, str]] = []

    def job(i: int) -> None:
        if i == 3:
            raise RuntimeError("a bad job")
        seen.append((i, threading.current_thread().name))

    for i in range(100):
        worker.submit(lambda i=i: job(i))  # type: ignore[misc]
    assert worker.flush(10.0)
    worker.close()
    assert [i for i, _ in seen] == [i for i in range(100) if i != 3]
    assert {name for _, name in seen} == {"agentkv-deferred"}
    assert (worker.done, worker.failed, worker.dropped) == (100, 1, 0)


def test_a_full_queue_drops_without_blocking_and_close_runs_what_is_queued() -> None:
    gate = threading.Event()
    worker = Deferred(max_jobs=4)
    ran: list[int] = []

    def hold() -> None:  # keeps the worker busy until released
        gate.wait()

    worker.submit(hold)
    assert wait_for(lambda: not worker._jobs)
    for i in range(10):
        worker.submit(lambda i=i: ran.append(i))  # type: ignore[misc]
    assert worker.dropped == 6
    gate.set()
    worker.close()
    assert ran == [0, 1, 2, 3]
    worker.submit(lambda: ran.append(99))  # after close: dropped, not run
    assert worker.dropped == 7 and ran == [0, 1, 2, 3]


def _lifecycle(rt: ConnectorRuntime) -> None:
    for i in range(20):
        wf = f"w{i % 3}"
        params = {"workflow_id": wf, "agent": "a"}
        rt.request_started(f"r{i}", params, None, digests(1, 2, i + 10), 96)
        rt.lookup_done(f"r{i}", gpu_tokens=32 * (i % 3), host_tokens=0)
        rt.allocated(f"r{i}")
        rt.host_stored(digests(i + 10))
        if i % 4 == 0:
            rt.host_loaded(digests(1), f"r{i}")
            rt.gpu_removed([i + 10])
        rt.request_finished(f"r{i}", output_tokens=2)


def test_the_runtime_on_a_deferred_thread_emits_what_it_emits_at_once() -> None:
    """Events, their order and the counters are the same whether the bookkeeping runs at once
    or on the deferred thread (timestamps aside: both take them on the caller's thread)."""
    at_once, later = ListSink(), ListSink()
    rt_now = ConnectorRuntime(at_once, lambda: None, tokens_per_block=32, clock=lambda: 0.0)
    worker = Deferred()
    rt_later = ConnectorRuntime(
        later, lambda: None, tokens_per_block=32, clock=lambda: 0.0, defer=worker.submit
    )
    remembered: list[tuple[int, ...]] = []
    rt_later.remember = lambda _digests, blocks: remembered.append(tuple(blocks))
    _lifecycle(rt_now)
    _lifecycle(rt_later)
    assert worker.flush(10.0)
    worker.close()
    assert later.events == at_once.events
    assert rt_later.counters == rt_now.counters
    assert len(remembered) == 20 and remembered[0] == (1, 2, 10)
    assert worker.failed == 0


def test_a_request_is_tracked_before_its_deferred_job_runs() -> None:
    """vLLM's thread needs no deferred result: the write filter's lookup works before the
    request's ``started`` job has run (its wire hashes are computed on the spot if needed)."""
    jobs: list[object] = []
    rt = ConnectorRuntime(ListSink(), lambda: None, tokens_per_block=32, defer=jobs.append)
    rt.request_started("r", {"workflow_id": "w"}, None, digests(1, 2, 3), 96)
    rt.lookup_done("r", gpu_tokens=32, host_tokens=0)
    rt.allocated("r")
    assert rt.may_store("r") and rt.tags("r") is None and len(jobs) == 2
    for job in jobs:
        assert callable(job)
        job()
    tags = rt.tags("r")
    assert tags is not None and tags.workflow_id == "w"


@pytest.fixture
def fast_switching() -> Iterator[None]:
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # threads switch between almost every bytecode
    yield
    sys.setswitchinterval(old)


def test_ownership_recorded_on_one_thread_and_recounted_on_another_stays_exact(
    fast_switching: None,
) -> None:
    """The connector records requests on its deferred thread while vLLM's thread recounts the
    retired set: once both are done, the set is the definition's."""
    rng = random.Random(7)
    ops = [(f"w{rng.randrange(6)}", [rng.randrange(40) for _ in range(12)]) for _ in range(3000)]
    lists = [frozenset(f"w{i}" for i in range(6) if rng.random() < 0.5) for _ in range(400)]
    own = Ownership(max_workflows=4)

    def records() -> None:
        for wf, blocks in ops:
            own.record(wf, blocks)

    recorder = threading.Thread(target=records)
    recorder.start()
    i = 0
    while recorder.is_alive() or i < len(lists):
        for _ in own.retire(lists[i % len(lists)]).work:
            pass
        i += 1
    recorder.join()
    reference = ReferenceOwnership()
    for wf, blocks in ops:
        reference.record(wf, blocks)
    final = lists[(i - 1) % len(lists)]
    assert set(own.retired_blocks(final)) == reference.retired(final)


def test_immediate_runs_on_the_callers_thread() -> None:
    ran: list[str] = []
    immediate(lambda: ran.append(threading.current_thread().name))
    assert ran == [threading.current_thread().name]


def test_release_frees_a_list_on_the_deferred_thread() -> None:
    worker = Deferred()
    rt = ConnectorRuntime(ListSink(), lambda: None, tokens_per_block=32, defer=worker.submit)
    heap = [(i, str(i)) for i in range(10_000)]
    rt.release(heap)
    assert worker.flush(10.0)
    worker.close()
    assert heap == [] and worker.failed == 0
