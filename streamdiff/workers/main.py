"""Worker process: one DiT worker, one VAE shard, or both (aggregated mode) (runs in a worker).

Started by the supervisor from a fork server with torch imported (spawn.torch_context). The
start-up is a handshake: build the stages, attach the rings, join the VAE group, then send
READY (or FAILED with the reason). The
loop reads control messages from the supervisor's ROUTER socket and runs one block at a time.

Cancellation happens at block boundaries: before each block the loop drains every queued
message, so a CloseSession that arrived while a block was running frees that session's caches
before its next queued block would start; those queued blocks are answered `skipped` so the
supervisor gets their ring slots back in order. Shards of a VAE group decide together (an
all-reduce of "cancelled" per block): they must all run the block's collectives or none.

An error while handling a message is classified (errors.py): a request error fails its session
and the worker carries on; any other error fails the session and the worker exits, so the
supervisor restarts it with its VAE group (peers may be inside a collective; an accelerator
context may be poisoned and would fail every later block).

A heartbeat thread reports how long the current block has been running, so the supervisor can
tell a busy worker from a stuck one. The worker dies with its parent (PR_SET_PDEATHSIG, and the
heartbeat thread checks that the supervisor is alive: the worker's parent is the supervisor's
fork server, which outlives it while workers hold it open).
"""

from __future__ import annotations

import collections
import ctypes
import logging
import os
import signal
import sys
import threading
import time
import traceback

import msgspec

from ..ipc import messages as m
from ..spawn import alive
from .errors import MEMORY, WORKER, classify
from .faults import Faults
from .spec import WorkerSpec

log = logging.getLogger("streamdiff.worker")


def _die_with_parent() -> None:
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def _setup_process(spec: WorkerSpec) -> None:
    """The platform's process setup (threads; on the CPU affinity and a hybrid DiT's low
    priority), then logging."""
    from ..platform import for_device

    for_device(spec.device).setup_process(spec.threads, spec.cpus, spec.low_priority, spec.host_processes)
    logging.basicConfig(
        level=spec.log_level.upper(),
        stream=sys.stderr,
        format=f"%(asctime)s %(levelname)s [{spec.name}] %(name)s: %(message)s",
    )


class Worker:
    def __init__(self, spec: WorkerSpec) -> None:
        import zmq

        self.spec = spec
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)  # both directions with the supervisor
        self.sock.setsockopt(zmq.IDENTITY, spec.name.encode())
        self.sock.setsockopt(zmq.LINGER, 1000)
        self.sock.connect(spec.control_addr)
        self.pending: collections.deque[m.Message] = collections.deque()
        self.closed: set[str] = set()
        self.stop = False
        self.stopping = threading.Event()  # wakes the heartbeat at shutdown (its socket must close first)
        self.busy_since = 0.0
        self.waiting_since = 0.0
        self.supervisor = spec.supervisor_pid or os.getppid()
        self.stages: dict[str, object] = {}
        self.faults = Faults(spec.faults, spec.name, spec.incarnation)
        self.lender = None  # CPU shared cores (platform/cpu_lending.py)

    # -- start-up ---------------------------------------------------------------------------
    def start(self) -> None:
        from .dit_stage import DiTStage
        from .vae_stage import VAEStage

        ready: dict = {}
        self.faults.hit("start")
        if "dit" in self.spec.roles:
            self.stages["dit"] = DiTStage(self.spec, self.faults)
            ready["dit"] = self.stages["dit"].info()
        if "vae" in self.spec.roles:
            self.stages["vae"] = VAEStage(self.spec, self.faults)
            ready["vae"] = self.stages["vae"].info()
        ready = self._one_budget(ready)
        info = m.ReadyInfo(self.spec.device, list(self.spec.roles), **ready)
        if self.spec.lend:
            from ..platform.cpu_lending import Lender
            from .lend import install_lender

            self.lender = Lender(self.spec.lend)
            for stage in self.stages.values():
                for model in stage.models():
                    install_lender(self.lender, model)
        self.send(m.Ready(self.spec.name, os.getpid(), info))
        threading.Thread(target=self._heartbeat, name="heartbeat", daemon=True).start()

    def _one_budget(self, ready: dict) -> dict:
        """One memory budget for the device, shared by the stages on it: taken once every stage
        has loaded and calibrated (a stage that measured free memory before the other had
        loaded would count it twice), less the largest of their transients at the largest
        batch it can hold (stages run one at a time, so their transients never meet): the
        worker's max_batch where the rest holds that many sessions at the preset's size, else
        fewer (Krea's 14B on one device: kept for four blocks' transients, none of its sessions
        would fit). The supervisor checks the caches of all the sessions on this worker,
        whichever stage holds them, against it (`CapacityModel.fits`), and batches no more."""
        from .stage_common import session_bytes, transient_at

        plat = next(iter(self.stages.values())).platform
        mems = [r for r in ready.values() if r.memory is not None]
        one = sum(session_bytes(r) for r in mems)  # a session at the preset's size, in every stage here

        def reserve(b: int) -> int:
            return max((transient_at(b, r.memory.transient_bytes, r.memory.transient_each) for r in mems), default=0)

        for batch in range(max(1, self.spec.max_batch), 0, -1):
            budget = float(plat.memory_budget(self.spec.cpu_memory_budget_bytes, reserve(batch)))
            if budget >= batch * one or batch == 1:
                break
        log.info(
            "memory budget for sessions: %.0f MB (%.0f MB kept for the transients of a batch of %d)",
            budget / 1e6,
            reserve(batch) / 1e6,
            batch,
        )
        return {
            k: r
            if r.memory is None
            else msgspec.structs.replace(r, memory=msgspec.structs.replace(r.memory, budget_bytes=budget, batch=batch))
            for k, r in ready.items()
        }

    def send(self, msg: m.Message) -> None:
        self.sock.send(msg.encode())

    def _heartbeat(self) -> None:
        import zmq

        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.IDENTITY, f"{self.spec.name}.hb".encode())
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.spec.control_addr)
        while not self.stop:
            if not alive(self.supervisor):
                os._exit(1)
            busy = time.monotonic() - self.busy_since if self.busy_since else 0.0
            waiting = self.waiting_since
            idle = time.monotonic() - waiting if waiting else 0.0
            stats = m.CpuStats(self.lender.borrowed_s()) if self.lender else None
            sock.send(m.Heartbeat(self.spec.name, busy, idle, stats).encode())
            self.stopping.wait(self.spec.heartbeat_interval_s)
        sock.close()

    # -- loop ---------------------------------------------------------------------------------
    def run(self) -> None:
        import zmq

        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        while not self.stop:
            if not self.pending:
                # Waiting with nothing queued: what the heartbeat reports as idle. A message that
                # arrives ends the wait at once, so a long wait proves none was sent meanwhile.
                # (A poll that times out goes on waiting: the wait is not restarted.)
                self.waiting_since = self.waiting_since or time.monotonic()
                if poller.poll(timeout=1000):
                    self.waiting_since = 0.0
            self._drain()
            if self.pending:
                self.waiting_since = 0.0
                self.busy_since = time.monotonic()  # before the pop: never idle with a message in hand
                self._handle(self.pending.popleft())

    def _drain(self) -> None:
        import zmq

        while True:
            try:
                raw = self.sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            msg = m.decode(raw)
            if isinstance(msg, m.OpenSession):
                self.faults.opened(msg.session, msg.seed)
            elif isinstance(msg, m.GenerateBatch | m.DecodeBatch):
                msg.blocks = [b for b in msg.blocks if not self._dropped(b)]
                if not msg.blocks:
                    continue
            if isinstance(msg, m.CloseSession):
                self.closed.add(msg.session)
                self.faults.closed(msg.session)
                for stage in self.stages.values():
                    stage.close(msg.session)
            elif isinstance(msg, m.Shutdown):
                self.stop = True
                return
            else:
                self.pending.append(msg)

    def _handle(self, msg: m.Message) -> None:
        self.busy_since = time.monotonic()
        try:
            if isinstance(msg, m.OpenSession):
                self.closed.discard(msg.session)
                for stage in self.stages.values():
                    stage.open(msg)
            elif isinstance(msg, m.GenerateBatch | m.DecodeBatch):
                stage = self.stages["dit" if isinstance(msg, m.GenerateBatch) else "vae"]
                extra = {"weights": tuple(msg.weights)} if isinstance(msg, m.DecodeBatch) and msg.weights else {}
                if self.lender:
                    self.lender.running(True)
                try:
                    replies, refusals = stage.run_batch(msg.blocks, self.closed, **extra)
                finally:
                    if self.lender:
                        self.lender.running(False)
                for reply in replies:
                    self.send(reply)
                for refused, exc in refusals:
                    self._failed(refused, exc)
        except Exception as exc:
            batch = isinstance(msg, m.GenerateBatch | m.DecodeBatch)
            if batch and classify(exc, self._sharded()) == MEMORY:
                self._out_of_memory(msg.blocks, exc)
            else:
                self._failed(msg.blocks[0] if batch else msg, exc)
        finally:
            self.busy_since = 0.0

    def _sharded(self) -> bool:
        return any(getattr(stage, "world", 1) > 1 for stage in self.stages.values())

    def _out_of_memory(self, blocks: list, exc: Exception) -> None:
        """The device ran out of memory in a batch: every session of it fails (their caches go
        with them), the allocator gives back what it cached, and the worker carries on."""
        why = f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:300]}"
        log.warning("out of memory in a batch of %d block(s); failing its sessions: %s", len(blocks), why)
        for b in blocks:
            self.closed.add(b.session)
            for stage in self.stages.values():
                stage.close(b.session)
        for stage in self.stages.values():
            stage.platform.release_memory()
        for b in blocks:
            self.send(m.Failed(self.spec.name, why, b.session, b.block, MEMORY))

    def _dropped(self, msg: m.GenerateBlock | m.DecodeBlock) -> bool:
        """An injected fault: this block's message is lost on its way."""
        if self.faults.drop(msg.session):
            log.warning("dropping %s %s/%d (injected fault)", msg.type, msg.session, msg.block)
            return True
        return False

    def _failed(self, msg: m.Message, exc: Exception) -> None:
        session, block = getattr(msg, "session", None), getattr(msg, "block", None)
        sharded = self._sharded()
        kind = classify(exc, sharded)
        first_line = (str(exc).splitlines() or [""])[0][:300]
        if kind != WORKER:
            log.warning("%s for session %s refused: %s", msg.type, session, first_line)
            if session is not None:
                self.closed.add(session)
                for stage in self.stages.values():
                    stage.close(session)
            self.send(m.Failed(self.spec.name, f"{type(exc).__name__}: {first_line}", session, block, kind))
            return
        log.error("%s for session %s failed; restarting: %s", msg.type, session, traceback.format_exc())
        why = f"{type(exc).__name__}: {first_line}"
        if sharded:
            why = f"group {self.spec.group.name}: {self.spec.name} failed (or a peer died): {why}"
        self.send(m.Failed(self.spec.name, why, session, block, kind))
        # Leave now: peers waiting in this block's collectives fail at once instead of at the
        # collective timeout, and a poisoned accelerator context goes with the process.
        self.sock.close(linger=1000)
        os._exit(3)

    def shutdown(self) -> None:
        """Stop: the heartbeat closes its socket at once (the context's term waits for it, which
        a sleeping heartbeat held up by up to an interval at every stop)."""
        self.stop = True
        self.stopping.set()
        for stage in self.stages.values():
            stage.shutdown()
        if self.lender:
            self.lender.close()
        self.sock.close(linger=1000)
        self.ctx.term()


def worker_main(spec: WorkerSpec) -> None:
    """The worker process's target (spawn.torch_context)."""
    _die_with_parent()
    _setup_process(spec)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the supervisor decides when we stop
    worker = Worker(spec)
    try:
        worker.start()
    except Exception as exc:
        log.error("start-up failed: %s", traceback.format_exc())
        worker.send(m.Failed(spec.name, f"start-up failed: {type(exc).__name__}: {exc}"))
        worker.sock.close(linger=2000)
        sys.exit(2)
    try:
        worker.run()
    finally:
        worker.shutdown()
