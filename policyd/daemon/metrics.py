"""Prometheus metrics from the daemon's own ``CollectorRegistry`` (never the global one, so two
daemons in one test process do not collide). Counters are read from the service's stats at
scrape time - one source of truth for /api/stats and /metrics; decision latency is a histogram
the API observes."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

Stats = Callable[[], Mapping[str, Any]]


def _num(value: object) -> float:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else 0.0


class _StatsCollector(Collector):
    def __init__(self, stats: Stats) -> None:
        self._stats = stats

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        s = self._stats()
        counters = {
            "events": "Events applied to the Engine.",
            "events_received": "Events in decoded frames (applied or shed).",
            "events_shed": "Block stores (Stored / Loaded events) sampled away under overload.",
            "block_events_received": "Block events received (hashes named by block-level events).",
            "block_events_applied": "Block events applied to the Engine (after shedding).",
            "block_events_shed": "Block events sampled away under overload (N per store of N).",
            "frames": "Event frames received.",
            "frames_dropped": "Frames cut past the queue's hard bound (closing events kept).",
            "frames_dropped_undecoded": "Of them, frames dropped whole, undecoded, past the "
            "last resort (their events are not counted).",
            "events_dropped": "Request-level events dropped past the hard bound (not shed).",
            "receiver_waits": "Times the receiver found the ingest queue full and stopped reading.",
            "receiver_wait_s": "Seconds the receiver waited for room (frames left at the senders).",
            "malformed_frames": "Event frames rejected as malformed.",
            "seq_gaps": "Batch sequence gaps over all sources.",
            "seq_duplicates": "Batches repeating their source's last sequence number (dropped).",
            "seq_regressions": "Batches behind their source's last sequence number (dropped).",
            "seq_restarts": "Sources whose sequence numbers started over at 0 or 1.",
            "sources_forgotten": "Sources dropped from the bounded per-source sequence table.",
            "requests_expired": "Requests finished by the daemon after request_timeout_s.",
            "requests_evicted": "Running requests past max_running_requests, finished.",
            "workflows_evicted": "Active workflows past max_active_workflows, finished.",
            "oversize_frames": "Event frames over max_frame_bytes (counted in malformed_frames).",
            "connections_closed": "Sender connections closed (by the sender, or by ZeroMQ for a "
            "frame over its transport cap).",
            "events_invalid": "Events out of their schema's ranges, dropped.",
            "requests": "Requests started.",
            "prompt_blocks": "Prompt blocks over all prefix-hit reports.",
            "write_declined_blocks": "Blocks declined by the daemon's admission decisions.",
        }
        for key, text in counters.items():
            yield CounterMetricFamily(f"policyd_{key}", text, value=_num(s.get(key)))
        invalid = CounterMetricFamily(
            "policyd_events_invalid_by_reason",
            "Events out of their schema's ranges, dropped, by reason.",
            labels=["reason"],
        )
        for reason, n in sorted(s.get("events_invalid_by_reason", {}).items()):
            invalid.add_metric([reason], _num(n))
        yield invalid
        hits = CounterMetricFamily(
            "policyd_hit_blocks", "Prompt blocks served per tier.", labels=["tier"]
        )
        hits.add_metric(["gpu"], _num(s.get("gpu_hit_blocks")))
        hits.add_metric(["host"], _num(s.get("host_hit_blocks")))
        hits.add_metric(["recomputed"], _num(s.get("recomputed_blocks")))
        yield hits
        host = CounterMetricFamily(
            "policyd_host_bytes", "Bytes written to / loaded from the host tier.",
            labels=["direction"],
        )  # fmt: skip
        host.add_metric(["written"], _num(s.get("host_written_bytes")))
        host.add_metric(["loaded"], _num(s.get("host_loaded_bytes")))
        yield host
        decisions = CounterMetricFamily(
            "policyd_decisions", "Decisions recorded, by kind.", labels=["kind"]
        )
        for kind, n in sorted(s.get("decisions_by_kind", {}).items()):
            decisions.add_metric([kind], _num(n))
        yield decisions
        gauges = {
            "ingest_queue_frames": "Batches waiting for the engine worker.",
            "ingest_queue_depth": "Queue depth in frames of up to 256 events or block events.",
            "workflows_active": "Workflows not finished.",
            "shed_rate": "Share of received events shed whole (cumulative).",
            "block_shed_rate": "Share of received block events shed (cumulative).",
            "uptime_s": "Seconds since the daemon started.",
        }
        for key, text in gauges.items():
            yield GaugeMetricFamily(f"policyd_{key}", text, value=_num(s.get(key)))
        snap = s.get("snapshot", {})
        yield GaugeMetricFamily(
            "policyd_snapshot_version", "Version of the last published snapshot.",
            value=_num(snap.get("version")),
        )  # fmt: skip
        yield GaugeMetricFamily(
            "policyd_snapshot_age_seconds", "Age of the last published snapshot.",
            value=_num(snap.get("age_s")),
        )  # fmt: skip
        acc = GaugeMetricFamily(
            "policyd_prediction_accuracy", "Rolling top-1 next-agent accuracy per step.",
            labels=["step"],
        )  # fmt: skip
        for step, value in sorted(s.get("prediction_accuracy", {}).items()):
            if value is not None:
                acc.add_metric([str(step)], _num(value))
        yield acc
        yield GaugeMetricFamily(
            "policyd_recommended_host_gib", "Host-tier size recommended by the online MRC.",
            value=_num(s.get("recommended_host_gib")),
        )  # fmt: skip
        history = s.get("history", {})
        written = CounterMetricFamily(
            "policyd_history_rows_written", "History rows written.", labels=["table"]
        )
        for table, n in sorted(history.get("rows_written", {}).items()):
            written.add_metric([table], _num(n))
        yield written
        yield CounterMetricFamily(
            "policyd_history_rows_dropped", "History rows dropped (queue full).",
            value=_num(history.get("rows_dropped")),
        )  # fmt: skip
        yield GaugeMetricFamily(
            "policyd_history_block_sample_rate",
            "Share of block rows the history keeps now (lowered while its writer is behind).",
            value=_num(history.get("block_sample_rate")),
        )
        yield CounterMetricFamily(
            "policyd_history_deferrals",
            "Event batches the history writer stepped aside before, the Engine being behind.",
            value=_num(history.get("deferrals")),
        )


class Metrics:
    """The registry and the histogram the API feeds."""

    def __init__(self, stats: Stats) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_StatsCollector(stats))
        self.decision_latency = Histogram(
            "policyd_decision_latency_seconds",
            "Time to answer a synchronous decision request.",
            ["route"],
            registry=self.registry,
            buckets=(0.0001, 0.0003, 0.001, 0.003, 0.01, 0.03, 0.1, 0.3, 1.0),
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)
