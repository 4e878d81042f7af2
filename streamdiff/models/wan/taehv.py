"""TAEHV, the tiny real-time decoder for Wan latents, streaming per block (runs in the VAE worker process).

TAEHV (madebyollin/taehv, weights `taew2_1.pth` / `taew2_1.safetensors`) is a small
convolutional decoder distilled to map the same normalised 16-channel latents the Wan 2.1 VAE
takes to frames: no latent mean/std is applied, 2D convolutions per frame, and time enters in
two ways only:

- a `MemBlock` sees its input frame beside its input of the previous frame (zeros before a
  shot's first frame): its causal memory is one frame per block, nothing else;
- a `TGrow` turns each frame into `stride` frames by a 1x1 convolution to `stride` times the
  channels, sub-frame j taking channel group j.

Written here from that published description; the parameter names and module indices follow
the published file, so it loads as released (its encoder's keys are checked and kept, never
run: we only decode). With the Wan 2.1 settings (time upscale off, on, on) each latent frame
yields 4 frames. The authors' `decode_video` drops the first `4 - 1 = 3` frames of a clip, so n
latent frames give 4n - 3 = 1 + 4(n - 1), the Wan VAE's count. We drop those 3 frames at each
shot's start (its first block: `TAEHVState.latent_frames == 0`) and nowhere else, so a block
has exactly the Wan VAE's frame count (`VAEConfig.frames_out`) and the plan, the API and the
fragments do not change with the decoder.

`taew2_2` is the same network on Wan 2.2's 48 latent channels, its last convolution giving 12
channels that a 2x2 pixel shuffle turns into RGB (`patch_size` 2): 16x in space.

Streaming: `TAEHVState` holds, per MemBlock, its input of the last frame decoded; a block's
frames run in parallel through each layer with the memory shifted in front. Decoding block by
block therefore equals decoding a shot whole, in blocks (or chunks of frames) of any size.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .kernels import DecodePlan


@dataclass(frozen=True)
class TAEHVConfig:
    latent_channels: int = 16  # Wan 2.1's z dim
    widths: tuple[int, int, int, int] = (256, 128, 64, 64)  # decoder channels per stage, the last at full size
    time_upscale: tuple[bool, bool, bool] = (False, True, True)  # per TGrow: Wan 2.1's 4x in time
    space_upscale: tuple[bool, bool, bool] = (True, True, True)  # per stage: 8x in space
    encoder_width: int = 64  # the published encoder's channels (loaded and checked, not run)
    encoder_time_downscale: tuple[bool, bool, bool] = (True, True, False)
    image_channels: int = 3
    # The RGB frames pixel-shuffled by this patch: the decoder's last conv gives image_channels *
    # patch^2 channels, shuffled into patch x patch pixels (taew2_2: 2, for Wan 2.2's 16x latents)
    patch_size: int = 1

    @property
    def temporal_factor(self) -> int:
        return 2 ** sum(self.time_upscale)

    @property
    def spatial_factor(self) -> int:
        return 2 ** sum(self.space_upscale) * self.patch_size

    def frames_out(self, latent_frames: int, first_block: bool) -> int:
        """The Wan VAE's count: a shot's first latent frame yields 1 frame, later ones 4."""
        return latent_frames * self.temporal_factor - (self.temporal_factor - 1 if first_block else 0)


@dataclass
class TAEHVState:
    """One session's temporal memory: per MemBlock (by decoder index), its input of the last
    frame decoded, (B, C, H, W); None at a shot's start (the block sees zeros)."""

    memory: dict[int, torch.Tensor | None]
    latent_frames: int = 0  # latent frames decoded so far in this shot

    @property
    def cache(self) -> list[torch.Tensor | None]:
        """The held tensors, as `VAEState.cache` lists them (what admission counts in memory)."""
        return list(self.memory.values())

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self.cache if c is not None)


def conv3x3(cin: int, cout: int, bias: bool = True, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=bias)


class Clamp(nn.Module):
    """Soft clamp of the latents to (-3, 3), as the decoder was trained."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x / 3) * 3


class MemBlock(nn.Module):
    """Residual block over [this frame's input, the previous frame's input]."""

    def __init__(self, cin: int, cout: int) -> None:
        super().__init__()
        self.conv = nn.Sequential(
            conv3x3(2 * cin, cout), nn.ReLU(), conv3x3(cout, cout), nn.ReLU(), conv3x3(cout, cout)
        )
        self.skip = nn.Conv2d(cin, cout, 1, bias=False) if cin != cout else nn.Identity()

    def forward(self, x: torch.Tensor, past: torch.Tensor) -> torch.Tensor:
        return F.relu(self.conv(torch.cat([x, past], 1)) + self.skip(x))


class TGrow(nn.Module):
    """Each frame -> `stride` frames: a 1x1 conv to stride x C channels, group j is sub-frame j."""

    def __init__(self, dim: int, stride: int) -> None:
        super().__init__()
        self.stride = stride
        self.conv = nn.Conv2d(dim, dim * stride, 1, bias=False)


class TPool(nn.Module):
    """The encoder's `stride` frames -> 1 (its weights only: the encoder is never run here)."""

    def __init__(self, dim: int, stride: int) -> None:
        super().__init__()
        self.stride = stride
        self.conv = nn.Conv2d(dim * stride, dim, 1, bias=False)


class Upsample(nn.Module):
    def __init__(self, factor: int) -> None:
        super().__init__()
        self.factor = factor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.interpolate(x, scale_factor=self.factor, mode="nearest") if self.factor > 1 else x


def build_decoder(cfg: TAEHVConfig) -> nn.Sequential:
    """Index for index the published decoder (`decoder.N.*` keys): clamp, conv, then three
    stages of 3 MemBlocks, upsample, TGrow, conv; then ReLU and the RGB conv."""
    w = cfg.widths
    layers: list[nn.Module] = [Clamp(), conv3x3(cfg.latent_channels, w[0]), nn.ReLU()]
    for i in range(3):
        layers += [MemBlock(w[i], w[i]) for _ in range(3)]
        layers += [Upsample(2 if cfg.space_upscale[i] else 1), TGrow(w[i], 2 if cfg.time_upscale[i] else 1)]
        layers.append(conv3x3(w[i], w[i + 1], bias=False))
    layers += [nn.ReLU(), conv3x3(w[3], cfg.image_channels * cfg.patch_size**2)]
    return nn.Sequential(*layers)


def build_encoder(cfg: TAEHVConfig) -> nn.Sequential:
    """The published encoder's layers (`encoder.N.*` keys), so the released file loads whole and a
    file that is not TAEHV's is refused; never run."""
    e = cfg.encoder_width
    layers: list[nn.Module] = [conv3x3(cfg.image_channels * cfg.patch_size**2, e), nn.ReLU()]
    for down in cfg.encoder_time_downscale:
        layers += [TPool(e, 2 if down else 1), conv3x3(e, e, bias=False, stride=2)]
        layers += [MemBlock(e, e) for _ in range(3)]
    layers.append(conv3x3(e, cfg.latent_channels))
    return nn.Sequential(*layers)


class TAEHVDecoder(nn.Module):
    """`decoder` (run) + `encoder` (weights only). Decodes normalised latents block by block,
    with the Wan VAE decoder's session interface (`new_state`, `decode_rows`, `decode_sessions`)."""

    kind = "taehv"

    def __init__(self, cfg: TAEHVConfig | None = None) -> None:
        super().__init__()
        self.cfg = cfg or TAEHVConfig()
        self.decoder = build_decoder(self.cfg)
        self.encoder = build_encoder(self.cfg)
        self.mem_layers = [i for i, m in enumerate(self.decoder) if isinstance(m, MemBlock)]

    @property
    def weight(self) -> torch.Tensor:
        """A parameter whose device and dtype are the decoder's."""
        return self.decoder[1].weight

    def new_state(self) -> TAEHVState:
        return TAEHVState({i: None for i in self.mem_layers})

    def band_slots(self, shard_front: bool = False) -> list:
        return []  # nothing to move between shards: TAEHV is never height-sharded

    def decode(self, z: torch.Tensor, state: TAEHVState) -> torch.Tensor:
        """z: (B, C, T, h, w) normalised latents of one block -> (B, 3, T_out, f*h, f*w) in [-1, 1]
        (f the spatial factor: 8 for taew2_1, 16 for taew2_2)."""
        return self.decode_rows(z, state)

    @torch.no_grad()
    def decode_rows(
        self,
        z: torch.Tensor,
        state: TAEHVState,
        plan: DecodePlan | None = None,
        rank: int = 0,
        halo=None,
        shard_front: bool = False,
    ) -> torch.Tensor:
        """A whole block, in chunks of `plan.frames_per_call` latent frames (the CPU working set).
        The plan must have one band: TAEHV is never height-sharded (config/layout.py refuses it)."""
        if plan is not None and (len(plan.bands) != 1 or rank != 0):
            raise ValueError(f"TAEHV decodes whole frames on one worker, not {len(plan.bands)} bands (rank {rank})")
        step = plan.frames_per_call if plan is not None else z.shape[2]
        outs = [self._decode_chunk(z[:, :, i : i + step], state) for i in range(0, z.shape[2], step)]
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)

    @torch.no_grad()
    def decode_sessions(
        self,
        z: torch.Tensor,
        states: list[TAEHVState],
        plan: DecodePlan | None = None,
        rank: int = 0,
        halo=None,
        shard_front: bool = False,
    ) -> torch.Tensor:
        """`decode_rows` for several sessions in one call (row i of z: the block of `states[i]`),
        memories stacked along the batch and handed back after; all at the same phase of a shot
        (a shot's first block drops 3 frames, later ones none)."""
        if len(states) != z.shape[0]:
            raise ValueError(f"{z.shape[0]} blocks for {len(states)} sessions")
        if len({st.latent_frames == 0 for st in states}) > 1:
            raise ValueError("sessions at a shot's first block and later ones cannot decode together")
        mem = {
            i: None if m is None else torch.cat([st.memory[i] for st in states]) for i, m in states[0].memory.items()
        }
        merged = TAEHVState(mem, states[0].latent_frames)
        out = self.decode_rows(z, merged, plan)
        for b, st in enumerate(states):
            st.memory = {i: None if m is None else m[b : b + 1] for i, m in merged.memory.items()}
            st.latent_frames = merged.latent_frames
        return out

    def _decode_chunk(self, z: torch.Tensor, state: TAEHVState) -> torch.Tensor:
        b, _, t = z.shape[:3]
        w = self.weight
        # (B*T, C, h, w): a session's frames consecutive, as every per-frame conv takes them
        x = z.to(device=w.device, dtype=w.dtype).transpose(1, 2).reshape(b * t, z.shape[1], *z.shape[3:])
        for i, layer in enumerate(self.decoder):
            if isinstance(layer, MemBlock):
                frames = x.view(b, t, *x.shape[1:])
                prev = state.memory[i]
                prev = torch.zeros_like(frames[:, :1]) if prev is None else prev.unsqueeze(1)
                past = torch.cat([prev, frames[:, :-1]], 1).reshape(x.shape)  # each frame's previous input
                state.memory[i] = frames[:, -1].clone()
                x = layer(x, past)
            elif isinstance(layer, TGrow):
                y = layer.conv(x)  # (B*T, s*C, H, W) -> (B, T*s, C, H, W): sub-frame j = channel group j
                t *= layer.stride
                x = y.reshape(b * t, y.shape[1] // layer.stride, *y.shape[2:])
            else:
                x = layer(x)
        if self.cfg.patch_size > 1:  # channel c*p^2 + i*p + j -> pixel (i, j) of channel c
            x = F.pixel_shuffle(x, self.cfg.patch_size)
        out = x.view(b, t, *x.shape[1:]).transpose(1, 2)  # (B, 3, T_out, H, W) in ~[0, 1]
        if state.latent_frames == 0:  # a shot's first latent frame yields 1 frame, as the Wan VAE's
            out = out[:, :, self.cfg.temporal_factor - 1 :]
        state.latent_frames += z.shape[2]
        return out.clamp(0.0, 1.0) * 2.0 - 1.0  # the Wan VAE's range, so the frames' bytes come out alike


def random_taehv(cfg: TAEHVConfig | None = None, seed: int = 0) -> TAEHVDecoder:
    """A TAEHV with weights drawn from `seed` (the embedded default's decoder, tests)."""
    g = torch.Generator().manual_seed(seed)
    model = TAEHVDecoder(cfg)
    with torch.no_grad():
        for _, p in model.named_parameters():  # 1/sqrt(fan-in): frames that use the range, not saturate it
            scale = (1.0 / p[0].numel()) ** 0.5 if p.ndim > 1 else 0.02
            p.copy_(torch.randn(p.shape, generator=g) * scale)
        model.decoder[-1].bias.add_(0.5)  # mid-grey on average, as trained frames in [0, 1] are
    return model


# The embedded default's TAEHV: the published architecture at an eighth of its widths, as the tiny
# preset's Wan VAE is (`TAEHVConfig()` whenever weights are given: the published file's widths).
TINY_TAEHV = TAEHVConfig(widths=(32, 16, 8, 8), encoder_width=8)
# taew2_2 (madebyollin/taehv): the same decoder on Wan 2.2's 48 latent channels, its frames
# pixel-shuffled by 2 (16x in space, 4x in time).
TAEW2_2 = TAEHVConfig(latent_channels=48, patch_size=2)


def published_config(latent_channels: int) -> TAEHVConfig:
    """The published TAEHV for a DiT's latents: taew2_1 for Wan 2.1's 16 channels, taew2_2 for
    Wan 2.2's 48."""
    for cfg in (TAEHVConfig(), TAEW2_2):
        if cfg.latent_channels == latent_channels:
            return cfg
    raise ValueError(f"no published TAEHV decodes {latent_channels}-channel latents (taew2_1: 16, taew2_2: 48)")


def load_taehv(path: str, cfg: TAEHVConfig | None = None) -> TAEHVDecoder:
    """The published `taew2_1.pth` / `.safetensors` (or a file in its key layout), strictly: one
    `CheckpointError` naming every missing, unexpected and misshapen key."""
    from .loading import load_into, read_state_dict

    with torch.device("meta"):
        model = TAEHVDecoder(cfg)
    model.to_empty(device="cpu")
    load_into(model, read_state_dict(path), f"TAEHV weights {path}")
    return model
