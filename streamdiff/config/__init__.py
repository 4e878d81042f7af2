"""Daemon configuration: one frozen dataclass tree, loaded from TOML, overridden by CLI flags
(supervisor process; workers receive the parts they need).

Every key is documented in etc/streamdiff.toml. Unknown keys and invalid values are rejected
at start with a message that names the key (`ConfigError`). The environment is read here only
(`STREAMDIFF_API_KEYS`, `NOTIFY_SOCKET` is read by sdnotify).

This module is the schema: the sections, their keys and defaults. `loader.py` reads TOML and
overrides into it (and is the only way to a validated Config), `checks.py` rejects bad values,
and `layout.py` holds the rules of which layouts are legal (shared with placement/ and the
supervisor's topology).
"""

from __future__ import annotations

import os
import re
import socket
from dataclasses import dataclass, field

from ..models.spec import DEFAULT_PRESET


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
    # STUN/TURN servers a WHEP viewer's connection may use (stun:host:port, turn:host:port); empty:
    # host candidates only, nothing reaches out
    webrtc_ice_servers: tuple[str, ...] = ()
    # The addresses a WHEP peer gathers host candidates on; empty: the listening address's (every
    # interface only when `host` is a wildcard, 0.0.0.0 or ::)
    webrtc_host_addresses: tuple[str, ...] = ()
    webrtc_max_candidates: int = 64  # ICE candidates in one WHEP offer; more gets 400
    webrtc_connect_timeout_s: float = 15.0  # a WHEP peer that has not finished ICE and DTLS by then is closed
    webrtc_max_peers_per_video: int = 16  # WHEP viewers of one video; one more gets 429
    webrtc_max_peers: int = 64  # WHEP viewers of the whole daemon; one more gets 503
    # Every JSON a client sends (bodies, form fields, WebSocket and data-channel messages):
    json_max_depth: int = 32  # arrays and objects nested inside each other
    json_max_entries: int = 131072  # array elements and object members (a 4096-frame camera script is ~100k)
    json_max_number_digits: int = 64  # the digits of one number


@dataclass(frozen=True)
class ModelConfig:
    preset: str = DEFAULT_PRESET  # a DiT configuration or a checkpoint preset (`streamdiffd models`)
    path: str = ""  # weights directory for real presets
    dit_checkpoint: str = ""  # Causal Forcing / Self-Forcing generator .pt (a checkpoint preset's file)
    weights: str = ""  # ema | generator: the training checkpoint's weight set (empty: the preset's)
    lora: str = ""  # a PEFT LoRA merged into the DiT at load (LongLive's lora.pt)
    lora_alpha: float = 0.0  # the LoRA's alpha (0: the preset's)
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    decoder: str = "wan"  # wan (the Wan 2.1 VAE) | taehv (the tiny real-time decoder: faster, lower quality)
    decoder_weights: str = ""  # taehv: taew2_1.pth / .safetensors (empty: seeded weights, embedded default only)
    # torch.compile the DiT's blocks and the VAE's norms: auto (accelerators; eager on a compile error) | on | off
    compile: str = "auto"
    dit_vae_ratio: float = 0.74  # tiny only: DiT cost per block relative to the VAE
    seed: int = 1234  # tiny only: weight seed
    name: str = ""  # model id in the API (default: the preset name)
    size: str = ""  # "WxH": the default frame size (requests without one, the workers' start-up
    # timing, the profile and the plan); empty: the preset's (tiny 256x144, wan2.1-t2v-1.3b 832x480)


@dataclass(frozen=True)
class SamplerOverrides:
    """[sampler]: overrides of the preset's sampler; 0 / empty keeps the preset's value. The
    settings themselves are models/wan/sampler.py's `SamplerConfig` (its defaults, its checks):
    these keys are a subset of its fields, applied to the preset's (`sampler_overrides`,
    presets.get_preset)."""

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
    # (a VAE cut) one long block stalls the other (docs/design.md#data-plane-and-control-plane)
    max_blocks_in_flight: int = 5
    startup_buffer_s: float = 0.5  # a player starts this long after its first fragment: deadlines count from there
    live_lead_s: float = 1.0  # a live session is generated at most this far ahead of its player's clock
    latent_slots: int = 8
    frame_slots: int = 6
    ready_timeout_s: float = 600.0  # workers must report READY within this
    heartbeat_interval_s: float = 1.0
    heartbeat_timeout_s: float = 10.0  # a silent worker is declared dead
    block_timeout_s: float = 300.0  # a worker busy on one block longer than this is declared stuck
    # torch.distributed timeout inside a VAE or DiT group: it must cover a rank that compiles or
    # loads cold while its peers wait in the first collective of calibration (a stuck block is
    # block_timeout_s's to catch, sooner)
    collective_timeout_s: float = 600.0
    restart_workers: bool = True  # restart a worker (group) that died
    restart_backoff_reset_s: float = 300.0  # a worker up this long restarts without back-off when it next dies
    cpu_memory_budget_bytes: int = 8 * 2**30  # cpu: caches one worker's sessions may hold (devices: 90% of free)
    max_batch: int = 4  # DiT: up to this many sessions' blocks in one forward, where it pays (1: no batching)
    vae_cpu_working_set_bytes: int = 48 * 2**20  # cpu: full-resolution activations per decode call (cache-sized)
    # the workers' start-up figures are stored here and read by a later start with the same model,
    # device and layout instead of measured (workers/calibration.py); empty: measured at every start
    calibration_dir: str = ""
    # a JSON file of start-up timings every worker reports instead of timing blocks (the test
    # suite's; ipc/messages.py GivenCalibration); empty: timed, or read from calibration_dir
    calibration_given: str = ""


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
class OutputsConfig:
    """[outputs]: the ingests a video may be pushed to (`"outputs": ["name"]` in a request),
    repackaged by an ffmpeg child without re-encoding. Named here by the operator alone: a
    request names one, never a URL, so the server connects to nothing a request chooses."""

    destinations: dict[str, str] = field(default_factory=dict)  # name -> rtmp://, rtmps:// or srt:// URL
    retry_max_s: float = 30.0  # a failed push is retried after 1, 2, 4 ... s, at most this long apart


@dataclass(frozen=True)
class Config:
    server: ServerConfig = field(default_factory=ServerConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    sampler: SamplerOverrides = field(default_factory=SamplerOverrides)
    topology: TopologyConfig = field(default_factory=TopologyConfig)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    encoder: EncoderConfig = field(default_factory=EncoderConfig)
    limits: LimitsConfig = field(default_factory=LimitsConfig)
    store: StoreConfig = field(default_factory=StoreConfig)
    outputs: OutputsConfig = field(default_factory=OutputsConfig)

    @property
    def model_name(self) -> str:
        return self.model.name or self.model.preset

    @property
    def node(self) -> str:
        """This node's id: [server] node_id, else the hostname, as lowercase letters, digits and '-'."""
        return node_name(self.server.node_id or socket.gethostname())


def node_name(raw: str) -> str:
    name = re.sub(r"[^a-z0-9-]+", "-", raw.lower()).strip("-")
    return name or "node"


OBJECTIVES = ("throughput", "latency", "streams")


def parse_size(text) -> tuple[int, int] | None:
    """ "832x480" (also "832 X 480", "832*480", as the API takes it) -> (832, 480); None if it
    is not a size."""
    mt = re.fullmatch(r"\s*(\d{1,5})\s*[xX*]\s*(\d{1,5})\s*", text) if isinstance(text, str) else None
    return (int(mt[1]), int(mt[2])) if mt else None


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
