"""`streamdiffd`: the daemon's command line and main loop (supervisor process).

    streamdiffd                                   # embedded tiny model on the CPU, 127.0.0.1:8000
    streamdiffd --dit-gpus 1 --vae-gpus 3 --device cuda --model /models/Wan2.1-T2V-1.3B

The signal handlers only set the shutdown state; the main coroutine does the work: SIGTERM or
SIGINT -> drain (503 with Retry-After for new requests, running streams finish until
server.drain_timeout_s) -> stop the workers -> remove every shared-memory segment -> exit.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
from pathlib import Path

from .config import Config, ConfigError, load

log = logging.getLogger("streamdiff")


def add_model_args(p: argparse.ArgumentParser) -> None:
    """The flags that choose and load the model: the daemon's and `streamdiffd generate`'s (one list, one
    mapping to the config in `overrides_from_args`)."""
    p.add_argument("--config", help="TOML config file (see etc/streamdiff.toml); flags override it")
    p.add_argument("--device", choices=("cpu", "cuda", "xpu"), help="device kind (default cpu)")
    p.add_argument(
        "--model",
        metavar="PRESET|PATH",
        help="'tiny' (embedded), 'wan2.1-t2v-1.3b', or a weights "
        "directory (Wan 2.1 release or diffusers layout; implies wan2.1-t2v-1.3b)",
    )
    p.add_argument(
        "--preset",
        metavar="NAME",
        help="a published checkpoint run as its authors run it ('streamdiffd models' lists them), with --model "
        "DIR (the Wan base) and --dit-checkpoint FILE (the authors' file)",
    )
    p.add_argument("--dit-checkpoint", metavar="FILE", help="the generator checkpoint (.pt) replacing the DiT weights")
    p.add_argument(
        "--weights",
        choices=("ema", "generator"),
        help="which weight set of the checkpoint to load (default: the preset's, as its authors' script loads)",
    )
    p.add_argument("--lora", metavar="FILE", help="a PEFT LoRA merged into the DiT at load (LongLive's lora.pt)")
    p.add_argument("--lora-alpha", type=float, metavar="A", help="the LoRA's alpha (default: the preset's)")
    p.add_argument("--dtype", choices=("auto", "float32", "bfloat16", "float16"))
    p.add_argument(
        "--compile",
        choices=("auto", "on", "off"),
        help="torch.compile the DiT's blocks (auto: on accelerators; off on the CPU, where it measured slower)",
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="streamdiffd",
        description="Streaming text-to-video server (Wan 2.1 causal "
        "DiT + VAE, disaggregated), OpenAI-compatible, fMP4 over HTTP.",
        epilog="With no layout flags the layout is planned from a profile of this machine. Also: "
        "'streamdiffd models' (the published checkpoints' presets), 'streamdiffd generate --help' (one video to "
        "a file, no server), 'streamdiffd profile --help' (measure the stages) and 'streamdiffd plan --help' (rank "
        "layouts).",
    )
    add_model_args(p)
    p.add_argument("--dit-gpus", type=int, metavar="N", help="DiT workers, one per device (default 1)")
    p.add_argument("--vae-gpus", type=int, metavar="M", help="VAE shard workers, one per device (default 1)")
    p.add_argument("--vae-group-size", type=int, metavar="K", help="shards per VAE group (default: all VAE devices)")
    p.add_argument(
        "--dit-group-size",
        type=int,
        metavar="G",
        help="devices per DiT, sequence-parallel (Ulysses) over G of the --dit-gpus devices (default 1)",
    )
    p.add_argument(
        "--mode",
        choices=("disaggregated", "aggregated", "hybrid"),
        help="stage layout (default disaggregated; hybrid: the DiT's device also holds a VAE shard)",
    )
    p.add_argument(
        "--size",
        metavar="WxH",
        help="default frame size: requests without one, the workers' start-up timing, the profile "
        "(default: the model's, 256x144 tiny, 832x480 wan2.1-t2v-1.3b)",
    )
    p.add_argument("--threads-per-worker", type=int, metavar="T", help="CPU threads per worker (default 1)")
    p.add_argument(
        "--vae-cut",
        type=int,
        metavar="N",
        help="disaggregated: the DiT workers also run the VAE decoder's first N stages (default 0)",
    )
    p.add_argument(
        "--vae-cut-adapt",
        action="store_const",
        const=True,
        help="with --vae-cut: move the cut, at each shot's start, to where the measured stage times balance "
        "(a planned cut does)",
    )
    p.add_argument(
        "--share-cores",
        action="store_const",
        const=True,
        help="cpu, disaggregated: a worker lends its cores to the others while it waits, so the stage with "
        "work runs on the cores the other leaves idle",
    )
    p.add_argument(
        "--objective",
        choices=("throughput", "latency", "streams"),
        help="with no layout flags the layout is planned for this (default throughput)",
    )
    p.add_argument("--devices", type=int, metavar="N", help="plan over N devices (default: every one visible)")
    p.add_argument("--host", help="listen address (default 127.0.0.1)")
    p.add_argument("--port", type=int, help="listen port (default 8000)")
    p.add_argument("--instance", help="instance name for shared memory and runtime files")
    p.add_argument("--node-id", help="this daemon's name in a cluster (default: the hostname)")
    p.add_argument("--agent-port", type=int, help="HAProxy agent-check port (0: off)")
    p.add_argument("--store-dir", help="also keep finished videos in this directory (shared in a cluster)")
    p.add_argument("--encoder", help="libx264 | auto | h264_nvenc | h264_vaapi | h264_qsv")
    p.add_argument("--log-level", choices=("debug", "info", "warning", "error"))
    return p.parse_args(argv)


def overrides_from_args(a: argparse.Namespace) -> dict[str, dict]:
    o: dict[str, dict] = {"server": {}, "model": {}, "topology": {}, "encoder": {}, "store": {}}
    for flag, key in (("dit_gpus", "dit_devices"), ("vae_gpus", "vae_devices"), ("devices", "devices")):
        v = getattr(a, flag, None)
        if v is not None and not 1 <= v <= 64:
            raise ConfigError(f"topology.{key} (--{flag.replace('_', '-')}): must be 1-64, got {v}")
    for flag, section, key in (
        ("host", "server", "host"),
        ("port", "server", "port"),
        ("instance", "server", "instance"),
        ("node_id", "server", "node_id"),
        ("agent_port", "server", "agent_port"),
        ("store_dir", "store", "dir"),
        ("log_level", "server", "log_level"),
        ("dit_gpus", "topology", "dit_devices"),
        ("vae_gpus", "topology", "vae_devices"),
        ("vae_group_size", "topology", "vae_group_size"),
        ("dit_group_size", "topology", "dit_group_size"),
        ("device", "topology", "device"),
        ("mode", "topology", "mode"),
        ("threads_per_worker", "topology", "threads_per_worker"),
        ("vae_cut", "topology", "vae_cut"),
        ("vae_cut_adapt", "topology", "vae_cut_adapt"),
        ("share_cores", "topology", "share_cores"),
        ("objective", "topology", "objective"),
        ("devices", "topology", "devices"),
        ("preset", "model", "preset"),
        ("dit_checkpoint", "model", "dit_checkpoint"),
        ("weights", "model", "weights"),
        ("lora", "model", "lora"),
        ("lora_alpha", "model", "lora_alpha"),
        ("dtype", "model", "dtype"),
        ("compile", "model", "compile"),
        ("size", "model", "size"),
        ("encoder", "encoder", "kind"),
    ):
        v = getattr(a, flag, None)  # generate's parser has the model flags only
        if v is not None:
            o[section][key] = v
    if a.model is not None:
        if a.model in ("tiny", "wan2.1-t2v-1.3b"):
            o["model"]["preset"] = a.model
        else:
            path = Path(a.model).expanduser()
            if not path.is_dir():
                raise ConfigError(f"--model: {a.model!r} is neither a preset (tiny, wan2.1-t2v-1.3b) nor a directory")
            o["model"]["path"] = str(path.resolve())
            o["model"].setdefault("preset", "wan2.1-t2v-1.3b")
    return {k: v for k, v in o.items() if v}


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

    from .sdnotify import Notifier
    from .server.app import make_app
    from .supervisor.core import Supervisor

    notifier = Notifier()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)

    from .placement.auto import place

    extender = asyncio.create_task(extend_start_timeout(notifier))
    waiter = asyncio.create_task(stop.wait())
    placing = loop.run_in_executor(None, place, cfg, log.info)
    await asyncio.wait({placing, waiter}, return_when=asyncio.FIRST_COMPLETED)
    if not placing.done():  # stopped while profiling: the profile's processes are daemonic
        extender.cancel()
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


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "models":
        from .models.catalog import main as models_main

        return models_main(argv[1:])
    if argv and argv[0] == "generate":
        from .generate import main as generate_main

        return generate_main(argv[1:])
    if argv and argv[0] in ("profile", "plan"):
        from .placement.commands import main as placement_main

        return placement_main(argv)
    args = parse_args(argv)
    try:
        cfg = load(args.config, overrides_from_args(args))
        api_keys = read_api_keys(cfg)
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


if __name__ == "__main__":
    sys.exit(main())
