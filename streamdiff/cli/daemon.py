"""`streamdiffd` with no subcommand: the daemon's main loop (supervisor process).

    streamdiffd                                   # embedded tiny model on the CPU, 127.0.0.1:8000
    streamdiffd --dit-gpus 1 --vae-gpus 3 --device cuda --model /models/Wan2.1-T2V-1.3B

The signal handlers only set the shutdown state; the main coroutine does the work: SIGTERM or
SIGINT -> drain (503 with Retry-After for new requests, running streams finish until
server.drain_timeout_s) -> stop the workers -> remove every shared-memory segment -> exit.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
from pathlib import Path

from ..config import Config, ConfigError
from ..config.loader import load
from ..flags import overrides_from_args, parse_args

log = logging.getLogger("streamdiff")


def read_api_keys(cfg: Config) -> list[bytes]:
    keys = [k.strip() for k in os.environ.get("STREAMDIFF_API_KEYS", "").split(",") if k.strip()]
    if cfg.server.api_keys_file:
        try:
            text = Path(cfg.server.api_keys_file).read_text()
        except OSError as exc:
            raise ConfigError(f"server.api_keys_file: cannot read {cfg.server.api_keys_file}: {exc}") from None
        keys += [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.startswith("#")]
    return [k.encode() for k in keys]


async def serve(cfg: Config, api_keys: list[bytes]) -> int:
    from aiohttp import web

    from ..sdnotify import Notifier
    from ..server.app import make_app
    from ..supervisor.core import Supervisor

    notifier = Notifier()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)

    from ..placement.auto import place

    extender = asyncio.create_task(extend_start_timeout(notifier))
    waiter = asyncio.create_task(stop.wait())
    placing = loop.run_in_executor(None, place, cfg, log.info)
    await asyncio.wait({placing, waiter}, return_when=asyncio.FIRST_COMPLETED)
    if not placing.done():  # stopped while profiling: its probes are killed, and it stops
        from ..placement.profile.harness import STOP

        STOP.set()
        extender.cancel()
        await asyncio.gather(placing, return_exceptions=True)
        log.info("stopped while profiling the machine: no profile kept")
        return 0
    try:
        cfg, placement = placing.result()
    except Exception as exc:
        extender.cancel()
        log.error("cannot place the workers: %s", exc)
        return 1
    log.info("layout %s (%s)", placement.layout, describe(placement))
    sup = Supervisor(cfg, placement)
    notifier.notify("STATUS=starting workers")
    start = asyncio.create_task(sup.start())
    await asyncio.wait({start, waiter}, return_when=asyncio.FIRST_COMPLETED)
    extender.cancel()
    if not start.done():  # stopped while starting
        start.cancel()
        await asyncio.gather(start, return_exceptions=True)
        await sup.close()
        return 0
    if start.exception() is not None:
        log.error("start-up failed: %s", start.exception())
        await sup.close()
        return 1

    app = make_app(sup, cfg, api_keys)
    runner = web.AppRunner(app, handle_signals=False, handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, cfg.server.host, cfg.server.port, reuse_address=True)
    try:
        await site.start()
    except OSError as exc:
        log.error("cannot listen on %s:%d: %s", cfg.server.host, cfg.server.port, exc)
        await runner.cleanup()
        await sup.close()
        return 1
    agent = None
    if cfg.server.agent_port:
        try:
            agent = await asyncio.start_server(
                lambda r, w: agent_reply(sup, w), cfg.server.host, cfg.server.agent_port, reuse_address=True
            )
        except OSError as exc:
            log.error("cannot listen for the agent check on port %d: %s", cfg.server.agent_port, exc)
            await runner.cleanup()
            await sup.close()
            return 1
    url = f"http://{cfg.server.host}:{cfg.server.port}"
    log.info("streamdiffd ready on %s (model %s, node %s)", url, cfg.model_name, cfg.node)
    print(f"streamdiffd: listening on {url}", flush=True)
    notifier.ready(f"serving on {url}")

    async def watchdog():
        interval = notifier.watchdog_interval_s()
        if interval is None:
            return
        while True:
            await asyncio.sleep(interval)
            # WATCHDOG=1 while the supervisor's own loops go round, whatever its workers do: the
            # supervisor restarts those itself, and a restart that outlasts WatchdogSec must not
            # make systemd kill the sessions that still stream.
            if sup.loops_alive():
                notifier.watchdog()

    dog = asyncio.create_task(watchdog())
    await stop.wait()
    log.info("shutting down: draining running streams (up to %.0fs)", cfg.server.drain_timeout_s)
    notifier.stopping("draining")
    try:
        await sup.drain(cfg.server.drain_timeout_s)
        sup.cancel_all()  # past the deadline: what still runs ends now, truncated
    finally:  # whatever failed above, the workers stop and the rings go
        dog.cancel()
        if agent is not None:
            agent.close()
        await runner.shutdown()
        await runner.cleanup()
        await sup.close()
    log.info("stopped")
    return 0


def describe(placement) -> str:
    if not placement.planned:
        return "as configured"
    p = placement.predicted
    return (
        f"planned for {placement.objective}: predicted {p['w1_fps']:.1f} frames/s for one stream, first fragment "
        f"in {p['w1_ttff_s']:.2f}s; next best "
        + ", ".join(f"{r['layout']} {r['w1_fps']:.1f}" for r in placement.runners_up)
        + f"; profile {placement.profile}"
    )


async def agent_reply(sup, writer: asyncio.StreamWriter) -> None:
    """One HAProxy agent-check answer per connection: a line, then close (see Supervisor.agent_reply)."""
    try:
        writer.write(sup.agent_reply().encode())
        await writer.drain()
    except ConnectionError:
        pass
    finally:
        writer.close()


EXTEND_EVERY_S = 10.0  # while the workers load their models, ask systemd for this much more...
EXTEND_BY_S = 30.0  # ...start-up time each time (the supervisor's ready_timeout_s still bounds it)


async def extend_start_timeout(notifier) -> None:
    """EXTEND_TIMEOUT_USEC while starting: loading real weights can outlast TimeoutStartSec."""
    while True:
        notifier.notify(f"EXTEND_TIMEOUT_USEC={int(EXTEND_BY_S * 1e6)}", "STATUS=loading models")
        await asyncio.sleep(EXTEND_EVERY_S)


def compile_setup(cfg: Config) -> None:
    """Before any worker starts: `--compile on` refused where torch.compile cannot work, naming
    what is missing (the workers would fail their first block otherwise), and torch.compile's
    caches (inductor's, Triton's) put where a restart finds them: systemd's CacheDirectory=, else
    the state directory. Their default is under /tmp, which the unit makes private, so every
    restart compiled from scratch. Set before the first child: children fork from a server
    that keeps the environment it started with (spawn.torch_context)."""
    from ..models.toolchain import CompileUnavailable, decide
    from ..placement.auto import state_dir

    try:
        decide(cfg.model.compile, cfg.topology.device)
    except CompileUnavailable as exc:
        raise ConfigError(f"model.compile: {exc}") from None
    cache = os.environ.get("CACHE_DIRECTORY", "").split(":")[0]
    base = Path(cache) if cache else state_dir(cfg)
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(base / "compile" / "inductor"))
    os.environ.setdefault("TRITON_CACHE_DIR", str(base / "compile" / "triton"))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    try:
        cfg = load(args.config, overrides_from_args(args))
        api_keys = read_api_keys(cfg)
        compile_setup(cfg)
    except ConfigError as exc:
        print(f"streamdiffd: configuration error: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=cfg.server.log_level.upper(),
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s [supervisor] %(name)s: %(message)s",
    )
    try:
        return asyncio.run(serve(cfg, api_keys))
    except KeyboardInterrupt:
        return 130
