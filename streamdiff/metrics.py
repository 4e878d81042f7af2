"""Prometheus metrics (supervisor process), with prometheus_client.

Each daemon has its own registry (not the library's global one: tests run several in one
process). Workers report their compute time per block in their replies; the supervisor observes
the rest (queueing, encoding, delivery). The live gauges (sessions, queue depths, ring slots,
worker health) are read from the supervisor at scrape time by a collector.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily

LATENCY_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
LOOP_LAG_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r, b = self.registry, LATENCY_BUCKETS_S
        self.stage_seconds = Histogram(
            "streamdiff_stage_block_seconds",
            "Compute time of one block in a pipeline stage",
            ["stage"],
            buckets=b,
            registry=r,
        )
        self.queue_seconds = Histogram(
            "streamdiff_session_queue_seconds", "Time a session waited for admission", buckets=b, registry=r
        )
        self.ttff_seconds = Histogram(
            "streamdiff_time_to_first_fragment_seconds",
            "From request to the first fragment of a session",
            buckets=b,
            registry=r,
        )
        self.fragment_interval_seconds = Histogram(
            "streamdiff_fragment_interval_seconds",
            "Time between consecutive fragments of a session",
            buckets=b,
            registry=r,
        )
        self.frames = Counter("streamdiff_frames", "Video frames streamed", registry=r)
        self.fragments = Counter("streamdiff_fragments", "CMAF fragments streamed", registry=r)
        self.stalls = Counter(
            "streamdiff_stalls", "Fragments that arrived after real-time playback would have needed them", registry=r
        )
        self.stall_seconds = Counter("streamdiff_stall_seconds", "Playback time lost to stalls", registry=r)
        self.block_cost_ratio = Histogram(
            "streamdiff_block_cost_ratio",
            "A block's measured compute time over the capacity model's prediction for it",
            ["stage"],
            buckets=(0.25, 0.5, 0.67, 0.8, 0.9, 1.0, 1.1, 1.25, 1.5, 2.0, 4.0),
            registry=r,
        )
        self.scheduler_seconds = Counter(
            "streamdiff_scheduler_seconds", "Time the scheduler spent deciding (its handlers)", registry=r
        )
        self.dit_batched_blocks = Counter(
            "streamdiff_dit_batched_blocks",
            "DiT blocks computed, by how many ran in one forward",
            ["batch"],
            registry=r,
        )
        self.vae_batched_blocks = Counter(
            "streamdiff_vae_batched_blocks",
            "VAE blocks decoded, by how many ran in one call",
            ["batch"],
            registry=r,
        )
        self.sessions = Counter("streamdiff_sessions", "Sessions that ended, by outcome", ["outcome"], registry=r)
        self.requests = Counter("streamdiff_http_requests", "HTTP requests by status class", ["status"], registry=r)
        self.loop_lag_seconds = Histogram(
            "streamdiff_event_loop_lag_seconds",
            "How late the supervisor's event loop ran a timer (every LAG_PROBE_S): what one handler held it",
            buckets=LOOP_LAG_BUCKETS_S,
            registry=r,
        )
        self.loop_lag_max_s = 0.0  # the longest since the start (a gauge at scrape time)

    def observe_loop_lag(self, lag_s: float) -> None:
        self.loop_lag_seconds.observe(lag_s)
        self.loop_lag_max_s = max(self.loop_lag_max_s, lag_s)

    def watch(self, supervisor, jobs) -> None:
        """Add the gauges read from the running daemon at each scrape."""
        self.registry.register(_Live(supervisor, jobs))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _Live:
    """Gauges computed at scrape time (a prometheus_client custom collector)."""

    def __init__(self, supervisor, jobs) -> None:
        self.sup, self.jobs = supervisor, jobs

    def describe(self):
        return []  # collected live: nothing to declare up front

    def collect(self):
        def gauge(name: str, help: str, value=None, label: str | None = None, series=()):
            g = GaugeMetricFamily(name, help, labels=[label] if label else None)
            if label:
                for key, v in series:
                    g.add_metric([key], v)
            else:
                g.add_metric([], value)
            return g

        sched = self.sup.scheduler
        if sched is not None:
            snap = sched.snapshot()
            yield gauge("streamdiff_sessions_active", "Sessions generating now", snap["running"])
            yield gauge("streamdiff_sessions_queued", "Sessions waiting for admission", snap["queued"])
            yield gauge("streamdiff_decode_queue_depth", "Latent blocks waiting for a frame slot", snap["decode_wait"])
            yield gauge("streamdiff_latent_slots_used", "Latent ring slots in use", snap["latent_slots_used"])
            yield gauge("streamdiff_frame_slots_used", "Frame ring slots in use", snap["frame_slots_used"])
            yield gauge(
                "streamdiff_stage_busy_seconds",
                "Summed compute time per stage",
                label="stage",
                series=[(k, ms / 1000) for k, ms in sched.meters.stage_ms.items()],
            )
        if self.sup.pool is not None:
            workers = self.sup.pool.workers
            yield gauge(
                "streamdiff_worker_up",
                "1 if the worker is ready",
                label="worker",
                series=[(n, 1 if w.ready else 0) for n, w in workers.items()],
            )
            yield gauge(
                "streamdiff_worker_borrowed_seconds",
                "Seconds the worker ran on waiting workers' cores too (--share-cores)",
                label="worker",
                series=[(n, w.borrowed_s) for n, w in workers.items()],
            )
            yield gauge(
                "streamdiff_worker_restarts",
                "Times the worker was restarted",
                label="worker",
                series=[(n, w.restarts) for n, w in workers.items()],
            )
        yield gauge("streamdiff_jobs", "Jobs known to the API", len(self.jobs.jobs))
        if sched is not None:
            yield gauge(
                "streamdiff_event_loop_lag_max_seconds",
                "The longest the supervisor's event loop ran a timer late since the start",
                sched.meters.metrics.loop_lag_max_s,
            )
