"""Daemon configuration: one frozen dataclass tree, loaded from TOML, overridden by CLI flags
(supervisor process; workers receive the parts they need).

Every key is documented in etc/streamdiff.toml. Unknown keys and invalid values are rejected
at start with a message that names the key (`ConfigError`). The environment is read here only
(`STREAMDIFF_API_KEYS`, `NOTIFY_SOCKET` is read by sdnotify).
"""

from __future__ import annotations

import dataclasses
import os
import re
import socket
import tomllib
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, get_type_hints

from .models.catalog import checkpoint_preset
from .models.spec import EMBEDDED_PRESETS, known_presets
from .platform.base import KINDS


class ConfigError(ValueError):
    pass


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"  # listen address; 127.0.0.1 unless told otherwise
    port: int = 8000
    instance: str = "streamdiffd"  # names shared-memory segments and the runtime directory
    max_body_bytes: int = 256 * 1024  # larger request bodies get 413
    api_keys_file: str = ""  # one bearer key per line; empty = no auth (unless STREAMDIFF_API_KEYS)
    metrics_require_auth: bool = False  # /metrics behind the API keys too
    client_write_timeout_s: float = 60.0  # a client that accepts no bytes this long is dropped
    request_read_timeout_s: float = 30.0  # a client that takes longer to send its request body is dropped
    drain_timeout_s: float = 60.0  # on SIGTERM, running streams get this long to finish
    log_level: str = "info"
    node_id: str = ""  # this daemon's name in a cluster, carried by every id it issues (default: the hostname)
    agent_port: int = 0  # HAProxy agent-check port (free capacity as a weight, drain, down); 0 = off
    state_dir: str = ""  # cached profiles; default $STATE_DIRECTORY (systemd), else ~/.cache/streamdiff


@dataclass(frozen=True)
class ModelConfig:
    preset: str = (
        "tiny"  # tiny (embedded) | tiny-random (seeded) | wan2.1-t2v-1.3b | wan2.1-t2v-14b | a checkpoint preset
    )
    path: str = ""  # weights directory for real presets
    dit_checkpoint: str = ""  # Causal Forcing / Self-Forcing generator .pt (a checkpoint preset's file)
    weights: str = ""  # ema | generator: the training checkpoint's weight set (empty: the preset's)
    lora: str = ""  # a PEFT LoRA merged into the DiT at load (LongLive's lora.pt)
    lora_alpha: float = 0.0  # the LoRA's alpha (0: the preset's)
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    decoder: str = "wan"  # wan (the Wan 2.1 VAE) | taehv (the tiny real-time decoder: faster, lower quality)
    decoder_weights: str = ""  # taehv: taew2_1.pth / .safetensors (empty: seeded weights, embedded default only)
    compile: str = "auto"  # torch.compile the DiT's blocks: auto (accelerators only) | on | off
    dit_vae_ratio: float = 0.74  # tiny only: DiT cost per block relative to the VAE
    seed: int = 1234  # tiny only: weight seed
    name: str = ""  # model id in the API (default: the preset name)
    size: str = ""  # "WxH": the default frame size (requests without one, the workers' start-up
    # timing, the profile and the plan); empty: the preset's (tiny 256x144, wan2.1-t2v-1.3b 832x480)


@dataclass(frozen=True)
class SamplerConfig:
    """Overrides of the preset's sampler; 0 / empty keeps the preset's value."""

    frames_per_block: int = 0
    steps: tuple[int, ...] = ()
    first_block_steps: tuple[int, ...] = ()
    shift: float = 0.0
    window_frames: int = 0
    sink_frames: int = -1
    warp: bool | None = None
    global_sink: bool | None = None
    recache: str = ""  # never | on_request | every_switch


@dataclass(frozen=True)
class TopologyConfig:
    mode: str = "auto"  # auto (planned when no device counts are given, else disaggregated) | disaggregated |
    # aggregated | hybrid
    device: str = "cpu"  # cpu | cuda | xpu
    dit_devices: int = 0  # DiT workers (one per device); 0: planned (mode auto) or 1
    vae_devices: int = 0  # VAE shard workers (one per device); 0: planned (mode auto) or 1
    devices: int = 0  # auto: plan over this many devices (0: every one visible)
    objective: str = "throughput"  # auto: throughput | latency | streams (see placement/planner.py)
    profile: str = ""  # auto: plan from this profile (measured elsewhere: the same model, the same device kind)
    vae_group_size: int = 0  # shards per VAE group; 0 = all VAE devices in one group
    dit_group_size: int = 1  # devices per DiT (Ulysses sequence parallelism, disaggregated only); 1: one each
    threads_per_worker: int = 1  # CPU threads of each worker (on cpu: a "device" is a worker)
    pin_cpus: bool = True  # cpu: pin each worker to its own cores
    share_cores: bool = False  # cpu, disaggregated: a waiting worker lends its cores to the others
    shard_front: bool = False  # VAE groups: also shard the low-resolution front (all-gather attention)
    vae_band_weights: tuple[float, ...] = ()  # rows per shard of a group in these proportions (empty: placed)
    rebalance: bool = True  # band weights follow the shards' measured times while running
    vae_cut: int = 0  # disaggregated, VAE groups of one: the DiT workers also run the decoder's first N stages
    vae_cut_adapt: bool = False  # the cut follows the measured stage times (at shots' starts); a planned one does
    # an adapting cut's exchange: per ms of a decode's stages moved to the DiT, what the DiT's block
    # gains and the VAE's loses (the profile's cut probes measure it; the planner sets it)
    vae_cut_exchange: tuple[float, ...] = (1.0, 1.0)


@dataclass(frozen=True)
class PipelineConfig:
    # per session: blocks generated but not yet delivered. A block passes the DiT, the VAE and
    # the encoder: 3 lets each hold one and leaves no slack, so where two stages are balanced
    # (a VAE cut) one long block stalls the other; 5 measured +5% frames/s there (docs/benchmarks.md).
    max_blocks_in_flight: int = 5
    startup_buffer_s: float = 0.5  # a player starts this long after its first fragment: deadlines count from there
    live_lead_s: float = 1.0  # a live session is generated at most this far ahead of its player's clock
    latent_slots: int = 8
    frame_slots: int = 6
    ready_timeout_s: float = 600.0  # workers must report READY within this
    heartbeat_interval_s: float = 1.0
    heartbeat_timeout_s: float = 10.0  # a silent worker is declared dead
    block_timeout_s: float = 300.0  # a worker busy on one block longer than this is declared stuck
    collective_timeout_s: float = 120.0  # torch.distributed timeout inside a VAE group
    restart_workers: bool = True  # restart a worker (group) that died
    restart_backoff_reset_s: float = 300.0  # a worker up this long restarts without back-off when it next dies
    cpu_memory_budget_bytes: int = 8 * 2**30  # cpu: caches one worker's sessions may hold (devices: 90% of free)
    max_batch: int = 4  # DiT: up to this many sessions' blocks in one forward, where it pays (1: no batching)
    vae_cpu_working_set_bytes: int = 48 * 2**20  # cpu: full-resolution activations per decode call (cache-sized)


@dataclass(frozen=True)
class EncoderConfig:
    kind: str = "libx264"  # libx264 | auto | h264_nvenc | h264_vaapi | h264_qsv | ffmpeg-libx264
    crf: int = 23  # libx264 quality (lower = better, bigger)
    bitrate_kbps: int = 0  # hardware encoders: target bitrate (0 = encoder default)
    keyframe_every_blocks: int = 1  # 1: every fragment starts with an IDR frame
    vaapi_device: str = "/dev/dri/renderD128"
    encode_timeout_s: float = 30.0  # an encoder that opens or encodes a block slower than this fails its session


@dataclass(frozen=True)
class LimitsConfig:
    max_sessions: int = 4  # sessions generating at once; more wait in the queue
    max_queue: int = 16  # waiting sessions beyond which requests get 429
    max_queue_wait_s: float = (
        30.0  # a session predicted to start later than this gets 429 (Retry-After: the prediction)
    )
    target_utilization: float = 0.9  # admit while every stage's predicted busy share stays under this
    min_size: int = 64  # smallest width/height in pixels
    max_width: int = 832
    max_height: int = 480
    min_fps: int = 1
    max_fps: int = 60
    max_frames: int = 2000  # total frames per request
    max_scenes: int = 16
    live_default_s: float = 60.0  # a live video's cap when the request gives no 'seconds'
    live_max_s: float = 3600.0  # the longest cap a live video may ask for
    max_pending_scenes: int = 2  # steered scenes waiting for their first block; more get 429
    max_prompt_chars: int = 2000
    # image-to-video (input_reference): the largest image file, and the most pixels it may decode
    # to (a small file can claim a huge canvas); the request body may exceed server.max_body_bytes
    # by the image's size, and no more
    max_image_bytes: int = 16 * 1024 * 1024
    max_image_pixels: int = 4096 * 4096
    max_jobs: int = 1000  # jobs kept for GET /v1/videos (oldest finished removed first)
    keep_completed_bytes: int = 2 * 1024**3  # finished videos kept in memory, oldest removed first
    keep_completed_s: float = 24 * 3600.0
    keep_completed_min_s: float = 30.0  # a finished video is kept at least this long, whatever the budget


@dataclass(frozen=True)
class StoreConfig:
    dir: str = ""  # finished videos are also written here (a shared filesystem in a cluster); empty = memory only


@dataclass(frozen=True)
class Config:
    server: ServerConfig = field(default_factory=ServerConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    sampler: SamplerConfig = field(default_factory=SamplerConfig)
    topology: TopologyConfig = field(default_factory=TopologyConfig)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    encoder: EncoderConfig = field(default_factory=EncoderConfig)
    limits: LimitsConfig = field(default_factory=LimitsConfig)
    store: StoreConfig = field(default_factory=StoreConfig)

    def replace(self, **sections: dict[str, Any]) -> Config:
        """A copy with some keys of some sections changed, validated: replace(server={"port": 1})."""
        return build(merge(to_dict(self), sections))

    @property
    def model_name(self) -> str:
        return self.model.name or self.model.preset

    @property
    def recache_policy(self) -> str:
        """When a prompt switch re-caches (sampler.recache, else the checkpoint preset's, else
        on_request): what the API checks a scene's `recache` against."""
        cp = checkpoint_preset(self.model.preset)
        return self.sampler.recache or (cp.recache if cp else "on_request")

    @property
    def node(self) -> str:
        """This node's id: [server] node_id, else the hostname, as lowercase letters, digits and '-'."""
        return node_name(self.server.node_id or socket.gethostname())


def node_name(raw: str) -> str:
    name = re.sub(r"[^a-z0-9-]+", "-", raw.lower()).strip("-")
    return name or "node"


def to_dict(cfg: Config) -> dict:
    return {f.name: dataclasses.asdict(getattr(cfg, f.name)) for f in dataclasses.fields(cfg)}


def merge(base: dict, over: dict) -> dict:
    out = {k: dict(v) for k, v in base.items()}
    for section, values in over.items():
        if section not in out:
            raise ConfigError(f"unknown section [{section}]")
        out[section].update(values)
    return out


def _coerce(key: str, tp, value):
    origin = getattr(tp, "__origin__", None)
    if isinstance(tp, types.UnionType) and type(None) in tp.__args__:  # `bool | None`: unset keeps a default
        (inner,) = (a for a in tp.__args__ if a is not type(None))
        return None if value is None else _coerce(key, inner, value)
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key}: expected true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key}: expected an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(f"{key}: expected a number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{key}: expected a string, got {value!r}")
        return value
    if origin is tuple:
        kinds, what = (int | float, "numbers") if tp.__args__[0] is float else (int, "integers")
        if not isinstance(value, list | tuple) or not all(
            isinstance(v, kinds) and not isinstance(v, bool) for v in value
        ):
            raise ConfigError(f"{key}: expected a list of {what}, got {value!r}")
        return tuple(float(v) for v in value) if kinds is not int else tuple(value)
    return value


def build(data: dict) -> Config:
    sections = {}
    for f in dataclasses.fields(Config):
        cls = f.default_factory
        hints = get_type_hints(cls)
        values = dict(data.get(f.name, {}))
        if not isinstance(values, dict):
            raise ConfigError(f"[{f.name}] must be a table")
        unknown = set(values) - set(hints)
        if unknown:
            raise ConfigError(f"unknown key(s) in [{f.name}]: {', '.join(sorted(unknown))}")
        sections[f.name] = cls(**{k: _coerce(f"{f.name}.{k}", hints[k], v) for k, v in values.items()})
    unknown = set(data) - {f.name for f in dataclasses.fields(Config)}
    if unknown:
        raise ConfigError(f"unknown section(s): {', '.join(sorted(unknown))}")
    cfg = Config(**sections)
    if cfg.model.decoder == "taehv" and cfg.topology.vae_group_size == 0:
        # TAEHV is never height-sharded: --vae-gpus k means k decoder replicas, groups of one
        cfg = dataclasses.replace(cfg, topology=dataclasses.replace(cfg.topology, vae_group_size=1))
    validate(cfg)
    return cfg


def load(path: str | Path | None, overrides: dict[str, dict] | None = None) -> Config:
    data: dict = {}
    if path:
        p = Path(path)
        try:
            data = tomllib.loads(p.read_text())
        except FileNotFoundError:
            raise ConfigError(f"config file not found: {p}") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{p}: invalid TOML: {exc}") from None
    base = to_dict(Config())
    merged = merge(base, data) if data else base
    if overrides:
        merged = merge(merged, overrides)
    return build(merged)


OBJECTIVES = ("throughput", "latency", "streams")


def planned(t: TopologyConfig) -> bool:
    """The layout is the planner's to choose: mode auto and no device counts given."""
    return t.mode == "auto" and t.dit_devices == 0 and t.vae_devices == 0


def explicit_layout(t: TopologyConfig) -> TopologyConfig:
    """The layout as given, defaults filled in: auto with device counts means disaggregated
    (`--dit-gpus 1 --vae-gpus 3` works as written), and a count not given is 1."""
    return dataclasses.replace(
        t,
        mode="disaggregated" if t.mode == "auto" else t.mode,
        dit_devices=t.dit_devices or 1,
        vae_devices=t.vae_devices or 1,
    )


def parse_size(text) -> tuple[int, int] | None:
    """ "832x480" (also "832 X 480", "832*480", as the API takes it) -> (832, 480); None if it
    is not a size."""
    mt = re.fullmatch(r"\s*(\d{1,5})\s*[xX*]\s*(\d{1,5})\s*", text) if isinstance(text, str) else None
    return (int(mt[1]), int(mt[2])) if mt else None


def _check(ok: bool, key: str, msg: str, value) -> None:
    if not ok:
        raise ConfigError(f"{key}: {msg}, got {value!r}")


def validate(cfg: Config) -> None:
    s, t, p, e, lim, m = cfg.server, cfg.topology, cfg.pipeline, cfg.encoder, cfg.limits, cfg.model
    _check(0 < s.port < 65536, "server.port", "must be 1-65535", s.port)
    _check(s.max_body_bytes >= 1024, "server.max_body_bytes", "must be >= 1024", s.max_body_bytes)
    _check(
        s.log_level in ("debug", "info", "warning", "error"),
        "server.log_level",
        "must be debug, info, warning or error",
        s.log_level,
    )
    _check(0 <= s.agent_port < 65536, "server.agent_port", "must be 0 (off) or 1-65535", s.agent_port)
    _check(
        s.node_id == "" or re.fullmatch(r"[a-z0-9][a-z0-9-]{0,62}", s.node_id) is not None,
        "server.node_id",
        "must be lowercase letters, digits and '-' (at most 63)",
        s.node_id,
    )
    for k in ("client_write_timeout_s", "request_read_timeout_s", "drain_timeout_s"):
        _check(getattr(s, k) > 0, f"server.{k}", "must be > 0", getattr(s, k))
    _check(m.preset in known_presets(), "model.preset", f"must be one of {', '.join(known_presets())}", m.preset)
    _check(m.preset in EMBEDDED_PRESETS or bool(m.path), "model.path", "is required for real presets", m.path)
    cp = checkpoint_preset(m.preset)
    _check(
        cp is None or bool(m.dit_checkpoint),
        "model.dit_checkpoint",
        f"preset {m.preset} runs the authors' {cp.checkpoint if cp else ''}: give it with --dit-checkpoint FILE",
        m.dit_checkpoint,
    )
    _check(
        cp is None or cp.lora is None or bool(m.lora),
        "model.lora",
        f"preset {m.preset} is its base weights plus a LoRA: give the LoRA file with --lora FILE",
        m.lora,
    )
    _check(m.weights in ("", "ema", "generator"), "model.weights", "must be ema or generator", m.weights)
    _check(m.lora_alpha >= 0, "model.lora_alpha", "must be > 0 (0: the preset's)", m.lora_alpha)
    _check(
        not m.lora or m.lora_alpha > 0 or (cp is not None and cp.lora is not None),
        "model.lora_alpha",
        "is needed with a LoRA that no preset describes (PEFT files do not store it)",
        m.lora_alpha,
    )
    _check(
        cfg.sampler.recache in ("", "never", "on_request", "every_switch"),
        "sampler.recache",
        "must be never, on_request or every_switch",
        cfg.sampler.recache,
    )
    _check(
        m.compile in ("auto", "on", "off"),
        "model.compile",
        "must be auto, on or off",
        m.compile,
    )
    _check(
        m.dtype in ("auto", "float32", "bfloat16", "float16"),
        "model.dtype",
        "must be auto, float32, bfloat16 or float16",
        m.dtype,
    )
    _check(m.decoder in ("wan", "taehv"), "model.decoder", "must be wan or taehv", m.decoder)
    _check(
        not m.decoder_weights or m.decoder == "taehv",
        "model.decoder_weights",
        "are TAEHV's (--decoder taehv); the Wan VAE's come with --model",
        m.decoder_weights,
    )
    _check(
        not m.decoder_weights or Path(m.decoder_weights).expanduser().is_file(),
        "model.decoder_weights",
        "file not found",
        m.decoder_weights,
    )
    _check(
        m.decoder != "taehv" or m.preset == "tiny" or bool(m.decoder_weights),
        "model.decoder_weights",
        f"--decoder taehv with preset {m.preset} needs TAEHV's weights (--decoder-weights taew2_1.pth); "
        "only the embedded default draws them",
        m.decoder_weights,
    )
    _check(0 < m.dit_vae_ratio <= 20, "model.dit_vae_ratio", "must be in (0, 20]", m.dit_vae_ratio)
    _check(
        t.mode in ("auto", "disaggregated", "aggregated", "hybrid"),
        "topology.mode",
        "must be auto, disaggregated, aggregated or hybrid",
        t.mode,
    )
    _check(t.objective in OBJECTIVES, "topology.objective", f"must be {', '.join(OBJECTIVES)}", t.objective)
    _check(0 <= t.devices <= 64, "topology.devices", "must be 0-64", t.devices)
    _check(0 <= t.dit_devices <= 64, "topology.dit_devices", "must be 1-64 (0: planned or 1)", t.dit_devices)
    _check(0 <= t.vae_devices <= 64, "topology.vae_devices", "must be 1-64 (0: planned or 1)", t.vae_devices)
    if not planned(t):
        t = explicit_layout(t)
    _check(
        t.mode != "hybrid" or t.vae_devices > t.dit_devices,
        "topology.vae_devices",
        f"hybrid: the VAE group spans the DiT's devices and more (more than dit_devices = {t.dit_devices})",
        t.vae_devices,
    )
    _check(t.device in KINDS, "topology.device", f"must be {', '.join(KINDS[:-1])} or {KINDS[-1]}", t.device)
    group = t.vae_group_size or t.vae_devices or 1
    _check(
        group >= 1 and t.vae_devices % group == 0,
        "topology.vae_group_size",
        f"must divide vae_devices ({t.vae_devices})",
        t.vae_group_size,
    )
    _check(
        1 <= t.dit_group_size <= 64 and t.dit_devices % t.dit_group_size == 0,
        "topology.dit_group_size",
        f"must be 1-64 and divide dit_devices ({t.dit_devices})",
        t.dit_group_size,
    )
    # A DiT group runs on DiT devices of its own, or (aggregated) on exactly the devices of the
    # one VAE group, whose process group it shares: the same ranks in the same processes.
    one_group = t.mode == "aggregated" and t.dit_group_size == t.dit_devices == t.vae_devices == group
    _check(
        t.dit_group_size == 1 or (not planned(t) and (t.mode == "disaggregated" or one_group)),
        "topology.dit_group_size",
        "a DiT group needs --dit-gpus: in mode disaggregated, or in mode aggregated over all the devices of "
        "the one VAE group (--dit-gpus G --vae-gpus G)" + ("" if planned(t) else f", not mode {t.mode}"),
        t.dit_group_size,
    )
    _check(
        not t.vae_band_weights or (len(t.vae_band_weights) == group and all(0 < w < 1e6 for w in t.vae_band_weights)),
        "topology.vae_band_weights",
        f"must be empty or {group} positive numbers (one per shard of a group)",
        list(t.vae_band_weights),
    )
    taehv = m.decoder == "taehv"  # TAEHV decodes whole frames on one worker: no groups, no cut, no hybrid
    _check(
        not taehv or group == 1,
        "topology.vae_group_size",
        "height sharding is the Wan VAE's: TAEHV does not need it (--vae-gpus k runs k TAEHV replicas, "
        "--vae-group-size 1)",
        t.vae_group_size,
    )
    _check(not taehv or t.mode != "hybrid", "topology.mode", "hybrid shards the Wan VAE: not with TAEHV", t.mode)
    _check(not taehv or t.vae_cut == 0, "topology.vae_cut", "cuts the Wan VAE's stages: not with TAEHV", t.vae_cut)
    _check(1 <= t.threads_per_worker <= 256, "topology.threads_per_worker", "must be 1-256", t.threads_per_worker)
    _check(0 <= t.vae_cut <= 64, "topology.vae_cut", "must be 0-64 (0: the VAE workers decode whole)", t.vae_cut)
    _check(
        t.vae_cut == 0 or (not planned(t) and t.mode == "disaggregated" and group == 1 and t.dit_group_size == 1),
        "topology.vae_cut",
        "needs an explicit layout (--dit-gpus, --vae-gpus) in mode disaggregated with VAE groups of one shard "
        "(--vae-group-size 1) and no DiT group",
        t.vae_cut,
    )
    _check(
        not t.share_cores
        or (
            t.device == "cpu"
            and not planned(t)
            and t.mode in ("auto", "disaggregated")
            and t.dit_devices == 1
            and t.vae_devices == 1
            and t.pin_cpus
        ),
        "topology.share_cores",
        "lends a waiting worker's cores to the other: it needs device cpu, topology.pin_cpus (each worker's "
        "own cores) and the layout --dit-gpus 1 --vae-gpus 1 in mode disaggregated (with more workers, "
        "several would borrow the same cores)",
        t.share_cores,
    )
    _check(
        not t.vae_cut_adapt or t.vae_cut > 0,
        "topology.vae_cut_adapt",
        "moves a cut: it needs topology.vae_cut (--vae-cut N) to start from",
        t.vae_cut_adapt,
    )
    _check(
        len(t.vae_cut_exchange) == 2 and all(0.25 <= x <= 4 for x in t.vae_cut_exchange),
        "topology.vae_cut_exchange",
        "must be two numbers 0.25-4 (the DiT's gain and the VAE's loss per ms of stages a cut moves)",
        list(t.vae_cut_exchange),
    )
    _check(p.max_blocks_in_flight >= 1, "pipeline.max_blocks_in_flight", "must be >= 1", p.max_blocks_in_flight)
    _check(p.latent_slots >= 2, "pipeline.latent_slots", "must be >= 2", p.latent_slots)
    _check(p.frame_slots >= 2, "pipeline.frame_slots", "must be >= 2", p.frame_slots)
    _check(1 <= p.max_batch <= 16, "pipeline.max_batch", "must be 1-16", p.max_batch)
    _check(
        p.vae_cpu_working_set_bytes >= 4096,
        "pipeline.vae_cpu_working_set_bytes",
        "must be >= 4096",
        p.vae_cpu_working_set_bytes,
    )
    for k in (
        "ready_timeout_s",
        "heartbeat_interval_s",
        "heartbeat_timeout_s",
        "block_timeout_s",
        "collective_timeout_s",
        "restart_backoff_reset_s",
        "startup_buffer_s",
        "live_lead_s",
    ):
        _check(getattr(p, k) > 0, f"pipeline.{k}", "must be > 0", getattr(p, k))
    _check(
        p.heartbeat_timeout_s > p.heartbeat_interval_s,
        "pipeline.heartbeat_timeout_s",
        "must exceed heartbeat_interval_s",
        p.heartbeat_timeout_s,
    )
    _check(
        e.kind in ("libx264", "auto", "h264_nvenc", "h264_vaapi", "h264_qsv", "ffmpeg-libx264"),
        "encoder.kind",
        "must be libx264, auto, h264_nvenc, h264_vaapi, h264_qsv or ffmpeg-libx264",
        e.kind,
    )
    _check(0 <= e.crf <= 51, "encoder.crf", "must be 0-51", e.crf)
    _check(e.keyframe_every_blocks >= 1, "encoder.keyframe_every_blocks", "must be >= 1", e.keyframe_every_blocks)
    _check(e.encode_timeout_s > 0, "encoder.encode_timeout_s", "must be > 0", e.encode_timeout_s)
    _check(lim.max_sessions >= 1, "limits.max_sessions", "must be >= 1", lim.max_sessions)
    _check(lim.max_queue >= 0, "limits.max_queue", "must be >= 0", lim.max_queue)
    _check(lim.max_queue_wait_s >= 0, "limits.max_queue_wait_s", "must be >= 0", lim.max_queue_wait_s)
    _check(
        0 < lim.target_utilization <= 1.5,
        "limits.target_utilization",
        "must be in (0, 1.5]",
        lim.target_utilization,
    )
    _check(
        p.cpu_memory_budget_bytes >= 2**20,
        "pipeline.cpu_memory_budget_bytes",
        "must be >= 1 MiB",
        p.cpu_memory_budget_bytes,
    )
    _check(
        16 <= lim.min_size <= min(lim.max_width, lim.max_height),
        "limits.min_size",
        "must be >= 16 and <= max_width and max_height",
        lim.min_size,
    )
    _check(
        lim.max_width % 16 == 0 and lim.max_height % 16 == 0,
        "limits.max_width",
        "max_width and max_height must be multiples of 16",
        (lim.max_width, lim.max_height),
    )
    if m.size:
        wh = parse_size(m.size)
        _check(wh is not None, "model.size", "must look like 832x480", m.size)
        w, h = wh
        _check(w % 16 == 0 and h % 16 == 0, "model.size", "width and height must be multiples of 16", m.size)
        _check(
            lim.min_size <= w <= lim.max_width and lim.min_size <= h <= lim.max_height,
            "model.size",
            f"must be within {lim.min_size}x{lim.min_size} .. {lim.max_width}x{lim.max_height} (limits)",
            m.size,
        )
    _check(
        1 <= lim.min_fps <= lim.max_fps <= 240,
        "limits.max_fps",
        "need 1 <= min_fps <= max_fps <= 240",
        (lim.min_fps, lim.max_fps),
    )
    _check(lim.max_frames >= 1, "limits.max_frames", "must be >= 1", lim.max_frames)
    _check(lim.max_scenes >= 1, "limits.max_scenes", "must be >= 1", lim.max_scenes)
    _check(lim.live_max_s > 0, "limits.live_max_s", "must be > 0", lim.live_max_s)
    _check(
        0 < lim.live_default_s <= lim.live_max_s,
        "limits.live_default_s",
        "must be > 0 and <= live_max_s",
        lim.live_default_s,
    )
    _check(lim.max_pending_scenes >= 1, "limits.max_pending_scenes", "must be >= 1", lim.max_pending_scenes)
    _check(lim.max_prompt_chars >= 1, "limits.max_prompt_chars", "must be >= 1", lim.max_prompt_chars)
    _check(lim.max_image_bytes >= 1024, "limits.max_image_bytes", "must be >= 1024", lim.max_image_bytes)
    _check(lim.max_image_pixels >= 1, "limits.max_image_pixels", "must be >= 1", lim.max_image_pixels)
    _check(lim.max_jobs >= 1, "limits.max_jobs", "must be >= 1", lim.max_jobs)
    _check(
        0 <= lim.keep_completed_min_s <= lim.keep_completed_s,
        "limits.keep_completed_min_s",
        "must be between 0 and keep_completed_s",
        lim.keep_completed_min_s,
    )


def injected_faults() -> str:
    """STREAMDIFF_FAULTS: deliberate worker faults for the fault-injection tests (workers/faults.py)."""
    return os.environ.get("STREAMDIFF_FAULTS", "")


def sampler_overrides(cfg: Config) -> dict:
    """The [sampler] keys that were set, as ModelSpec.sampler wants them."""
    s, out = cfg.sampler, {}
    if s.frames_per_block:
        out["frames_per_block"] = s.frames_per_block
    if s.steps:
        out["steps"] = list(s.steps)
    if s.first_block_steps:
        out["first_block_steps"] = list(s.first_block_steps)
    if s.shift:
        out["shift"] = s.shift
    if s.window_frames:
        out["window_frames"] = s.window_frames
    if s.sink_frames >= 0:
        out["sink_frames"] = s.sink_frames
    for key in ("warp", "global_sink"):
        if getattr(s, key) is not None:
            out[key] = getattr(s, key)
    if s.recache:
        out["recache"] = s.recache
    return out
