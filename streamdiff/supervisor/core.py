"""The supervisor: owns the rings, the worker pool, the scheduler and the control socket
(supervisor process; asyncio, never imports torch, never touches an accelerator).

Start-up: sweep segments left by a killed instance, create the latent and frame rings, bind a
ZeroMQ ROUTER socket, spawn the workers and wait for every READY (or fail fast with the first
worker's reason). Then one task reads the control socket and dispatches each message to its
handler, and one task watches heartbeats. Shutdown is an explicit state: RUNNING -> DRAINING
(no new sessions; running streams may finish until a deadline) -> STOPPING (cancel the rest,
stop the workers: ask, wait, kill) -> STOPPED (rings unlinked, runtime directory removed).
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import shutil
import tempfile
import time

import zmq
import zmq.asyncio

from ..card import PLANNED_FIELDS, ModelCard
from ..config import Config, ConfigError
from ..controls import SPACES, Timeline
from ..ipc import messages as m
from ..ipc import sockets
from ..ipc.shm import Ring, SharedMemoryFull, create_rings, sweep_stale
from ..plan import plan_blocks
from ..platform.cpu_lending import HostSlot
from . import scheduler as sch
from .driver import Driver
from .handle import SessionHandle
from .scheduler import Scheduler, Session
from .topology import Topology, build_topology, model_card
from .workers import WorkerPool

log = logging.getLogger("streamdiff.supervisor")
LAG_PROBE_S = 0.05  # the event-loop lag probe's period (/metrics: streamdiff_event_loop_lag_seconds)

STARTING, RUNNING, DRAINING, STOPPING, STOPPED = "starting", "running", "draining", "stopping", "stopped"


def runtime_base() -> str:
    """Where the control socket lives: systemd's RuntimeDirectory when set, else the temp dir."""
    base = os.environ.get("RUNTIME_DIRECTORY", "").split(":")[0]
    return base if base and os.path.isdir(base) else tempfile.gettempdir()


class Supervisor:
    def __init__(self, cfg: Config, placement=None) -> None:
        self.cfg = cfg
        self.placement = placement  # placement.auto.Placement: the layout and why
        self.state = STARTING
        self.card = model_card(cfg)  # the preset's until the DiT workers report the model they loaded
        self.loaded: dict | None = None  # what they loaded: checkpoint, weight set, LoRA, sampler, compile
        self.runtime_dir: str | None = None
        self.latent_ring: Ring | None = None
        self.frame_ring: Ring | None = None
        self.pool: WorkerPool | None = None
        self.scheduler: Scheduler | None = None
        self.driver: Driver | None = None
        self.host_gate: HostSlot | None = None  # CPU shared cores: the encoders' byte in the ledger
        self.topology: Topology | None = None
        self._ctx: zmq.asyncio.Context | None = None
        self._router: zmq.asyncio.Socket | None = None  # recv_from_workers
        self._send_sock: zmq.Socket | None = None
        self._tasks: list[asyncio.Task] = []
        self.loop_alive: dict[str, float] = {}  # task -> last time it went round (for /health)
        self.started_at = time.time()
        self._vae_cfg = None  # the preset's decoder shape (vae_shapes.DecoderShape), for the cut's activations

    # -- start --------------------------------------------------------------------------------
    def _ring_sizes(self) -> tuple[int, int]:
        c, lim, t = self.card, self.cfg.limits, self.cfg.topology
        sf, fpb = c.spatial_factor, c.frames_per_block
        h, w = lim.max_height // sf, lim.max_width // sf
        latent = c.latent_channels * fpb * h * w * 4
        if t.vae_cut:  # the latent slot carries the first stages' output; an adapting cut's one stage further too
            cuts = range(1, min(t.vae_cut + 1, len(self._stage_shapes(fpb, h, w)) - 1) + 1) if t.vae_cut_adapt else ()
            latent = max(latent, *(4 * math.prod(self._cut_shape(c, fpb, h, w)) for c in (t.vae_cut, *cuts)))
        frames = fpb * c.temporal_factor * lim.max_height * lim.max_width * 3
        return latent, frames

    def _stage_shapes(self, frames: int, h: int, w: int) -> list[tuple[int, ...]]:
        """What each decoder stage makes of a block (the preset's VAE config: the one written next
        to the weights, else the release's, read once in a child; the DiT worker checks each block)."""
        from ..models.wan.vae_shapes import decoder_shape, stage_shapes
        from .topology import model_spec

        if self._vae_cfg is None:
            self._vae_cfg = decoder_shape(model_spec(self.cfg))
        return stage_shapes(self._vae_cfg, frames, h, w)

    def _cut_shape(self, cut: int, frames: int, h: int, w: int) -> tuple[int, ...]:
        shapes = self._stage_shapes(frames, h, w)
        if cut >= len(shapes):
            raise ConfigError(
                f"topology.vae_cut: this VAE decoder has {len(shapes)} stages; a cut is 1-{len(shapes) - 1}, got {cut}"
            )
        return shapes[cut - 1]

    def _cut_fits(self, slot_bytes: int):
        """supervisor/cut.py's test of a cut at a block's size: its activation fits a latent slot."""

        def fits(cut: int, latent_hw: tuple[int, int], frames: int) -> bool:
            shapes = self._stage_shapes(frames, *latent_hw)
            return cut < len(shapes) and 4 * math.prod(shapes[cut - 1]) <= slot_bytes

        return fits

    async def start(self) -> None:
        instance = self.cfg.server.instance
        removed = sweep_stale(instance)
        if removed:
            log.warning(
                "removed %d shared-memory segment(s) left by a dead instance: %s", len(removed), ", ".join(removed)
            )
        base = runtime_base()
        self._sweep_runtime_dirs(base, instance)
        self.runtime_dir = tempfile.mkdtemp(prefix=f"sd-{instance}-{os.getpid()}-", dir=base)
        latent_bytes, frame_bytes = self._ring_sizes()
        p = self.cfg.pipeline
        try:
            rings = create_rings(
                instance, {"latent": (p.latent_slots, latent_bytes), "frames": (p.frame_slots, frame_bytes)}
            )
        except SharedMemoryFull as exc:
            lim = self.cfg.limits
            raise ConfigError(
                f"{exc.strerror}; or reserve less: the rings hold pipeline.latent_slots = {p.latent_slots} and "
                f"pipeline.frame_slots = {p.frame_slots} blocks of the largest size accepted, "
                f"limits.max_width x max_height = {lim.max_width}x{lim.max_height}"
            ) from None
        self.latent_ring, self.frame_ring = rings["latent"], rings["frames"]
        self._ctx = zmq.asyncio.Context()
        addr = f"ipc://{self.runtime_dir}/control"
        self._router = sockets.router(self._ctx, addr)  # recv_from_workers / send_to_workers
        self._send_sock = zmq.Socket.shadow(self._router.underlying)  # send_to_workers
        self.topology = build_topology(self.cfg, addr, self.latent_ring.spec, self.frame_ring.spec, self.runtime_dir)
        self.pool = WorkerPool(
            self.topology,
            self._send,
            p.heartbeat_timeout_s,
            p.block_timeout_s,
            p.restart_workers,
            p.ready_timeout_s,
            p.restart_backoff_reset_s,
        )
        self.scheduler = Scheduler(
            self.cfg,
            self.topology,
            p.latent_slots,
            p.frame_slots,
            self.card,
            self._cut_fits(self.latent_ring.spec.slot_bytes),
        )
        host = self.topology.host_lend
        self.host_gate = HostSlot(host) if host else None
        self.driver = driver = Driver(
            self.cfg, self.scheduler, self._send, self.pool.ready_workers, self.frame_ring, self.host_gate
        )
        self.pool.on_lost = lambda names, why: driver.post(sch.WorkersLost(frozenset(names), why))
        self.pool.on_worker_ready = lambda name: driver.post(sch.WorkerReady(name, self.pool.workers[name].info))
        self.pool.on_idle = lambda name, since: driver.post(sch.WorkerIdle(name, since))
        self._tasks.append(asyncio.create_task(self._recv_loop(), name="control-recv"))
        self._tasks.append(asyncio.create_task(self._lag_loop(), name="loop-lag"))
        self.pool.spawn_all()
        self._pin_self()
        try:
            await self.pool.wait_ready(p.ready_timeout_s)
        except Exception:
            await self.close()
            raise
        self._check_card()
        await asyncio.get_running_loop().run_in_executor(None, self._probe_encoder)
        self._tasks.append(asyncio.create_task(self._monitor_loop(), name="monitor"))
        self.state = RUNNING
        log.info(
            "pipeline up: %s mode, %d DiT worker(s), VAE groups %s, on %s",
            self.cfg.topology.mode,
            len(self.topology.dit_workers),
            self.topology.vae_groups,
            self.cfg.topology.device,
        )

    def _pin_self(self) -> None:
        """On the CPU, keep the supervisor (HTTP, encoding) off the VAE's cores: share the DiT
        workers' cores instead. The VAE is the slower stage; the DiT has slack to give."""
        if self.cfg.topology.device != "cpu" or not self.cfg.topology.pin_cpus:
            return
        cpus = {c for w in self.topology.workers if "dit" in w.roles for c in w.cpus}
        if cpus and hasattr(os, "sched_setaffinity"):
            try:
                os.sched_setaffinity(0, cpus)
            except OSError:
                pass

    def _check_card(self) -> None:
        infos = {name: w.info for name, w in self.pool.workers.items()}
        self.card, self.loaded = loaded_model(self.card, infos)
        if self.loaded is not None:
            log.info("model: %s", describe_loaded(self.loaded))

    def _probe_encoder(self) -> None:
        from ..media.encoder import HW_ENCODERS, hardware_available

        kind = self.cfg.encoder.kind
        if kind in HW_ENCODERS or kind == "auto":
            for codec in HW_ENCODERS if kind == "auto" else (kind,):
                hardware_available(codec, self.cfg.encoder.vaapi_device)

    @staticmethod
    def _sweep_runtime_dirs(tmp: str, instance: str) -> None:
        prefix = f"sd-{instance}-"
        for name in os.listdir(tmp):
            if not name.startswith(prefix):
                continue
            try:
                pid = int(name[len(prefix) :].split("-")[0])
                os.kill(pid, 0)
            except (ValueError, IndexError):
                continue
            except ProcessLookupError:
                shutil.rmtree(os.path.join(tmp, name), ignore_errors=True)
            except PermissionError:
                pass

    # -- control plane --------------------------------------------------------------------------
    def _send(self, worker: str, msg: m.Message) -> bool:
        """Through a synchronous shadow of the ROUTER socket: a failed send raises here and now
        (an asyncio send would park the error in a future nobody awaits). False when it failed:
        the worker is not connected (dead or restarting); the caller decides what that costs."""
        try:
            self._send_sock.send_multipart([worker.encode(), msg.encode()], flags=zmq.NOBLOCK)
            return True
        except zmq.ZMQError as exc:
            log.warning("could not send %s to %s: %s", msg.type, worker, exc)
            return False

    async def _recv_loop(self) -> None:
        while True:
            self._handle(*await self._router.recv_multipart())

    def _handle(self, ident: bytes, raw: bytes) -> None:
        """One message from a worker, to its handler."""
        self.loop_alive["control-recv"] = time.monotonic()
        handlers = {
            m.Ready: self.pool.handle_ready,
            m.Heartbeat: self.pool.handle_heartbeat,
            m.LatentDone: self.driver.post,
            m.FramesDone: self.driver.post,
            m.Failed: self._on_failed,
        }
        try:
            msg = m.decode(raw)
            handlers[type(msg)](msg)
        except Exception:
            log.exception("control message from %s failed", ident.decode(errors="replace"))

    def _drain_control(self) -> None:
        """Every message the workers have sent that is waiting here, handled now (through the
        synchronous shadow: the asynchronous reader's pending receive finds nothing and waits
        on). Before a heartbeat is judged: a stall of this process's own loop must never be
        taken for a worker's silence, and ZeroMQ's I/O thread kept receiving through it."""
        while True:
            try:
                ident, raw = self._send_sock.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            self._handle(ident, raw)

    def _on_failed(self, msg: m.Failed) -> None:
        if msg.session is None:
            log.error("worker %s: %s", msg.worker, msg.message)
            self.pool.handle_startup_failure(msg)
        else:
            self.driver.post(self.pool.blame(msg))

    async def _lag_loop(self) -> None:
        """The event loop's lag, sampled every LAG_PROBE_S: how late a timer ran, which is how
        long one handler held the loop every stream and worker shares (/metrics)."""
        loop = asyncio.get_running_loop()
        while True:
            t0 = loop.time()
            await asyncio.sleep(LAG_PROBE_S)
            self.scheduler.meters.metrics.observe_loop_lag(max(0.0, loop.time() - t0 - LAG_PROBE_S))

    async def _monitor_loop(self) -> None:
        """Every heartbeat interval: the workers' liveness, then the scheduler's clock. A tick
        that comes late (this process's own loop was held, or the process stopped) judges no
        worker silent: the heartbeats sent meanwhile may still be on their way in through
        ZeroMQ's I/O thread. The next tick, one interval on, has read them."""
        interval = self.cfg.pipeline.heartbeat_interval_s
        last = time.monotonic()
        while True:
            await asyncio.sleep(interval)
            now = time.monotonic()
            held, last = now - last, now
            own_stall = held > 2 * interval
            self.loop_alive["monitor"] = now
            self.loop_alive.setdefault("control-recv", now)
            self._drain_control()
            if own_stall:
                log.warning("the supervisor's loop was held %.1fs: heartbeats are judged at the next tick", held)
            self.pool.check(judge_silence=not own_stall)
            self.driver.step()  # time passes: blocks past their deadline fail their sessions

    # -- the API's entry points -------------------------------------------------------------------
    def submit(self, request, session_id: str) -> SessionHandle:
        """Plan a validated request into blocks and hand it to the scheduler; the handle reports
        what happens. Raises QueueFull (429) when it cannot be admitted or queued."""
        blocks = plan_blocks(request.scenes, self.card.frames_per_block, self.card.temporal_factor)
        r = request
        sess = Session(session_id, r.scenes, blocks, r.width, r.height, r.fps, r.seed, time.monotonic(), live=r.live)
        space = SPACES.get(self.card.controls)
        if space is not None:  # a world model: the request's own controls land first, each at its block
            sess.controls = Timeline(space)
            for c in getattr(r, "controls", ()):
                sess.controls.receive(c, 0)
        return self.driver.submit(sess)

    @property
    def metrics(self):
        return self.scheduler.meters.metrics if self.scheduler is not None else None

    @property
    def running_sessions(self) -> int:
        return len(self.scheduler.books.running) if self.scheduler is not None else 0

    # -- status ---------------------------------------------------------------------------------
    def loops_alive(self) -> bool:
        """The supervisor's own loops go round (what systemd's watchdog follows): the control
        reader and the monitor are running and the monitor ticked recently."""
        now = time.monotonic()
        interval = self.cfg.pipeline.heartbeat_interval_s
        tasks_ok = bool(self._tasks) and all(not t.done() for t in self._tasks)
        monitor_fresh = now - self.loop_alive.get("monitor", now) < 5 * interval + 5
        return self.state in (RUNNING, DRAINING) and tasks_ok and monitor_fresh

    def agent_reply(self) -> str:
        """HAProxy agent-check: this node's free capacity as a weight, or drain, or down.

        The weight is the share of session places free (running and queued sessions count
        against `max_sessions`), at least 1% while a pipeline serves, so a full node still gets
        the odd request and answers it with 429 and Retry-After rather than vanishing."""
        if self.state != RUNNING:
            return "drain\n"
        if self.pool is None or self.pool.serving_pipelines() == 0 or not self.loops_alive():
            return "down\n"
        cap = self.cfg.limits.max_sessions
        busy = len(self.scheduler.books.running) + len(self.scheduler.admission.queue)
        free = max(0.0, (cap - busy) / cap)
        return f"up ready {max(1, round(100 * free))}%\n"

    def health(self) -> tuple[bool, dict]:
        """200 while the supervisor runs and at least one complete pipeline serves (a restart
        elsewhere is degraded, not down); 503 when none can."""
        now = time.monotonic()
        workers = (
            {
                n: {
                    "ready": w.ready,
                    "pid": w.process.pid if w.process else None,
                    "heartbeat_age_s": round(now - w.last_heartbeat, 2),
                    "busy_s": round(w.busy_s, 2),
                    "borrowed_s": round(w.borrowed_s, 2),
                    "restarts": w.restarts,
                    "failure": w.failure,
                }
                for n, w in self.pool.workers.items()
            }
            if self.pool
            else {}
        )
        alive = self.loops_alive()
        serving = self.pool.serving_pipelines() if self.pool else 0
        ok = self.state == RUNNING and alive and serving > 0
        return ok, {
            "state": self.state,
            "degraded": ok and not self.pool.all_ready(),
            "pipelines_serving": serving,
            "workers": workers,
            "tasks_alive": alive,
            "pipeline": self.scheduler.snapshot() if self.scheduler else {},
            "placement": self.placement.as_dict() if self.placement else None,
            "model": self.loaded,
        }

    # -- stop -----------------------------------------------------------------------------------
    def begin_drain(self) -> None:
        """Stop admitting (new requests get 503, the balancer's agent hears "drain"); running
        sessions go on. SIGTERM and POST /admin/drain both start here."""
        if self.state != RUNNING:
            return
        self.state = DRAINING
        self.driver.step(sch.StopAdmitting("the server is draining"))

    async def drain(self, timeout_s: float) -> None:
        """Stop admitting; let running sessions finish until the deadline."""
        self.begin_drain()
        if self.state != DRAINING:
            return
        deadline = time.monotonic() + timeout_s
        while self.scheduler.books.running and time.monotonic() < deadline:
            await asyncio.sleep(0.1)

    def cancel_all(self, reason: str = "the server is shutting down") -> None:
        """End every session now (their streams end truncated)."""
        if self.driver is not None:
            self.driver.step(sch.StopAdmitting(reason))
            for sess in list(self.scheduler.books.sessions.values()):
                self.driver.cancel(sess.id, reason)

    async def close(self) -> None:
        if self.state == STOPPED:
            return
        self.state = STOPPING
        try:
            self.cancel_all()
        except Exception:  # the workers must still stop and the rings go
            log.exception("cancelling the sessions at shutdown failed")
        if self.pool is not None:
            await self.pool.shutdown()
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.driver is not None:
            self.driver.close()
        if self._router is not None:
            self._router.close(linger=0)  # the shadow shares its socket
        if self._ctx is not None:
            self._ctx.term()
        for ring in (self.latent_ring, self.frame_ring):
            if ring is not None:
                ring.close(unlink=True)
        if self.host_gate is not None:
            self.host_gate.close()
        if self.runtime_dir:
            shutil.rmtree(self.runtime_dir, ignore_errors=True)
        self.state = STOPPED


def describe_loaded(d: dict) -> str:
    """One log line of what the DiT workers loaded (the READY message's `loaded`)."""
    s = d["sampler"]
    parts = [f"preset {d['preset']} (DiT {d['dit']}{', ' + d['source'] if d.get('source') else ''})"]
    if d.get("embedded"):
        parts.append(f"embedded trained weights ({d['trained']})" if d.get("trained") else "embedded seeded weights")
    if d.get("checkpoint"):
        parts.append(f"checkpoint {d['checkpoint']} (weight set {d['weights']})")
    if d.get("lora"):
        lo = d["lora"]
        parts.append(f"LoRA {lo['file']} (rank {lo['rank'] or 'as in the file'}, alpha {lo['alpha']})")
    if d.get("decoder"):
        dec = d["decoder"]
        parts.append(f"decoder {dec['name']} ({dec['weights'] or dec.get('trained') or 'seeded weights'})")
    first = f", first block {s['first_block_steps']}" if s.get("first_block_steps") else ""
    parts.append(
        f"{s['kind']} sampler: steps {s['steps']}{first}, shift {s['shift']:g}, warp {s['warp']}, "
        f"{s['frames_per_block']} latent frames per block, window {s['window_frames']}, sink {s['sink_frames']}"
        f"{' (global)' if s['global_sink'] else ''}, re-cache {s['recache']}"
    )
    return "; ".join(parts)


def loaded_model(card: ModelCard, infos: dict[str, m.ReadyInfo]) -> tuple[ModelCard, dict | None]:
    """The model the workers loaded, from their READY: its card (which must agree with `card`,
    the preset's the supervisor sized its rings and plans by, on PLANNED_FIELDS; the rest, its
    dimensions and window, is the loaded model's) and what was loaded, the decoder's compile
    beside the DiT's. RuntimeError names a worker whose model does not fit."""
    loaded, compiled = None, None
    for name, info in infos.items():
        dit, vae = info.dit, info.vae
        if dit is not None and dit.card is not None:
            wrong = card.differs(dit.card, PLANNED_FIELDS)
            if wrong:
                raise RuntimeError(f"worker {name} reports {wrong[0]}")
            card, loaded = dit.card, dict(dit.loaded)
        if vae is not None:
            for key in ("spatial_factor", "temporal_factor"):
                theirs, mine = getattr(vae, key), getattr(card, key)
                if theirs != mine:
                    raise RuntimeError(f"worker {name} reports {key}={theirs}, expected {mine}")
            compiled = vae.compile if vae.compile is not None else compiled
    if loaded is not None and compiled is not None:
        loaded["vae_compile"] = compiled
    return card, loaded
