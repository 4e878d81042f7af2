"""The published causal Wan checkpoints as presets: every setting their authors' inference uses (torch-free;
read by the supervisor, the CLI and the workers).

A checkpoint preset names a DiT architecture (`dit`, a configuration of `presets.py`) and fixes
what the authors' own script sets: which weight set of the training checkpoint it loads, the step
list and its warp, the block size, the attention window and sinks, the re-cache policy on a prompt
switch, and the LoRA that completes the weights. Where each value comes from (repository, file,
key) is recorded in docs/published-models.md. Every setting can still be overridden one by one
(`[sampler]`, `--weights`, `--lora-alpha`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from ..card import IMAGE_MODES, Lora

WEIGHT_SETS = ("ema", "generator")  # `generator_ema` or `generator` of a training checkpoint

# "Global" attention in the authors' code is a KV cache the size of their whole video: 21 latent
# frames (81 frames at 16 fps). A stream here may run longer, so a global model's window slides
# at that length.
GLOBAL_WINDOW_FRAMES = 21


@dataclass(frozen=True)
class CheckpointPreset:
    name: str
    source: str  # the authors' repository (github owner/name)
    checkpoint: str  # the file the authors ship, as their README names it
    weights: str  # "ema" | "generator": the set the authors' inference loads
    steps: tuple[int, ...]  # the step list as the authors write it, before any warp
    shift: float  # flow-matching timestep shift
    warp: bool  # map the steps through the shifted schedule (warp_denoising_step)
    first_block_steps: tuple[int, ...] | None  # a shot's first block's own list (Causal Forcing++)
    frames_per_block: int  # latent frames per block
    window: int | None  # attention window in latent frames, the current block included; None: global
    sink: int  # frames at a shot's start never evicted
    global_sink: bool  # a re-cache leaves the sinks' keys/values as they were written
    recache: str  # never | on_request | every_switch: when a prompt switch recomputes the window's cache
    lora: Lora | None  # the PEFT adapter the authors merge before inference
    dit: str  # the DiT configuration (presets.py)
    sampler: str = "block"  # block | rolling (Rolling Forcing's window of blocks at staggered noise levels)
    kv_recompute: bool = False  # Krea: each block recomputes its context's keys/values under the prompt
    i2v: bool = False  # the authors condition this checkpoint on an image (image-to-video)
    # LongLive 2.0's multi-shot: a cut keeps the history, the next shot's RoPE positions moved on
    # by this many frames a shot and its first block pinned as a shot sink (SamplerConfig.shot_offset)
    shot_offset: int = 0
    # The control space a world model takes (controls.SPACES: "camera" is minWM's, PRoPE in the
    # DiT and a pose per latent frame); None: prompts only.
    controls: str | None = None
    # How the authors lay out a shot's noise up front: (1, F, C, h, w) "fchw" (Self-Forcing's),
    # or (1, C, F, h, w) "cfhw" (Matrix-Game's); the same draws, another order of the values
    noise_layout: str = "fchw"
    # How an image (`i2v`) starts its shot (IMAGE_MODES): "block", the shot's first latent frame as
    # a block of its own (Causal Forcing); "first_frame", the first latent frame of the shot's first
    # block, held clean at t = 0 through its steps (LongLive 2.0); "condition", beside every block's
    # noise, with its CLIP tokens as the context and no text (Matrix-Game)
    image: str = "block"

    def __post_init__(self) -> None:
        if self.image not in IMAGE_MODES:
            raise ValueError(f"{self.name}: image must be one of {', '.join(IMAGE_MODES)}, got {self.image!r}")

    @property
    def prope(self) -> bool:
        """Whether its DiT has minWM's camera path (models/wan/prope.py)."""
        return self.controls == "camera"

    @property
    def image_block(self) -> bool:
        """Whether the image is a block of its own (plan.Scene.image_block)."""
        return self.image == "block"

    def to_json(self) -> dict:
        """The fields `streamdiffd models --json` prints, exactly."""
        d = asdict(self)
        out = {k: d[k] for k in JSON_FIELDS}
        out["steps"] = list(self.steps)
        out["first_block_steps"] = list(self.first_block_steps) if self.first_block_steps else None
        out["lora"] = {"rank": self.lora.rank, "alpha": self.lora.alpha} if self.lora else None
        return out

    @property
    def window_frames(self) -> int:
        return self.window if self.window is not None else GLOBAL_WINDOW_FRAMES

    def sampler_settings(self) -> dict:
        """This preset's values of the models' `SamplerConfig` fields."""
        return {
            "frames_per_block": self.frames_per_block,
            "steps": self.steps,
            "first_block_steps": self.first_block_steps,
            "shift": self.shift,
            "warp": self.warp,
            "window_frames": self.window_frames,
            "sink_frames": self.sink,
            "global_sink": self.global_sink,
            "recache": self.recache,
            "kind": self.sampler,
            "kv_recompute": self.kv_recompute,
            "shot_offset": self.shot_offset,
        }


JSON_FIELDS = (
    "name",
    "source",
    "checkpoint",
    "weights",
    "steps",
    "shift",
    "warp",
    "first_block_steps",
    "frames_per_block",
    "window",
    "sink",
    "global_sink",
    "recache",
    "lora",
    "dit",
    "controls",
    "shot_offset",
)

_FOUR = (1000, 750, 500, 250)
_CF = "thu-ml/Causal-Forcing"
_MG = "SkyworkAI/Matrix-Game"


def _p(name: str, source: str, checkpoint: str, weights: str, **kw) -> CheckpointPreset:
    base = dict(
        steps=_FOUR,
        shift=5.0,
        warp=True,
        first_block_steps=None,
        frames_per_block=3,
        window=None,
        sink=0,
        global_sink=False,
        recache="on_request",
        lora=None,
        dit="wan2.1-t2v-1.3b",
    )
    base.update(kw)
    return CheckpointPreset(name, source, checkpoint, weights, **base)


# Krea (release_server.py): before each block the KV cache is rebuilt from kv_cache_num_frames = 3
# clean context frames (the first frame and the newest two) at t=0 under the current prompt, and
# the block attends to those 3 plus itself: a window of 6 with the first frame as a sink of 1.
# Their default re-encodes the first context frame from a decoded pixel frame (a VAE encoder the
# DiT worker does not have); this is their `keep_first_frame` form, which keeps the shot's first
# latent (docs/published-models.md).
CHECKPOINT_PRESETS: dict[str, CheckpointPreset] = {
    p.name: p
    for p in (
        _p("self-forcing", "guandeh17/Self-Forcing", "checkpoints/self_forcing_dmd.pt", "ema"),
        _p("causvid", "tianweiy/CausVid", "autoregressive_checkpoint/model.pt", "generator",
           steps=(1000, 757, 522), shift=8.0, warp=False),
        _p("causal-forcing", _CF, "chunkwise/causal_forcing.pt", "generator"),
        _p("causal-forcing-framewise", _CF, "framewise/causal_forcing.pt", "ema", frames_per_block=1, i2v=True),
        _p("causal-forcing-2step", _CF, "causal-forcing++/framewise-2step.pt", "ema",
           steps=(1000, 500), first_block_steps=_FOUR, frames_per_block=1),
        _p("causal-forcing-1step", _CF, "causal-forcing++/framewise-1step.pt", "ema",
           steps=(1000,), first_block_steps=_FOUR, frames_per_block=1),
        _p("causal-forcing-longvideo", _CF, "chunkwise/longvideo.pt", "ema", window=21, sink=3, sampler="rolling"),
        _p("longlive", "NVlabs/LongLive", "longlive_base.pt", "generator",
           window=12, sink=3, global_sink=True, recache="every_switch", lora=Lora(256, 256.0)),
        _p("rolling-forcing", "TencentARC/RollingForcing", "rolling_forcing_dmd.pt", "ema",
           steps=(1000, 800, 600, 400, 200), window=21, sink=3, sampler="rolling"),
        _p("krea-realtime-14b", "krea-ai/realtime-video", "krea-realtime-video-14b.safetensors", "generator",
           steps=(1000, 750, 500, 250, 0), window=6, sink=1, dit="wan2.1-t2v-14b", kv_recompute=True),
        # LongLive 2.0: the UniPC solver's 4 timesteps at shift 5 (sampler.unipc_timesteps)
        _p("longlive2-5b", "NVlabs/LongLive", "model_bf16.pt", "generator", steps=(1000, 937, 833, 625),
           warp=False, frames_per_block=8, window=32, sink=8, recache="never", lora=Lora(128, 128.0),
           dit="wan2.2-ti2v-5b", sampler="unipc", shot_offset=8, i2v=True, image="first_frame"),
        # minWM Wan 2.1 Action2V (configs/causal_forcing_dmd_camera.yaml): Self-Forcing's steps,
        # 4 frames a block, a window of 20 and no sink; the stock T2V 1.3B plus PRoPE. No re-cache:
        # the held frames' cameras are not kept, and the authors switch no prompt.
        _p("minwm-action2v", "shengshu-ai/minWM", "ckpts/Wan21/Action2V/dmd/model.pt", "ema",
           frames_per_block=4, window=20, recache="never", controls="camera"),
        # Matrix-Game 2.0 (Matrix-Game-2/configs/inference_yaml/*.yaml, distilled_model/*/config.json):
        # an image-to-video DiT with no text branch, 3 frames a block, no sink; a flat safetensors
        *(_p(f"matrix-game-2-{name}", _MG, ck, "generator", steps=steps, window=window, recache="never",
             dit="matrix-game-2", i2v=True, controls=f"matrix-game-{name}", noise_layout="cfhw", image="condition")
          for name, ck, steps, window in (
              ("universal", "base_distilled_model/base_distill.safetensors", (1000, 666, 333), 6),
              ("gta-drive", "gta_distilled_model/gta_keyboard2dim.safetensors", (1000, 666, 333), 4),
              ("templerun", "templerun_distilled_model/templerun_7dim_onlykey.safetensors", (1000, 750, 500, 250), 6),
          )),
    )
}  # fmt: skip


def checkpoint_preset(name: str) -> CheckpointPreset | None:
    return CHECKPOINT_PRESETS.get(name)


def table() -> str:
    """The presets as a text table (`streamdiffd models`)."""
    rows = [("preset", "checkpoint", "weights", "steps", "shift", "warp", "block", "window/sink", "recache", "DiT")]
    for p in CHECKPOINT_PRESETS.values():
        steps = ",".join(map(str, p.steps)) + (f" (first {len(p.first_block_steps)})" if p.first_block_steps else "")
        win = f"{p.window if p.window is not None else 'global'}/{p.sink}" + (" global" if p.global_sink else "")
        extra = " +LoRA" if p.lora else ""
        rows.append(
            (p.name, p.checkpoint + extra, p.weights, steps, f"{p.shift:g}", "yes" if p.warp else "no",
             str(p.frames_per_block), win, p.recache, p.dit)
        )  # fmt: skip
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows)
