"""`streamdiffd generate`: one video to an MP4 file, offline (its own process: the DiT and the decoder in it).

    streamdiffd generate --prompt "a red fox running through snow" --seconds 5 -o fox.mp4
    streamdiffd generate --preset self-forcing --model /models/Wan2.1-T2V-1.3B \\
        --dit-checkpoint self_forcing_dmd.pt --scenes story.json --seed 0 -o story.mp4 --latents story.pt
    streamdiffd generate --preset minwm-action2v ... --prompt "a forest path" --controls walk.json -o walk.mp4

The job of the published models' `inference.py`, on the daemon's own pieces so that the two give
the same frames for the same request and seed: the request is validated by the API's
`parse_video_request`, cut into blocks by the scheduler's `plan_blocks`, run on `DiTEngine` and
`VAEEngine` (the workers' engines) one block at a time, and encoded by the daemon's encoder into
the same fragmented MP4 the daemon streams (it plays in every player; scene starts carry the
stream's `emsg` markers). Nothing here is shared with a server: no workers, rings or sockets.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path

from ..config import Config, ConfigError
from ..config.loader import load
from ..controls import SPACES, Timeline, control_marker
from ..flags import add_model_args, overrides_from_args
from ..plan import plan_blocks, scene_marker, shot_left
from ..server.api import APIError, VideoRequest, parse_video_request

# The request's fields and the flags that give them: a refusal of a field names its flag.
FLAG_OF = {
    "prompt": "--prompt",
    "seed": "--seed",
    "num_frames": "--num-frames",
    "seconds": "--seconds",
    "size": "--size",
    "fps": "--fps",
}
DEST_OF = {"size": "frame_size"}  # the daemon's --size is its default size (model.size); this one is the request's


class UsageError(Exception):
    """A flag or input file that cannot be used: its message names it (exit status 2)."""


class LoadError(Exception):
    """The model's files cannot be loaded as configured (exit status 1)."""


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="streamdiffd generate",
        description="Generate one video into an MP4 file, with no server: the daemon's model, sampler and "
        "encoder in this process, as the published models' inference.py does. The same request and seed give "
        "the same frames as the daemon.",
    )
    add_model_args(p)
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--prompt", metavar="TEXT", help="one scene")
    what.add_argument(
        "--scenes",
        metavar="FILE",
        help="a storyboard in JSON, as POST /v1/videos takes it: the 'scenes' array (prompt, seconds or "
        "num_frames, transition cut|continue, seed, recache), or a request body holding one",
    )
    p.add_argument("--seed", metavar="N", help="the noise seed (default: drawn, and printed)")
    length = p.add_mutually_exclusive_group()
    length.add_argument("--num-frames", metavar="N", help="frames of the video (default: 4 s)")
    length.add_argument("--seconds", metavar="S", help="length of the video in seconds (at --fps)")
    p.add_argument("--size", dest="frame_size", metavar="WxH", help="frame size (default: the model's)")
    p.add_argument("--fps", metavar="N", help="frames per second (default: the model's, 16)")
    p.add_argument("--image", metavar="FILE", help="image-to-video: the first frame (PNG, JPEG or WebP)")
    p.add_argument(
        "--controls",
        metavar="FILE",
        help="a world model's control script in JSON, as POST /v1/videos takes it: the 'controls' array (each "
        "control with its seq, landing at block 0 or the block it names), or an object holding one",
    )
    p.add_argument("-o", "--output", required=True, metavar="OUT.mp4", help="the video file to write")
    p.add_argument(
        "--latents",
        metavar="FILE.pt",
        help="also save the denoised latents: a (1, 16, F, h, w) float32 tensor, every block in order",
    )
    p.add_argument("--log-level", choices=("debug", "info", "warning", "error"))
    return p.parse_args(argv)


def _read_json(path: str, where: str):
    """A flag's JSON file, or UsageError naming the flag and what is wrong."""
    try:
        return json.loads(Path(path).read_text())
    except OSError as exc:
        raise UsageError(f"{where}: cannot read it: {exc.strerror or exc}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise UsageError(f"{where}: not JSON: {exc}") from None


def read_request(args: argparse.Namespace) -> tuple[dict, dict[str, str]]:
    """The request body the flags describe, as the API would receive it (flags over the file's
    fields), and the flag that gave each field (what a refusal names)."""
    given: dict[str, str] = {}
    if args.scenes is not None:
        where = f"--scenes {args.scenes}"
        raw = _read_json(args.scenes, where)
        if isinstance(raw, list):
            body = {"scenes": raw}
        elif isinstance(raw, dict) and "scenes" in raw:
            body = dict(raw)
        else:
            raise UsageError(f"{where}: must hold a JSON array of scenes or an object with 'scenes'")
        for field in ("stream", "live"):  # the server's delivery modes; a file is written whole
            if body.pop(field, None) not in (None, False):
                raise UsageError(f"{where}: '{field}' is the server's (a file is written whole)")
    else:
        body, given["prompt"] = {"prompt": args.prompt}, "--prompt"
    for field, flag in FLAG_OF.items():
        value = getattr(args, DEST_OF.get(field, field))
        if field != "prompt" and value is not None:
            if field in ("seconds", "num_frames"):  # a flag's length replaces the file's, in either form
                body.pop("seconds", None)
                body.pop("num_frames", None)
            body[field], given[field] = value, flag
    if args.controls is not None:
        where = f"--controls {args.controls}"
        raw = _read_json(args.controls, where)
        body["controls"] = raw.get("controls") if isinstance(raw, dict) else raw
        given["controls"] = where
    if args.image is not None:  # the API's input_reference, as a multipart file brings it
        try:
            body["input_reference"], given["input_reference"] = Path(args.image).read_bytes(), "--image"
        except OSError as exc:
            raise UsageError(f"--image {args.image}: cannot read it: {exc.strerror or exc}") from None
    return body, given


def validate(body: dict, given: dict[str, str], cfg: Config, args: argparse.Namespace) -> VideoRequest:
    """The API's validation of the body; its refusal names the flag (or the file) that gave the field."""
    from ..supervisor.topology import model_card

    try:
        return parse_video_request(body, cfg, model_card(cfg))
    except APIError as exc:
        field = (exc.param or "").split(".")[0].split("[")[0]  # scenes[1].seconds -> scenes
        where = given.get(field) or (f"--scenes {args.scenes}" if args.scenes is not None else None)
        raise UsageError(f"{where}: {exc.message}" if where else exc.message) from None


def device_of(cfg: Config) -> str:
    """One device for both stages: the first of its kind (cpu, cuda:0, xpu:0)."""
    import torch

    from ..platform import for_device

    kind = cfg.topology.device
    if kind == "cpu":
        return "cpu"
    if not for_device(kind).available():
        raise UsageError(f"--device {kind}: no {kind} device is visible to this PyTorch ({torch.__version__})")
    return f"{kind}:0"


def generate(cfg: Config, req: VideoRequest, args: argparse.Namespace) -> tuple[int, int]:
    """Run the request and write the files; returns (frames written, latent frames)."""
    import torch
    from tqdm import tqdm

    from ..media.encoder import FragmentWriter, open_encoder
    from ..models import engines
    from ..models.blocks import BlockOrder, BlockRefused
    from ..models.wan.loading import CheckpointError
    from ..supervisor.topology import model_spec
    from ..workers.stage_common import decode_png

    device = device_of(cfg)
    spec = model_spec(cfg)
    print(f"streamdiffd generate: loading {cfg.model_name} on {device}", file=sys.stderr, flush=True)
    try:
        dit = engines.DiTEngine(spec, device)
        vae = engines.VAEEngine(spec, device, cfg.pipeline.vae_cpu_working_set_bytes)  # spec.decoder: wan or taehv
    except (CheckpointError, OSError, ValueError) as exc:  # a missing or mismatched file: one line, no traceback
        raise LoadError(f"cannot load the model: {exc}") from None
    blocks = plan_blocks(req.scenes, dit.frames_per_block, vae.preset.vae.temporal_factor)

    c = cfg.encoder
    every = c.keyframe_every_blocks  # keyframes where the daemon puts them
    keyframes = [b.start_frame for b in blocks if b.index % every == 0]
    encoder = open_encoder(
        c.kind, req.width, req.height, req.fps, keyframes, c.crf, bitrate_kbps=c.bitrate_kbps, device=c.vaapi_device
    )
    writer = FragmentWriter(encoder, req.width, req.height, req.fps)
    out, part = Path(args.output), Path(args.output + ".part")  # a stopped run leaves no half video under the name
    latents: list[torch.Tensor] = []
    sess, state = dit.open_session(req.width, req.height, req.seed), None
    space = SPACES.get(dit.card.controls)
    timeline = Timeline(space) if space is not None else None  # as the scheduler keeps a world model's
    for c in req.controls:
        timeline.receive(c, 0)
    try:
        # disable=None: no bar when stderr is not a terminal (a log file gets the summary line only)
        with part.open("wb") as f, tqdm(total=req.frames, unit="frame", disable=None, dynamic_ncols=True) as bar:
            for b in blocks:
                scene, first = req.scenes[b.scene], b.first_of_scene
                order = BlockOrder(b.latent_frames, shot_left=shot_left(blocks, b.index))
                if first:  # what the scheduler sends with a scene's first block (scheduler/tickets.py)
                    bar.set_description(f"scene {b.scene + 1}/{len(req.scenes)}")
                    order.prompt, order.new_shot, order.seed = scene.prompt, b.shot_start, scene.seed
                    order.recache, order.transition = scene.recache and not b.shot_start, scene.keeps_history
                    order.image = decode_png(scene.image) if b.shot_start and scene.image is not None else None
                events = [scene_marker(b, scene)] if first else []
                if timeline is not None:  # the controls that reach this block, as the scheduler gives them
                    ctl = timeline.block(b.index, b.latent_frames, b.shot_start)
                    order.camera, order.actions = ctl.camera, ctl.actions
                    events += [control_marker(b, ctl.seq)] if ctl.seq is not None else []
                try:  # the worker's check of each block, the engine's own
                    dit.check(sess, order)
                except BlockRefused as exc:
                    raise UsageError(f"block {b.index}: {exc}") from None
                latent = dit.make([(sess, order)])[0]  # (1, C, f, h, w) float32, CPU
                if args.latents:
                    latents.append(latent)
                if b.shot_start or state is None:  # a new shot: the decoder's temporal cache starts afresh
                    state = vae.open_session()
                frames = vae.decode_block(state, latent)[: b.emit].numpy()  # (emit, H, W, 3) uint8
                idr = b.index % every == 0
                f.write(writer.fragment(frames, idr, events))
                bar.update(b.emit)
        if args.latents:
            torch.save(torch.cat(latents, dim=2), args.latents + ".part")
            os.replace(args.latents + ".part", args.latents)
        os.replace(part, out)
    finally:
        writer.close()
        part.unlink(missing_ok=True)
        if args.latents:
            Path(args.latents + ".part").unlink(missing_ok=True)
    return writer.frames, sum(b.latent_frames for b in blocks)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    try:
        cfg = load(args.config, overrides_from_args(args))  # --log-level too: server.log_level
        req = validate(*read_request(args), cfg, args)
        out = Path(args.output)
        if out.suffix.lower() not in (".mp4", ".m4v") or not out.parent.is_dir():
            raise UsageError(f"-o {args.output}: must name an .mp4 file in an existing directory")
        if args.latents and not Path(args.latents).parent.is_dir():
            raise UsageError(f"--latents {args.latents}: its directory does not exist")
    except (ConfigError, UsageError) as exc:
        kind = "configuration error: " if isinstance(exc, ConfigError) else ""
        print(f"streamdiffd generate: {kind}{exc}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=cfg.server.log_level.upper(),
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s [generate] %(name)s: %(message)s",
    )
    try:
        frames, latent_frames = generate(cfg, req, args)
    except UsageError as exc:
        print(f"streamdiffd generate: {exc}", file=sys.stderr)
        return 2
    except LoadError as exc:
        print(f"streamdiffd generate: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    print(
        f"streamdiffd generate: wrote {args.output} ({frames} frames, {req.width}x{req.height}, {req.fps} fps, "
        f"seed {req.seed}, {len(req.scenes)} scene(s), {latent_frames} latent frames)"
    )
    return 0
