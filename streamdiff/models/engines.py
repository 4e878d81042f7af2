"""The two stages as the pipeline uses them: one call = one block of one session.

`DiTEngine` (DiT worker): text encoding with a small prompt cache, per-session KV/cross caches,
seeded noise, the step lists; its sampler (samplers.py) and its conditionings (conditionings.py)
are objects chosen when it is built, which it asks. Its callers order blocks as `BlockOrder`s
(blocks.py), `check` each and `make` them. `VAEEngine` (VAE worker): per-session temporal
caches, uint8 frames. Sessions are plain objects owned by the caller; engines hold only weights.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from ..plan import cache_frames
from ..platform import for_device
from .blocks import BlockOrder, BlockRefused, check_block
from .compiled import Compiler
from .conditionings import conditionings_for, picture
from .host import to_host
from .presets import (
    ModelSpec,
    build_dit,
    build_image_encoder,
    build_text_encoder,
    build_vae,
    build_vae_encoder,
    describe_load,
)
from .samplers import RollingSampler, sampler_for
from .wan import rolling
from .wan.canvas import commit_canvas
from .wan.kernels import CPU_DECODE_WORKING_SET_BYTES, DecodePlan, plan_block
from .wan.kv_cache import DiTState
from .wan.sampler import SHOT_PREFIX, sigma_of
from .wan.taehv import TAEHVState
from .wan.vae import uint8_frames
from .wan.vae_blocks import Halo, VAEState


def latents_to_host(x: torch.Tensor) -> torch.Tensor:
    """A batch's latents (float32) on the CPU, for the ring: one copy off the device a batch."""
    return to_host(x, torch.float32)


@dataclass
class DiTSession:
    state: DiTState
    latent_hw: tuple[int, int]
    generator: torch.Generator  # on the model's device: the stream torch.manual_seed(seed) gives it
    shot_blocks: int = 0  # blocks generated since the last cut (the first uses its own steps)
    prompt: str | None = None
    # a multi-shot transition's caption: its first block's prompt carries SHOT_PREFIX, the blocks
    # after take the caption alone (the authors' prompts per block: utils/dataset.py)
    shot_prompt: str | None = None
    # "authors": the shot's noise was drawn up front (a fixed length), "per_block": drawn as
    # each block starts (a live shot, whose length nobody knows). See docs/models.md, Seeding.
    seeding: str = "per_block"
    shot_noise: torch.Tensor | None = None  # (1, F, C, h, w), the authors' layout, model dtype
    shot_pos: int = 0  # latent frames of shot_noise used so far
    rolling: rolling.RollingState | None = None  # the rolling sampler's window (sampler kind "rolling")
    # what each conditioning (conditionings.py) keeps of the session's shot, under its own key,
    # read by it alone: Matrix-Game's conditioning on its start picture, LongLive 2.0's held frame
    conditioned: dict[str, object] = field(default_factory=dict)

    def caches(self) -> list:
        """The keys/values it holds: the history, and the rolling sampler's window's context."""
        return [self.state.kv] + ([self.rolling.scratch.kv] if self.rolling is not None else [])

    @property
    def cross_nbytes(self) -> int:
        """Its prompt's cross-attention keys and values."""
        return sum(k.nbytes + v.nbytes for k, v in self.state.cross)

    @property
    def nbytes(self) -> int:
        """Everything it holds: its caches and its prompt's keys and values (DiTMemory prices it)."""
        return sum(c.nbytes for c in self.caches()) + self.cross_nbytes


class DiTEngine:
    def __init__(
        self, spec: ModelSpec, device: str = "cpu", prompt_cache: int = 16, probe: bool = False, text: bool = True
    ) -> None:
        """`probe`: the profile's, which times the DiT's blocks and an image's encoding, not the
        prompt's: no text encoder (prompts embed to zeros of its shape; umT5-XXL takes minutes).
        `text`: whether this engine holds the text encoder; a DiT group's ranks after the first
        do not, and get each prompt's embedding from `share_prompt` (parallel/dit_group.py)."""
        self.device = device
        self.model, self.preset = build_dit(spec, device)
        self.card = self.preset.card()  # what it takes: the worker's checks, the API's (through READY)
        self.loaded = describe_load(spec, self.preset)  # what it was built from (log, /health, /v1/models)
        self.compiler = Compiler(spec.compile, device)  # compiled lazily, at the first blocks (`warm`)
        self.model.compile_blocks(self.compiler)
        self.text = build_text_encoder(spec, device) if text and not probe else None
        self.share_prompt = None  # a DiT group's: rank 0's embedding, given to every rank
        # image-to-video: the VAE encoder beside the DiT, and Matrix-Game's CLIP, loaded only
        # where the card's image mode takes them (one image per shot)
        self.encoder = build_vae_encoder(spec, device) if self.card.i2v else None
        self.clip = build_image_encoder(spec, device) if self.card.image == "condition" else None
        # what its blocks are conditioned on besides their noise (conditionings.py): the prompt or
        # Matrix-Game's picture, how a picture starts a shot, a camera
        self.conditionings = conditionings_for(self.card, self.encoder, self.clip)
        cp = self.preset.checkpoint
        self.noise_layout = cp.noise_layout if cp is not None else "fchw"
        self.noise_dtype = self.model.patch_embedding.weight.dtype  # the authors draw in the model's dtype
        self.sampler = sampler_for(self.preset.sampler)  # block, UniPC, Krea's recompute or rolling (samplers.py)
        self.timesteps, self.first_timesteps = self.sampler.timesteps, self.sampler.first_timesteps
        self._prompts: OrderedDict[str, torch.Tensor] = OrderedDict()
        self._prompt_cache = prompt_cache
        self._sigmas: dict[tuple, list[float]] = {}

    def check(self, sess: DiTSession, order: BlockOrder) -> None:
        """BlockRefused where this model cannot make the block for this session: the sampler's
        rules and each conditioning's (blocks.check_block), and a start picture's size."""
        check_block(self.card, self.conditionings, order)
        if order.image is not None:
            try:
                picture(self, sess, order.image)
            except ValueError:
                h, w = order.image.shape[:2]
                raise BlockRefused(f"the image is {w}x{h}, not the video's size") from None

    def make(self, orders: list[tuple[DiTSession, BlockOrder]]) -> list[torch.Tensor]:
        """Each (session, order)'s block, (1, C, f, h, w) float32 on the CPU, in order: the
        scenes start first; a start picture that is a block of its own is made alone (its
        conditioning's `start_image`); the rest denoise together where size and step count
        agree. The caller has checked each (`check`)."""
        own = next((c for c in self.conditionings if c.own_block), None)
        for sess, o in orders:
            if o.prompt is not None:
                block = own is not None and o.image is not None  # not drawn: the authors draw the F - 1 after it
                left, image = (max(0, o.shot_left - 1), None) if block else (o.shot_left, o.image)
                self.set_scene(sess, o.prompt, o.new_shot, o.seed, o.recache, left, image, o.transition)
        out: list[torch.Tensor | None] = [None] * len(orders)
        groups: dict[tuple, list[int]] = {}
        for i, (sess, o) in enumerate(orders):
            if own is not None and o.image is not None:
                out[i] = own.start_image(self, sess, o.image)
                continue
            groups.setdefault((sess.latent_hw, o.frames, len(self.steps_of(sess))), []).append(i)
        for idx in groups.values():
            left, blocks = [orders[i][1].shot_left for i in idx], [orders[i][1] for i in idx]
            made = self.generate_blocks([orders[i][0] for i in idx], orders[idx[0]][1].frames, left, blocks)
            for i, x in zip(idx, made, strict=True):
                out[i] = x
        return out

    def start_image(self, sess: DiTSession, image: torch.Tensor):
        """What a start picture costs at a shot's start, its conditioning's way (the profile
        times it): its latent (a block of its own, or LongLive 2.0's held frame), or Matrix-Game's
        context and first conditioning latent."""
        for c in self.conditionings:
            if "image" in c.takes:
                return c.start_image(self, sess, image)
        raise ValueError(f"model {self.preset.name!r} does not condition on an image")

    @property
    def frames_per_block(self) -> int:
        return self.preset.sampler.frames_per_block

    def latent_size(self, width: int, height: int) -> tuple[int, int]:
        f = self.preset.vae.spatial_factor * 2  # VAE factor x DiT patch
        if width % f or height % f:
            raise ValueError(f"size {width}x{height} must be a multiple of {f} in both dimensions")
        return height // self.preset.vae.spatial_factor, width // self.preset.vae.spatial_factor

    def open_session(self, width: int, height: int, seed: int, frames: int = 0) -> DiTSession:
        """`frames`: the most latent frames any shot of this session can hold
        (`plan.most_held_frames`), or 0 when that is not known (a live video). The KV cache is
        allocated here, once, for `cache_frames(frames)` frames."""
        h, w = self.latent_size(width, height)
        state, window = self._new_shot(h, w, self.cache_frames(frames))
        return DiTSession(state, (h, w), torch.Generator(device=self.device).manual_seed(seed), rolling=window)

    def cache_frames(self, frames: int = 0) -> int:
        """The frames a session's KV cache holds (`plan.cache_frames`): the window, or a shorter
        video's `frames`, never fewer than the sinks and one block. The rolling sampler keeps its
        full window (its blocks in flight are not a video's length)."""
        return cache_frames(self.preset.sampler.window_frames, self.least_cache_frames, frames)

    @property
    def least_cache_frames(self) -> int:
        return self.sampler.least_cache_frames

    def _new_shot(self, h: int, w: int, window: int) -> tuple[DiTState, rolling.RollingState | None]:
        """A session's caches, for `window` frames; with the rolling sampler, its window (whose
        finished history is the session's `state`)."""
        return self.sampler.new_state(self.model, h, w, window)

    def encode_prompt(self, prompt: str) -> torch.Tensor:
        emb = self._prompts.get(prompt)
        if emb is None:
            if self.text is not None:
                emb = self.text.encode([prompt])
            elif self.share_prompt is None:  # a probe's stand-in: the DiT's time does not depend on the values
                cfg, dev = self.model.cfg, self.model.patch_embedding.weight.device
                emb = torch.zeros(1, cfg.text_len, cfg.text_dim, device=dev)
            if self.share_prompt is not None:
                emb = self.share_prompt(emb)
            self._prompts[prompt] = emb
            if len(self._prompts) > self._prompt_cache:
                self._prompts.popitem(last=False)
        self._prompts.move_to_end(prompt)
        return emb

    def set_scene(
        self,
        sess: DiTSession,
        prompt: str,
        new_shot: bool,
        seed: int | None = None,
        recache: bool = False,
        shot_left: int = 0,
        image: torch.Tensor | None = None,
        transition: bool = False,
    ) -> None:
        """Start a scene. `new_shot`: a new shot, the API's `cut` (fresh KV cache, positions from 0,
        first-block steps).
        `transition`: a new shot over the kept history, the model's own (LongLive 2.0's multi-shot,
        `SamplerConfig.shot_offset`): the caches and the noise go on, the first block's prompt
        starts with the words its training marks a new shot with (`SHOT_PREFIX`; the blocks after
        take the caption alone), the RoPE positions move on by `shot_offset`, and the first
        block's first sink frames are pinned after its clean pass (the shot sink).
        A model whose blocks an image conditions (Matrix-Game) ignores the prompt: a cut starts
        from `image` ((H, W, 3) uint8; `ImageContext.start_image`), or, where none is given (the
        calibration's and the profile's shots), from a blank picture.
        Otherwise `continue`: keep the visual history, swap the prompt (cross-attention cache),
        and re-cache the window under it (`WanDiT.recache`) as the sampler's `recache` policy
        says: `every_switch` at every continuing scene (LongLive re-caches at each of its
        segment switches), `on_request` where the scene asks, `never` refuses a scene that asks
        (the API refuses it first, with a 400).

        `shot_left`: the blocks from this scene's first block to the shot's end (0: a live shot,
        unbounded; plan.shot_left). Where the noise starts afresh (a cut, or a scene with a seed) and
        the length is known, the whole rest of the shot's noise is drawn now, as the authors'
        scripts draw the whole video's (`seeding = "authors"`); otherwise per block.

        Rolling sampler: the authors' loop has one prompt per video. A new scene's first block
        is the oldest in flight (every earlier block is finished), so all blocks in flight belong
        to the new scene: they keep their noise levels and continue under its prompt from the
        next window step on (a restart would stall the stream for a full window). A cut discards
        them with the caches; the new shot fills its window afresh."""
        policy = self.preset.sampler.recache
        if recache and policy == "never":
            raise ValueError("this model's sampler.recache is 'never': a scene cannot ask for recache")
        recache = recache or policy == "every_switch"
        s = self.preset.sampler
        sess.shot_prompt = None
        if transition:
            if new_shot or not s.shot_offset:
                why = "it is no cut" if new_shot else f"model {self.preset.name!r} has none (sampler.shot_offset)"
                raise ValueError(f"a shot transition keeps the history: {why}")
            sess.state.rope_offset += s.shot_offset
            sess.state.pin_next = True
            sess.shot_prompt = prompt.removeprefix(SHOT_PREFIX)
            prompt = SHOT_PREFIX + sess.shot_prompt
        if new_shot:  # the same buffers, emptied (one cache per session); rolling: the blocks in flight go
            (sess.rolling or sess.state).new_shot()
            sess.shot_blocks = 0
        if seed is not None:
            sess.generator.manual_seed(seed)
        if new_shot or seed is not None:
            sess.shot_noise, sess.shot_pos, sess.seeding = None, 0, "per_block"
            if shot_left > 0:
                shape = self._noise_shape(sess, shot_left * self.frames_per_block)
                sess.shot_noise = self._randn(shape, sess.generator)
                sess.seeding = "authors"
        if recache and not new_shot:  # the held window again under the new prompt, the sampler's way
            self.sampler.recache(self.model, sess.state, sess.rolling, self.encode_prompt(prompt))
            sess.prompt = prompt
        for c in self.conditionings:  # the prompt (unless re-cached under it), a picture
            c.scene(self, sess, prompt, new_shot, image)
        if new_shot and s.canvas:  # the shot's sink frame, under its first prompt (SamplerConfig.canvas)
            commit_canvas(self.model, sess.state, *sess.latent_hw, s.context_t)

    def warm(self, sessions: list[DiTSession]) -> None:
        """Every shape this engine serves, once, on the caller's sessions (calibration's: no more
        caches than it holds already), each starting a new shot: compiled (`compiler.on`), each is
        a graph that would otherwise compile in the middle of a live stream. A shot's first and
        steady blocks and its re-cache at a batch of one, the image block (a 1-frame forward)
        where the preset takes an image, and with two sessions a block of both: a batch of
        more, another frame size or a re-cache's frame count reuse these graphs (their sizes are
        symbols; dynamo specialises only a size of 1)."""
        fpb = self.frames_per_block
        h, w = (n * self.preset.vae.spatial_factor for n in sessions[0].latent_hw)
        blank = torch.zeros(h, w, 3, dtype=torch.uint8)
        for sess in sessions:
            image = blank if self.card.i2v and sess is sessions[0] else None  # the picture's way, once
            if image is not None and self.card.image_block:  # its own block, then the shot's first
                self.make([(sess, BlockOrder(1, "warm", new_shot=True, image=image))])
                self.generate_block(sess, fpb)
            else:  # the shot's first block (its own steps)
                self.make([(sess, BlockOrder(fpb, "warm", new_shot=True, image=image))])
        if self.preset.sampler.recache != "never":
            self.set_scene(sessions[0], "warm again", new_shot=False, recache=True)
        for _ in range(2):
            self.generate_block(sessions[0], fpb)  # steady, behind a fuller window
        if len(sessions) > 1:
            self.generate_blocks(sessions[:2], fpb)

    def steps_of(self, sess: DiTSession) -> list[float]:
        """The step list of the session's next block (a shot's first block has its own)."""
        return self.first_timesteps if sess.shot_blocks == 0 else self.timesteps

    def _randn(self, shape: tuple[int, ...], generator: torch.Generator) -> torch.Tensor:
        """A draw as the authors make it: in the model's dtype, on its device."""
        return torch.randn(shape, generator=generator, dtype=self.noise_dtype, device=generator.device)

    def _noise_shape(self, sess: DiTSession, frames: int) -> tuple[int, ...]:
        """The authors' layout of `frames` latent frames of noise: (1, F, C, h, w), or Matrix-Game's
        (1, C, F, h, w) (`CheckpointPreset.noise_layout`)."""
        c, (h, w) = self.model.cfg.out_channels, sess.latent_hw
        return (1, c, frames, h, w) if self.noise_layout == "cfhw" else (1, frames, c, h, w)

    def _initial_noise(self, sess: DiTSession, frames: int) -> torch.Tensor:
        """A block's initial noise in our (1, C, frames, h, w): a slice of the shot's, drawn up
        front in the authors' layout, or drawn now where the shot's length is not known."""
        axis = 2 if self.noise_layout == "cfhw" else 1
        if sess.shot_noise is not None and sess.shot_pos + frames > sess.shot_noise.shape[axis]:
            # A steer lengthened the shot past what was drawn: go on per block (no authors' video
            # has a steer to match), rather than fail the stream.
            sess.shot_noise, sess.seeding = None, "per_block"
        if sess.shot_noise is None:
            x = self._randn(self._noise_shape(sess, frames), sess.generator)
        else:
            sess.shot_pos += frames
            x = sess.shot_noise.narrow(axis, sess.shot_pos - frames, frames)
        return x if axis == 2 else x.permute(0, 2, 1, 3, 4)

    def draw_noise(self, sess: DiTSession, frames: int, renoises: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The next block's noise in the authors' order: its initial noise, then one `randn_like`
        of the flattened (f, C, h, w) prediction per step after the first. Returned in our
        (1, C, f, h, w) layout."""
        c, (h, w) = self.model.cfg.out_channels, sess.latent_hw
        first = self._initial_noise(sess, frames)
        again = [self._randn((frames, c, h, w), sess.generator).unsqueeze(0) for _ in range(renoises)]
        return first, [x.permute(0, 2, 1, 3, 4) for x in again]

    def generate_block(self, sess: DiTSession, frames: int, shot_left: int = 0) -> torch.Tensor:
        """Denoise the next `frames` latent frames -> (1, C, frames, h, w) float32 on the CPU.
        `shot_left`: the rolling sampler's blocks of this shot from this one on (0: open-ended)."""
        return self.generate_blocks([sess], frames, [shot_left])[0]

    def generate_blocks(
        self,
        sessions: list[DiTSession],
        frames: int,
        shots_left: list[int] | None = None,
        orders: list[BlockOrder] | None = None,
    ) -> list[torch.Tensor]:
        """The next block of several sessions in one batched forward per step (same latent size
        and step count; any prompts and cache positions). Each session draws its noise from its
        own generator exactly as alone, so each result equals its session run alone. `orders`:
        each block's, for its controls (None: a camera standing still, the idle action).
        The rolling sampler runs its sessions one after another (`shots_left`: see generate_block)."""
        if isinstance(self.sampler, RollingSampler):
            left = shots_left or [0] * len(sessions)
            return [self._rolling_block(s, frames, n) for s, n in zip(sessions, left, strict=True)]
        conds = self.conditionings
        orders = orders or [None] * len(sessions)
        if len(sessions) > 1 and any(c.alone(s) for c in conds for s in sessions):  # (a held image)
            left = shots_left or [0] * len(sessions)
            return [
                self.generate_blocks([s], frames, [n], [o])[0] for s, n, o in zip(sessions, left, orders, strict=True)
            ]
        for sess, order in zip(sessions, orders, strict=True):
            for c in conds:
                c.prepare(self, sess, frames, order)
        steps = [self.steps_of(s) for s in sessions]
        renoises = self.sampler.renoises(steps[0])
        noise, renoise = [], [[] for _ in range(renoises)]
        for sess in sessions:
            n, r = self.draw_noise(sess, frames, renoises)
            noise.append(n)
            for i, x in enumerate(r):
                renoise[i].append(x)
        sigmas = [self._sigmas_of(ts, self.preset.sampler.shift) for ts in steps]
        hold = next((h for c in conds if (h := c.hold(sessions[0])) is not None), None)  # it runs alone (above)
        x0 = self.sampler.denoise(self.model, [s.state for s in sessions], noise, steps, renoise, sigmas, hold, frames)
        for sess in sessions:
            sess.shot_blocks += 1
            if sess.shot_prompt is not None:  # a transition's first block is done: the caption alone
                self.model.set_prompt(sess.state, self.encode_prompt(sess.shot_prompt))
                sess.prompt, sess.shot_prompt = sess.shot_prompt, None
        return list(latents_to_host(x0).split(1))

    def _sigmas_of(self, timesteps: list[float], shift: float) -> list[float]:
        """`sigma_of` once per step list (a search of the schedule: host work, not per block)."""
        key = (tuple(timesteps), shift)
        if key not in self._sigmas:
            self._sigmas[key] = sigma_of(timesteps, shift)
        return self._sigmas[key]

    def _rolling_block(self, sess: DiTSession, frames: int, shot_left: int) -> torch.Tensor:
        """The next finished block of a rolling session: the shot's first call fills the window
        (one forward per level), later calls take one window step each (rolling.next_block)."""
        fpb, r, g = self.frames_per_block, sess.rolling, sess.generator
        if frames != fpb:
            raise ValueError(f"the rolling sampler makes whole blocks of {fpb} latent frames, not {frames}")

        def noise_of(i: int) -> torch.Tensor:  # blocks enter in order: the shot's noise, block by block
            return self._initial_noise(sess, fpb)

        x0 = self.sampler.next_block(self.model, r, shot_left, noise_of, lambda s: self._randn(s, g))
        sess.shot_blocks += 1
        return latents_to_host(x0)


class VAEEngine:
    def __init__(self, spec: ModelSpec, device: str = "cpu", working_set_bytes: int = CPU_DECODE_WORKING_SET_BYTES):
        self.device = device
        self.model, self.preset = build_vae(spec, device)  # the Wan VAE, or TAEHV (spec.decoder)
        self.decoder = spec.decoder
        # what a decode call's activations may take here: the CPU's cache, or a share of the
        # device memory free now that the decoder has loaded (frames per call follow from it)
        self.working_set_bytes = for_device(device).decode_working_set(working_set_bytes)
        # The Wan VAE's norms compiled (lazily, at the first blocks); TAEHV's convolutions and
        # ReLUs have no chain of passes to fuse, and it runs eager.
        self.compiler = Compiler(spec.compile if spec.decoder == "wan" else "off", device)
        if self.compiler.on:
            self.model.compile_pointwise(self.compiler)

    def open_session(self) -> VAEState | TAEHVState:
        return self.model.new_state()

    def frames_out(self, latent_frames: int, state: VAEState) -> int:
        return self.preset.vae.frames_out(latent_frames, first_block=state.latent_frames == 0)

    def plan(
        self, latent_shape: tuple[int, ...], world: int = 1, batch: int = 1, weights: tuple[float, ...] | None = None
    ) -> DecodePlan:
        """The decode plan of `batch` blocks of this global shape over `world` shards, bands in
        proportion to `weights` (the same on every rank)."""
        cfg = self.preset.vae
        if self.decoder == "taehv":  # whole frames on one worker; its widest full-size activation
            if world != 1:
                raise ValueError(f"TAEHV is never height-sharded: a group of {world} shards")
            width, elem = self.model.cfg.widths[-1], self.model.weight.element_size()
        else:
            # the last stage's channels per output pixel (Wan 2.2's runs at half size, in patches)
            width, elem = cfg.decoder_dim // cfg.patch_size**2, self.model.conv2.weight.element_size()
        return plan_block(
            latent_shape,
            world,
            torch.device(self.device).type,
            width,
            cfg.spatial_factor,
            cfg.temporal_factor,
            elem,
            self.working_set_bytes,
            batch,
            weights,
        )

    def decode_block(
        self,
        state: VAEState,
        latent: torch.Tensor,
        plan: DecodePlan | None = None,
        rank: int = 0,
        halo: Halo | None = None,
        shard_front: bool = False,
    ) -> torch.Tensor:
        """(1, C, f, h, w) -> (frames, 8h, 8w, 3) uint8 on the CPU; with a plan of several
        shards, only rank `rank`'s band of rows (exchanging through `halo`)."""
        return self.decode_blocks([state], latent, plan, rank, halo, shard_front)[0]

    def decode_blocks(
        self,
        states: list[VAEState],
        latents: torch.Tensor,
        plan: DecodePlan | None = None,
        rank: int = 0,
        halo: Halo | None = None,
        shard_front: bool = False,
    ) -> list[torch.Tensor]:
        """Blocks of several sessions (rows of `latents`, same size and phase) in one decode call,
        each with its own temporal cache -> one (frames, rows, W, 3) uint8 array per session."""
        plan = plan or self.plan(tuple(latents.shape[1:]), 1, latents.shape[0])
        z = latents.to(self.device)
        if len(states) == 1:
            x = self.model.decode_rows(z, states[0], plan, rank, halo, shard_front)
        else:
            x = self.model.decode_sessions(z, states, plan, rank, halo, shard_front)
        return list(uint8_frames(x))  # one copy off the device for the batch
