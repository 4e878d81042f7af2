"""`streamdiffd generate`: as a user runs it (a subprocess) for a video's frames and latents and for
its refusals; then, run in this process (`generate_here`: the same `main`, without importing
torch again), the same video as the daemon streams for the same request and the engines' own
latents for a published preset."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from streamdiff.config.loader import load
from streamdiff.flags import overrides_from_args, parse_args
from streamdiff.models.engines import DiTEngine
from streamdiff.plan import Scene, plan_blocks, shot_left
from streamdiff.supervisor.topology import model_spec

from .helpers import ROOT, SHORT_STORY, assert_same_as_one_dit_and_vae, decode, ffprobe, generate_here


def generate(*flags: str, timeout_s: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "streamdiff.cli", "generate", *flags],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )


def assert_frames(video: bytes, frames: int, width: int, height: int) -> None:
    d = decode(video)
    assert (d["frames"], d["width"], d["height"]) == (frames, width, height)
    probe = ffprobe(video)
    if probe is not None:  # FFmpeg's own count as well, where ffprobe is installed
        assert (probe["frames"], probe["width"], probe["height"]) == (frames, width, height)
        assert probe["decode_errors"] == ""


def engine_latents(spec_flags: list[str], scenes: list[Scene], width: int, height: int, seed: int) -> torch.Tensor:
    """The DiT engine run directly in this process, block by block as the daemon's DiT worker is
    driven: every scene's blocks concatenated along time."""
    eng = DiTEngine(model_spec(load(None, overrides_from_args(parse_args(spec_flags)))), "cpu")
    sess, out = eng.open_session(width, height, seed), []
    blocks = plan_blocks(scenes, eng.frames_per_block, 4)
    for b in blocks:
        sc = scenes[b.scene]
        left = shot_left(blocks, b.index)
        if b.first_of_scene:
            recache = sc.recache and not b.shot_start
            eng.set_scene(sess, sc.prompt, new_shot=b.shot_start, seed=sc.seed, recache=recache, shot_left=left)
        out.append(eng.generate_block(sess, b.latent_frames, left))
    return torch.cat(out, dim=2)


def test_a_prompt_gives_the_frames_asked_and_the_engines_latents(tmp_path):
    video, latents = tmp_path / "fox.mp4", tmp_path / "fox.pt"
    r = generate("--prompt", "a red fox", "--seconds", "2", "--fps", "16", "--size", "256x144", "--seed", "3")
    assert r.returncode == 2 and "-o" in r.stderr  # no output named: refused before any work
    r = generate(
        *("--prompt", "a red fox", "--seconds", "2", "--fps", "16", "--size", "256x144", "--seed", "3"),
        *("-o", str(video), "--latents", str(latents)),
    )
    assert r.returncode == 0, r.stderr
    assert "\r" not in r.stderr  # stderr is a pipe here: no progress bar redrawn into it
    assert "32 frames" in r.stdout and "seed 3" in r.stdout
    assert_frames(video.read_bytes(), 32, 256, 144)  # 2 s at 16 fps

    z = torch.load(latents)
    scenes = [Scene("a red fox", 32)]
    planned = sum(b.latent_frames for b in plan_blocks(scenes, 3, 4))
    assert z.dtype == torch.float32 and tuple(z.shape) == (1, 16, planned, 144 // 8, 256 // 8)
    want = engine_latents([], scenes, 256, 144, 3)
    torch.testing.assert_close(z, want, rtol=1e-5, atol=1e-5)


def test_a_storyboard_is_the_video_the_daemon_streams(tmp_path):
    """SHORT_STORY (a continue that re-caches, then a cut with its own seed) as a request body in a
    file: the same frames as the daemon streams for the same body."""
    story, video, latents = tmp_path / "story.json", tmp_path / "story.mp4", tmp_path / "story.pt"
    story.write_text(json.dumps(SHORT_STORY))
    status, _, err = generate_here("--scenes", str(story), "-o", str(video), "--latents", str(latents))
    assert status == 0, err
    got = video.read_bytes()
    assert_frames(got, 48, 256, 144)  # three 1 s scenes at 16 fps
    scenes = [Scene(s["prompt"], 16, s.get("transition", "cut"), s.get("seed")) for s in SHORT_STORY["scenes"]]
    planned = sum(b.latent_frames for b in plan_blocks(scenes, 3, 4))
    assert torch.load(latents).shape == (1, 16, planned, 18, 32)

    assert_same_as_one_dit_and_vae(got, SHORT_STORY)


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    """Small Wan 2.1 weights in both published layouts and a {generator, generator_ema} checkpoint
    (test_loading's fixture, written once for this module)."""
    pytest.importorskip("diffusers")
    from .models.test_loading import checkpoints

    return checkpoints.__wrapped__(tmp_path_factory)


def test_a_published_preset_on_a_release_layout(tmp_path, release):
    base = release / "diffusers"  # its text_encoder/config.json gives the small T5's shape
    flags = ["--preset", "self-forcing", "--model", str(base), "--dit-checkpoint", str(release / "causal_forcing.pt")]
    scenes = [{"prompt": "a harbour at dawn", "num_frames": 9}, {"prompt": "a road", "num_frames": 6, "seed": 5}]
    story, video, latents = tmp_path / "story.json", tmp_path / "story.mp4", tmp_path / "story.pt"
    story.write_text(json.dumps(scenes))  # the bare 'scenes' array
    status, _, err = generate_here(
        *flags, "--scenes", str(story), "--size", "64x64", "--seed", "2", "-o", str(video), "--latents", str(latents)
    )
    assert status == 0, err
    assert_frames(video.read_bytes(), 15, 64, 64)
    planned = [Scene("a harbour at dawn", 9), Scene("a road", 6, "cut", 5)]
    z = torch.load(latents)
    assert z.shape == (1, 16, sum(b.latent_frames for b in plan_blocks(planned, 3, 4)), 8, 8)
    torch.testing.assert_close(z, engine_latents(flags, planned, 64, 64, 2), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "flags, names",
    [
        (["--prompt", "a", "--scenes", "s.json"], "--scenes"),
        (["--prompt", "a", "--size", "250x144"], "--size"),
        (["--prompt", "a", "--seconds", "0"], "--seconds"),
        (["--prompt", "a", "--num-frames", "5", "--seconds", "1"], "--seconds"),
        (["--prompt", "a", "--fps", "0"], "--fps"),
        (["--prompt", "a", "--seed", "x"], "--seed"),
        (["--prompt", "a", "--device", "tpu"], "--device"),
        (["--scenes", "{not json"], "--scenes"),
        (["--scenes", '[{"prompt": "a", "seconds": 1, "transition": "fade"}]'], "scenes[0].transition"),
        (["--scenes", '{"prompt": "a"}'], "--scenes"),
        (["--scenes", '[{"prompt": "a", "seconds": 1}]', "--size", "64x64", "--fps", "100"], "--fps"),
        (["--prompt", "a", "--controls", "{not json"], "--controls"),
        (["--prompt", "a", "--controls", '[{"seq": 1, "keyboard": ["w"]}]'], "--controls"),  # the default takes none
    ],
)
def test_a_bad_flag_is_refused_naming_it(tmp_path, flags, names):
    for flag in ("--scenes", "--controls"):
        if flag in flags and flags[flags.index(flag) + 1] != "s.json":  # the file's text, written
            i = flags.index(flag) + 1
            (tmp_path / "s.json").write_text(flags[i])
            flags = [*flags[:i], str(tmp_path / "s.json"), *flags[i + 1 :]]
    r = generate(*flags, "-o", str(tmp_path / "out.mp4"), timeout_s=60)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert names in r.stderr, r.stderr
    assert not (tmp_path / "out.mp4").exists()
