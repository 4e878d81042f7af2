"""Prometheus metrics (supervisor process): a small registry and the text exposition format.

Workers report their compute time per block in their replies; the supervisor observes the
rest (queueing, encoding, delivery). `render` adds the live gauges (sessions, queue depths, ring
slots, worker health) at scrape time.
"""

from __future__ import annotations

import bisect
import math
from collections import defaultdict

LATENCY_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class Histogram:
    def __init__(self, name: str, help: str, buckets=LATENCY_BUCKETS_S, labels: tuple[str, ...] = ()) -> None:
        self.name, self.help, self.buckets, self.label_names = name, help, tuple(buckets), labels
        self.series: dict[tuple, list] = defaultdict(lambda: [[0] * (len(self.buckets) + 1), 0.0, 0])

    def observe(self, value: float, *labels: str) -> None:
        counts, _, _ = s = self.series[labels]
        counts[bisect.bisect_left(self.buckets, value)] += 1
        s[1] += value
        s[2] += 1

    def render(self) -> list[str]:
        out = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]
        for labels, (counts, total, n) in sorted(self.series.items()):
            base = ",".join(f'{k}="{v}"' for k, v in zip(self.label_names, labels))
            sep = "," if base else ""
            acc = 0
            for b, c in zip((*self.buckets, math.inf), counts):
                acc += c
                le = "+Inf" if b == math.inf else f"{b:g}"
                out.append(f'{self.name}_bucket{{{base}{sep}le="{le}"}} {acc}')
            lab = f"{{{base}}}" if base else ""
            out += [f"{self.name}_sum{lab} {total:.6f}", f"{self.name}_count{lab} {n}"]
        return out


class Counter:
    def __init__(self, name: str, help: str, labels: tuple[str, ...] = ()) -> None:
        self.name, self.help, self.label_names = name, help, labels
        self.values: dict[tuple, float] = defaultdict(float)

    def inc(self, amount: float = 1.0, *labels: str) -> None:
        self.values[labels] += amount

    def render(self) -> list[str]:
        out = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} counter"]
        for labels, v in sorted(self.values.items()):
            lab = ",".join(f'{k}="{x}"' for k, x in zip(self.label_names, labels))
            out.append(f"{self.name}{{{lab}}} {v:g}" if lab else f"{self.name} {v:g}")
        if not self.values and not self.label_names:
            out.append(f"{self.name} 0")
        return out


class Metrics:
    def __init__(self) -> None:
        self.stage_seconds = Histogram(
            "streamdiff_stage_block_seconds", "Compute time of one block in a pipeline stage", labels=("stage",)
        )
        self.queue_seconds = Histogram("streamdiff_session_queue_seconds", "Time a session waited for admission")
        self.ttff_seconds = Histogram(
            "streamdiff_time_to_first_fragment_seconds", "From request to the first fragment of a session"
        )
        self.fragment_interval_seconds = Histogram(
            "streamdiff_fragment_interval_seconds", "Time between consecutive fragments of a session"
        )
        self.frames = Counter("streamdiff_frames_total", "Video frames streamed")
        self.fragments = Counter("streamdiff_fragments_total", "CMAF fragments streamed")
        self.stalls = Counter(
            "streamdiff_stalls_total", "Fragments that arrived after real-time playback would have needed them"
        )
        self.stall_seconds = Counter("streamdiff_stall_seconds_total", "Playback time lost to stalls")
        self.sessions = Counter("streamdiff_sessions_total", "Sessions that ended, by outcome", labels=("outcome",))
        self.requests = Counter("streamdiff_http_requests_total", "HTTP requests by status class", labels=("status",))

    def all(self):
        return [
            self.stage_seconds,
            self.queue_seconds,
            self.ttff_seconds,
            self.fragment_interval_seconds,
            self.frames,
            self.fragments,
            self.stalls,
            self.stall_seconds,
            self.sessions,
            self.requests,
        ]


def _gauge(name: str, help: str, series) -> list[str]:
    """series: a number, or a list of (labels dict, value)."""
    if not isinstance(series, list):
        series = [({}, series)]
    out = [f"# HELP {name} {help}", f"# TYPE {name} gauge"]
    for labels, value in series:
        lab = "{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}" if labels else ""
        out.append(f"{name}{lab} {value:g}")
    return out


def render(supervisor, jobs) -> bytes:
    lines: list[str] = []
    sched = supervisor.scheduler
    if sched is not None:
        for metric in sched.metrics.all():
            lines += metric.render()
        snap = sched.snapshot()
        lines += _gauge("streamdiff_sessions_active", "Sessions generating now", snap["running"])
        lines += _gauge("streamdiff_sessions_queued", "Sessions waiting for admission", snap["queued"])
        lines += _gauge("streamdiff_decode_queue_depth", "Latent blocks waiting for a frame slot", snap["decode_wait"])
        lines += _gauge("streamdiff_latent_slots_used", "Latent ring slots in use", snap["latent_slots_used"])
        lines += _gauge("streamdiff_frame_slots_used", "Frame ring slots in use", snap["frame_slots_used"])
        lines += _gauge(
            "streamdiff_stage_busy_seconds",
            "Summed compute time per stage",
            [({"stage": k}, ms / 1000) for k, ms in sched.stage_ms.items()],
        )
    if supervisor.pool is not None:
        workers = supervisor.pool.workers
        lines += _gauge(
            "streamdiff_worker_up",
            "1 if the worker is ready",
            [({"worker": n}, 1 if w.ready else 0) for n, w in workers.items()],
        )
        lines += _gauge(
            "streamdiff_worker_restarts",
            "Times the worker was restarted",
            [({"worker": n}, w.restarts) for n, w in workers.items()],
        )
    lines += _gauge("streamdiff_jobs", "Jobs known to the API", len(jobs.jobs))
    return ("\n".join(lines) + "\n").encode()
