"""The command line's flags and what each sets in the config: one list, one mapping (every process
that parses flags: the daemon, `streamdiffd generate`, `profile` and `plan`).

A low module (it imports the config only), so the subcommands and the daemon take their flags
from here rather than from each other.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from .config import ConfigError
from .models.spec import ARCH_CARDS, DIRECTORY_PRESET


def add_model_args(p: argparse.ArgumentParser) -> None:
    """The flags that choose and load the model: the daemon's and `streamdiffd generate`'s (one list, one
    mapping to the config in `overrides_from_args`)."""
    p.add_argument("--config", help="TOML config file (see etc/streamdiff.toml); flags override it")
    p.add_argument("--device", choices=("cpu", "cuda", "xpu"), help="device kind (default cpu)")
    p.add_argument(
        "--model",
        metavar="PRESET|PATH",
        help=f"a DiT configuration ({', '.join(ARCH_CARDS)}; 'tiny' is embedded, 'tiny-random' the same, "
        f"always seeded), or a weights directory (Wan 2.1 release or diffusers layout; implies {DIRECTORY_PRESET})",
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
        help="torch.compile the DiT's blocks and the Wan VAE's norms "
        "(auto: on accelerators, eager where it cannot compile, said in the log and /health; "
        "off on the CPU, where it did not pay. on: refused at start where it cannot compile)",
    )
    p.add_argument(
        "--decoder",
        choices=("wan", "taehv"),
        help="the latent decoder: wan (the Wan 2.1 VAE, default) or taehv (the tiny real-time decoder: "
        "several times faster, lower quality; needs --decoder-weights except with the embedded default)",
    )
    p.add_argument(
        "--decoder-weights", metavar="FILE", help="TAEHV's weights for Wan 2.1 (taew2_1.pth or .safetensors)"
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
    p.add_argument(
        "--profile",
        metavar="FILE",
        help="with no layout flags, plan from this profile ('streamdiffd profile --out FILE' elsewhere: the "
        "same model on the same device kind) instead of measuring this one",
    )
    p.add_argument(
        "--calibration-dir",
        metavar="DIR",
        help="store the workers' start-up timings here, and read them at a later start with the same model, "
        "device and layout instead of timing blocks again (tests, development; default: time at every start)",
    )
    p.add_argument(
        "--calibration-given",
        metavar="FILE",
        help="JSON of the workers' start-up timings to report instead of timing blocks: the first estimate "
        "the capacity model refines from every block (tests; default: timed at start)",
    )
    p.add_argument("--host", help="listen address (default 127.0.0.1)")
    p.add_argument("--port", type=int, help="listen port (default 8000)")
    p.add_argument("--instance", help="instance name for shared memory and runtime files")
    p.add_argument("--node-id", help="this daemon's name in a cluster (default: the hostname)")
    p.add_argument("--agent-port", type=int, help="HAProxy agent-check port (0: off)")
    p.add_argument("--store-dir", help="also keep finished videos in this directory (shared in a cluster)")
    p.add_argument("--encoder", help="libx264 | auto | h264_nvenc | h264_vaapi | h264_qsv")
    p.add_argument("--log-level", choices=("debug", "info", "warning", "error"))
    return p.parse_args(argv)


def overrides_from_args(a: argparse.Namespace, only: tuple[str, ...] | None = None) -> dict[str, dict]:
    """The config sections the parsed flags set; `only`: of these flags alone (the rest unset, as
    `streamdiffd plan` takes the model flags and gives --preset a meaning of its own)."""
    given = vars(a) if only is None else {k: getattr(a, k, None) for k in only}
    o: dict[str, dict] = {"server": {}, "model": {}, "topology": {}, "encoder": {}, "store": {}, "pipeline": {}}
    for flag, key in (("dit_gpus", "dit_devices"), ("vae_gpus", "vae_devices"), ("devices", "devices")):
        v = given.get(flag)
        if v is not None and not 1 <= v <= 64:
            raise ConfigError(f"topology.{key} (--{flag.replace('_', '-')}): must be 1-64, got {v}")
    for flag, section, key in (
        ("host", "server", "host"),
        ("port", "server", "port"),
        ("instance", "server", "instance"),
        ("node_id", "server", "node_id"),
        ("agent_port", "server", "agent_port"),
        ("store_dir", "store", "dir"),
        ("calibration_dir", "pipeline", "calibration_dir"),
        ("calibration_given", "pipeline", "calibration_given"),
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
        ("profile", "topology", "profile"),
        ("devices", "topology", "devices"),
        ("preset", "model", "preset"),
        ("dit_checkpoint", "model", "dit_checkpoint"),
        ("weights", "model", "weights"),
        ("lora", "model", "lora"),
        ("lora_alpha", "model", "lora_alpha"),
        ("dtype", "model", "dtype"),
        ("compile", "model", "compile"),
        ("decoder", "model", "decoder"),
        ("decoder_weights", "model", "decoder_weights"),
        ("size", "model", "size"),
        ("encoder", "encoder", "kind"),
    ):
        v = given.get(flag)  # generate's parser has the model flags only
        if v is not None:
            o[section][key] = v
    model = given.get("model")
    if model is not None:
        if model in ARCH_CARDS:
            o["model"]["preset"] = model
        else:
            path = Path(model).expanduser()
            if not path.is_dir():
                raise ConfigError(
                    f"--model: {model!r} is neither a DiT configuration ({', '.join(ARCH_CARDS)}) nor a directory"
                )
            o["model"]["path"] = str(path.resolve())
            o["model"].setdefault("preset", DIRECTORY_PRESET)
    return {k: v for k, v in o.items() if v}
