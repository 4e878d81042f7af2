"""The checks of a Config's values, each refused with a message that names its key; which
layouts are legal is layout.py's (`broken_rule`)."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

from ..ipc.messages import read_given_calibration
from ..models.spec import known_presets, preset_card
from ..platform.base import KINDS
from . import OBJECTIVES, Config, ConfigError, parse_size
from .layout import broken_rule


def _check(ok: bool, key: str, msg: str, value) -> None:
    if not ok:
        raise ConfigError(f"{key}: {msg}, got {value!r}")


def _is_address(a) -> bool:
    import ipaddress

    try:
        ipaddress.ip_address(a)
        return True
    except ValueError:
        return False


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
    for k in ("json_max_depth", "json_max_entries", "json_max_number_digits", "webrtc_max_candidates"):
        _check(getattr(s, k) >= 1, f"server.{k}", "must be >= 1", getattr(s, k))
    for k in ("webrtc_max_peers_per_video", "webrtc_max_peers"):
        _check(getattr(s, k) >= 0, f"server.{k}", "must be >= 0 (0: no WHEP viewers)", getattr(s, k))
    _check(s.json_max_number_digits >= 20, "server.json_max_number_digits", "must be >= 20 (a seed)",
           s.json_max_number_digits)  # fmt: skip
    for a in s.webrtc_host_addresses:
        _check(_is_address(a), "server.webrtc_host_addresses", "must be IP addresses", a)
    for k in ("client_write_timeout_s", "request_read_timeout_s", "drain_timeout_s", "webrtc_connect_timeout_s"):
        _check(getattr(s, k) > 0, f"server.{k}", "must be > 0", getattr(s, k))
    _check(m.preset in known_presets(), "model.preset", f"must be one of {', '.join(known_presets())}", m.preset)
    card = preset_card(m.preset)
    _check(card.embedded or bool(m.path), "model.path", "is required for real presets", m.path)
    _check(
        card.checkpoint is None or bool(m.dit_checkpoint),
        "model.dit_checkpoint",
        f"preset {m.preset} runs the authors' {card.checkpoint}: give it with --dit-checkpoint FILE",
        m.dit_checkpoint,
    )
    _check(
        card.lora is None or bool(m.lora),
        "model.lora",
        f"preset {m.preset} is its base weights plus a LoRA: give the LoRA file with --lora FILE",
        m.lora,
    )
    _check(m.weights in ("", "ema", "generator"), "model.weights", "must be ema or generator", m.weights)
    _check(m.lora_alpha >= 0, "model.lora_alpha", "must be > 0 (0: the preset's)", m.lora_alpha)
    _check(
        not m.lora or m.lora_alpha > 0 or card.lora is not None,
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
        card.can_recache or cfg.sampler.recache in ("", "never"),
        "sampler.recache",
        f"preset {m.preset} cannot re-cache (its held frames' cameras are not kept): never",
        cfg.sampler.recache,
    )
    _check(
        card.dit_group or t.dit_group_size == 1,
        "topology.dit_group_size",
        f"preset {m.preset}'s action modules run on one device: 1",
        t.dit_group_size,
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
        m.decoder != "taehv" or card.embedded or bool(m.decoder_weights),
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
    _check(t.device in KINDS, "topology.device", f"must be {', '.join(KINDS[:-1])} or {KINDS[-1]}", t.device)
    _check(1 <= t.threads_per_worker <= 256, "topology.threads_per_worker", "must be 1-256", t.threads_per_worker)
    _check(0 <= t.vae_cut <= 64, "topology.vae_cut", "must be 0-64 (0: the VAE workers decode whole)", t.vae_cut)
    _check(
        len(t.vae_cut_exchange) == 2 and all(0.25 <= x <= 4 for x in t.vae_cut_exchange),
        "topology.vae_cut_exchange",
        "must be two numbers 0.25-4 (the DiT's gain and the VAE's loss per ms of stages a cut moves)",
        list(t.vae_cut_exchange),
    )
    broken = broken_rule(t, m.decoder)
    if broken is not None:
        raise ConfigError(f"{broken.key}: {broken.rule}, got {broken.value!r}")
    for url in s.webrtc_ice_servers:
        _check(
            re.match(r"(stun|turns?):[^\s]+$", url) is not None,
            "server.webrtc_ice_servers",
            "must be stun: or turn: URLs",
            url,
        )
    o = cfg.outputs
    for name, url in o.destinations.items():
        _check(
            re.fullmatch(r"[a-z0-9][a-z0-9_-]{0,62}", name) is not None,
            "outputs.destinations",
            "names must be lowercase letters, digits, '-' and '_'",
            name,
        )
        _check(
            re.match(r"(rtmps?|srt)://[^\s]+$", url) is not None,
            f"outputs.destinations.{name}",
            "must be an rtmp://, rtmps:// or srt:// URL",
            url,
        )
    _check(o.retry_max_s >= 1, "outputs.retry_max_s", "must be >= 1", o.retry_max_s)
    if o.destinations and shutil.which("ffmpeg") is None:
        raise ConfigError("outputs.destinations: pushing needs ffmpeg on the PATH, which is not installed")
    if p.calibration_given:
        try:
            read_given_calibration(p.calibration_given)
        except ValueError as exc:
            raise ConfigError(f"pipeline.calibration_given: {exc}") from None
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
    # 0 is lossless, which libx264 refuses under the baseline profile every stream is encoded in
    # (media/encoder.py): each video then failed to start.
    _check(1 <= e.crf <= 51, "encoder.crf", "must be 1-51 (0 is lossless: not in H.264 baseline)", e.crf)
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
