#!/usr/bin/env python3
"""One short run on an accelerator that shows what the CPU cannot (about 5 minutes on one H200).

    python tools/device/check.py                  # cuda or xpu, whichever is present
    python tools/device/check.py --device cpu --quick   # the same checks, trimmed, on the CPU (CI)

1. stages: the real Wan 2.1 1.3B DiT and VAE configs (random weights) at 832x480 in bf16,
   chunk-wise (3 latent frames per block) and frame-wise (1): per-block times, peak memory
   (tools/bench/models.py in a child process, one per sampler setting).
2. numerics: our DiT and VAE in bf16 against diffusers' `WanTransformer3DModel` and
   `AutoencoderKLWan` in bf16, both against diffusers in fp32 on the same device. Tolerance:
   ours may be at most 1.5x as far from the fp32 reference as diffusers' own bf16 is, plus
   1e-3 (relative RMS) — bf16 rounding differs with the order of operations, so the bar is
   "as good as the reference implementation at the same precision", not a fixed epsilon.
3. vae_group: a height-sharded VAE group of k=2 ranks (on two devices where there are two)
   decodes 4 streamed blocks at 832x480 exactly as k=1 does (within 2e-2 in bf16: halo rows cross
   as bf16, identical arithmetic otherwise). NCCL refuses two ranks on one GPU, so on one the
   gloo fallback over the device tensors is tried too; both are reported.
4. daemon_real: the real 1.3B DiT and VAE configs with random weights, written in the diffusers
   layout (Wan-AI/Wan2.1-T2V-1.3B-Diffusers) with a 2-layer umT5 of the real width as the text
   encoder, loaded by `streamdiffd --model DIR --device <dev>` as a release is, streaming 81
   frames at 832x480: time to first fragment, frames/s, the daemon's own per-block stage times.
5. daemon: `streamdiffd --device <dev>` with no layout flags (it profiles the device and plans)
   streams 49 frames of the tiny preset at 832x480. In both daemon checks the bytes are checked
   as the CPU tests check them: PyAV and ffprobe (where installed) decode every frame at the
   size, keyframes exactly at fragment starts, continuous fragment times.
6. pytest -m device tests/device (with --device cpu the CPU stands in for the device, so that
   the tests do not rot between the sessions that have one).
7. compile (run second): the real 1.3B DiT at 832x480, 3-frame blocks behind a full window,
   eager against `--compile on` (torch.compile of the blocks): ms per block, compile time and
   graphs, the outputs' largest difference. No CUDA graphs yet: they are written once a GPU
   can run them.
8. krea14b (run third): the Wan 2.1 T2V 14B DiT, random bf16 weights built on the device,
   Krea Realtime's sampler (4 steps, a window of 3 context frames + the 3-frame block, the
   context recomputed after each block) at 832x480: ms per block, peak memory, and the
   planner's priced bytes and FLOPs beside them; skipped where the device is too small, a tiny
   width on the CPU.
9. world: the 1.3B in minWM's 4-frame blocks, plain and with its PRoPE camera path, and
   Matrix-Game's action DiT at 640x352: ms per steady block, the session's bytes held against the
   planner's price, peak memory.

--quick (the CPU, in the suite) runs every check trimmed but two, which it skips unless --only
names them (QUICK_SKIPS): the frame-wise stages child (the chunk-wise one's script with one flag
changed) and the daemon check (daemon_real streams through the same code; planning needs a
device to profile).

Writes every figure to $OUT/device_check.json (or --json) after each check, so a run cut short
keeps what it measured, and prints one summary line per check.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from streamdiff.models.wan.dit import WanDiT  # noqa: E402
from streamdiff.platform.devices import cpu_model  # noqa: E402
from streamdiff.testing import WAN21_1_3B_DIFFUSERS  # noqa: E402


def pick_device(name: str | None) -> str:
    if name:
        return name
    if torch.cuda.is_available():
        return "cuda"
    if hasattr(torch, "xpu") and torch.xpu.is_available():
        return "xpu"
    raise SystemExit("device_check: no CUDA or XPU device (pass --device cpu to run it on the CPU)")


def sync(dev: str) -> None:
    if dev.startswith("cuda"):
        torch.cuda.synchronize()
    elif dev.startswith("xpu"):
        torch.xpu.synchronize()


# ----------------------------------------------------------------------------- 1. stages


def random_dit(cfg, dtype: torch.dtype, dev: str):
    """A DiT of `cfg` built on the device with random weights of the trained scale (activations
    stay finite), in `dtype`; and the device generator that drew them, to draw on from."""
    with torch.device("meta"):
        model = WanDiT(cfg)
    model = model.to(dtype).to_empty(device=dev)
    gen = torch.Generator(device=dev).manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 1.0 / max(1, p.shape[-1]) ** 0.5, generator=gen)
    return model.cast(dtype).eval().requires_grad_(False), gen


def check_stages(dev: str, a) -> dict:
    out = {}
    for fpb in (3,) if "stages.framewise" in a.skips else (3, 1):
        path = Path(a.workdir) / f"stages_{fpb}.json"
        path.unlink(missing_ok=True)
        cmd = [
            sys.executable,
            str(ROOT / "tools" / "bench" / "models.py"),
            "--preset",
            "wan2.1-t2v-1.3b",
            "--random-weights",
            "--device",
            dev,
            "--dtype",
            a.dtype,
            "--size",
            "64x32" if a.quick else a.size,  # --quick: the real VAE's full width is 9 s a block at 128x64 here
            "--frames-per-block",
            str(fpb),
            "--blocks",
            str(a.blocks),
            "--json",
            str(path),
        ]
        if a.quick:
            cmd += ["--warm-blocks", "0", "--layers", "2"]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=a.stage_timeout_s)
        if r.returncode != 0:
            raise RuntimeError(f"tools/bench/models.py failed:\n{r.stderr[-3000:]}")
        print(r.stdout.strip(), flush=True)
        out[f"{'chunk' if fpb == 3 else 'frame'}wise"] = json.loads(path.read_text())[0]
    return out


def check_taehv(dev: str, a) -> dict:
    """TAEHV (published widths) against the real Wan VAE config, one steady block of 3 latent
    frames at 832x480 each, fp32 (tools/bench/decoders.py); --quick: TAEHV alone at 128x64."""
    path = Path(a.workdir) / "decoders.json"
    cmd = [sys.executable, str(ROOT / "tools" / "bench" / "decoders.py"), "--real", "--device", dev]
    cmd += ["--size", a.size, "--blocks", str(a.blocks), "--json", str(path)]
    if a.quick:
        cmd += ["--only", "taehv"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=a.stage_timeout_s)
    if r.returncode != 0:
        raise RuntimeError(f"tools/bench/decoders.py failed:\n{r.stderr[-3000:]}")
    print(r.stdout.strip(), flush=True)
    res = json.loads(path.read_text())
    return {**res, "ok": res["taehv-published"]["block_ms"] > 0 and res["taehv-published"]["frames"] == 12}


# ----------------------------------------------------------------------------- 1b. the 14B


def check_compile(dev: str, a) -> dict:
    """The real Wan 2.1 1.3B DiT (random weights built on the device) at 832x480, 3-frame blocks
    of the 4-step sampler behind a full 21-frame window: ms per block eager and with the blocks
    compiled (`WanDiT.compile_blocks`, what `--compile on` runs), the compile time, the graphs
    compiled, and the largest difference between the two outputs. CUDA graphs are not built yet
    (written once a GPU is at hand to run them). On the CPU a tiny width at --quick's size."""
    from dataclasses import replace

    from streamdiff.models.compiled import Compiler, compile_stats
    from streamdiff.models.wan.dit import DiTConfig
    from streamdiff.models.wan.sampler import denoise_block, warped_timesteps

    w, h = (int(x) for x in a.size.split("x"))
    cfg = DiTConfig()
    if dev == "cpu":
        cfg = replace(cfg, dim=128, ffn_dim=256, num_heads=1, num_layers=2)
    dtype = torch.float32 if dev == "cpu" else torch.bfloat16
    model, gen = random_dit(cfg, dtype, dev)
    ts = warped_timesteps((1000, 750, 500, 250), 5.0)
    ctx = torch.randn(1, cfg.text_len, cfg.text_dim, device=dev, generator=gen).to(dtype)
    shape = (1, cfg.in_channels, 3, h // 8, w // 8)
    noise = [torch.randn(shape, device=dev, generator=gen) for _ in ts]
    out = {"size": a.size, "dtype": str(dtype), "cuda_graphs": "not built: written once a GPU can run them"}
    last = {}
    for mode in ("eager", "compiled"):
        # --quick checks the path only: dynamo's tracing without inductor's minutes of C++ on a CPU
        on = Compiler("on", dev, backend="aot_eager" if a.quick else "inductor") if mode == "compiled" else None
        model.compile_blocks(on)
        state = model.new_state(h // 8, w // 8, 21, 0)
        model.set_prompt(state, ctx)
        times = []
        for _ in range(2 if a.quick else 9):  # 7 blocks fill the window; then the timed ones
            sync(dev)
            t0 = time.perf_counter()
            x0 = denoise_block(model, state, noise[0], ts, noise[1:])
            sync(dev)
            times.append(1000 * (time.perf_counter() - t0))
        last[mode] = x0.float()
        out[mode] = {"first_block_ms": round(times[0], 1), "block_ms": round(statistics.median(times[-2:]), 1)}
    out["compiled"].update(compile_stats())
    out["max_abs_diff"] = float((last["compiled"] - last["eager"]).abs().max())
    out["speedup"] = round(out["eager"]["block_ms"] / out["compiled"]["block_ms"], 2)
    model.compile_blocks(None)
    print(f"compile: {out}", flush=True)
    return out


def check_krea14b(dev: str, a) -> dict:
    """The Wan 2.1 T2V 14B DiT (random weights built on the device in bf16) running Krea
    Realtime's sampler at 832x480: one 3-frame block in its real window (3 context frames + the
    block, the context recomputed after each block), ms per block and peak memory, beside what
    the planner priced (placement/cost.py). Skipped where the device is too small; on the CPU
    the same loop at a tiny width (the code path, not the figure)."""
    from dataclasses import replace

    from streamdiff.models.catalog import checkpoint_preset
    from streamdiff.models.presets import WAN_14B
    from streamdiff.models.wan.sampler import denoise_block, sigma_of, step_timesteps
    from streamdiff.placement.cost import GIB, model_cost

    krea = checkpoint_preset("krea-realtime-14b")
    w, h = (int(x) for x in a.size.split("x"))
    cost = model_cost(krea.name, (w, h), 2)
    dit_need = cost.params * 2 + cost.activation_bytes + cost.session_bytes  # no text encoder here
    out = {
        "size": a.size,
        "priced": {
            "dit_weights_gib": round(cost.params * 2 / GIB, 2),
            "session_gib": round(cost.session_bytes / GIB, 2),
            "activation_gib": round(cost.activation_bytes / GIB, 2),
            "block_tflop": round(cost.block_flops / 1e12, 1),
        },
    }
    cfg = WAN_14B
    if dev == "cpu":
        cfg = replace(WAN_14B, dim=128, ffn_dim=256, num_heads=1, num_layers=2)
        out["note"] = "CPU: the loop at a tiny width (dim 128, 2 layers), not the 14B's figure"
    elif dev.startswith("cuda"):
        total = torch.cuda.get_device_properties(0).total_memory
        if total < dit_need:
            return {**out, "skipped": f"the 14B DiT needs {dit_need / GIB:.1f} GiB, the device has {total / GIB:.1f}"}
    dtype = torch.float32 if dev == "cpu" else torch.bfloat16
    model, gen = random_dit(cfg, dtype, dev)
    if dev.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
        out["weights_gib"] = round(torch.cuda.memory_allocated() / GIB, 2)
    state = model.new_state(h // 8, w // 8, krea.window_frames, krea.sink)
    model.set_prompt(state, torch.randn(1, cfg.text_len, cfg.text_dim, device=dev).to(dtype))
    ts = step_timesteps(krea.steps, krea.shift, krea.warp)
    sig = sigma_of(ts, krea.shift)
    shape = (1, cfg.in_channels, krea.frames_per_block, h // 8, w // 8)
    times = []
    for b in range(1 if a.quick else 5):
        noise = [torch.randn(shape, device=dev) for _ in ts]
        sync(dev)
        t0 = time.perf_counter()
        x0 = denoise_block(model, state, noise[0], ts, noise[1:], 0.0, sig, commit=False)
        model.commit_and_recompute(state, x0, krea.frames_per_block)
        sync(dev)
        times.append(1000 * (time.perf_counter() - t0))
        if not torch.isfinite(x0).all():
            raise RuntimeError(f"block {b}: non-finite latents")
    steady = times[2:] or times
    out["block_ms"] = round(statistics.median(steady), 1)
    out["blocks_ms"] = [round(t, 1) for t in times]
    out["held_frames"] = state.kv.frames
    if dev.startswith("cuda"):
        out["peak_gib"] = round(torch.cuda.max_memory_allocated() / GIB, 2)
    print(f"krea14b: {out}", flush=True)
    del model, state
    return out


def check_longlive2(dev: str, a) -> dict:
    """LongLive 2.0 on the Wan 2.2 TI2V 5B (random bf16 weights built on the device) at its
    1280x704: one 8-frame block of its UniPC sampler (4 steps, then the clean pass) in its
    32-frame window, and the Wan 2.2 VAE (real widths) decoding that block's 8 latent frames to
    32 in the frames per call the worker would choose from the device's memory (a quarter of
    its free memory at the peak: the result says the share it took), each with ms a block and
    peak memory beside what the planner priced. On the CPU the same loop at tiny widths and
    128x64 (the code path, not the figure)."""
    from dataclasses import replace

    from streamdiff.models.catalog import checkpoint_preset
    from streamdiff.models.presets import WAN22_5B, WAN22_VAE
    from streamdiff.models.wan.sampler import denoise_block, unipc_timesteps
    from streamdiff.models.wan.vae import WanVAEDecoder
    from streamdiff.placement.cost import GIB, model_cost

    ll = checkpoint_preset("longlive2-5b")
    w, h = (128, 64) if a.quick else (1280, 704)
    cost = model_cost(ll.name, (w, h), 2)
    out = {
        "size": f"{w}x{h}",
        "priced": {
            "dit_weights_gib": round(cost.params * 2 / GIB, 2),
            "session_gib": round(cost.session_bytes / GIB, 2),
            "block_tflop": round(cost.block_flops / 1e12, 1),
        },
    }
    cfg, vcfg = WAN22_5B, WAN22_VAE
    if dev == "cpu":
        cfg = replace(WAN22_5B, dim=128, ffn_dim=256, num_heads=1, num_layers=2)
        vcfg = replace(WAN22_VAE, base_dim=8, decoder_base_dim=12)
        out["note"] = "CPU: the loop at tiny widths (DiT dim 128, 2 layers; VAE widths 8/12), not the 5B's figure"
    elif dev.startswith("cuda"):
        total, need = torch.cuda.get_device_properties(0).total_memory, cost.needs() - cost.text_params * 2
        if total < need:  # no text encoder here
            return {**out, "skipped": f"the 5B DiT needs {need / GIB:.1f} GiB, the device has {total / GIB:.1f}"}
    dtype = torch.float32 if dev == "cpu" else torch.bfloat16
    model, gen = random_dit(cfg, dtype, dev)
    if dev.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    lh, lw = h // 16, w // 16
    state = model.new_state(lh, lw, ll.window_frames, ll.sink)
    model.set_prompt(state, torch.randn(1, cfg.text_len, cfg.text_dim, device=dev).to(dtype))
    ts = unipc_timesteps(ll.steps, ll.shift)
    times, latents = [], None
    for b in range(1 if a.quick else 5):  # the window fills at block 4
        noise = torch.randn(1, cfg.in_channels, ll.frames_per_block, lh, lw, device=dev)
        sync(dev)
        t0 = time.perf_counter()
        latents = denoise_block(model, state, noise, ts, [], 0.0, unipc=True)
        sync(dev)
        times.append(1000 * (time.perf_counter() - t0))
        if not torch.isfinite(latents).all():
            raise RuntimeError(f"block {b}: non-finite latents")
    out["block_ms"] = round(statistics.median(times[3:] or times), 1)
    out["blocks_ms"] = [round(t, 1) for t in times]
    if dev.startswith("cuda"):
        out["dit_peak_gib"] = round(torch.cuda.max_memory_allocated() / GIB, 2)
    del model, state
    if dev.startswith("cuda"):
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    with torch.device("meta"):
        vae = WanVAEDecoder(vcfg)
    vae = vae.to_empty(device=dev)
    with torch.no_grad():
        for p in vae.parameters():
            p.normal_(0.0, 1.0 / max(1, p[0].numel()) ** 0.5, generator=gen)
        vae.mean.copy_(torch.tensor(vcfg.latents_mean).view(1, -1, 1, 1, 1))
        vae.std.copy_(torch.tensor(vcfg.latents_std).view(1, -1, 1, 1, 1))
    vae = vae.to(dtype).eval()
    vstate = vae.new_state()
    z = latents.to(dtype)
    vae.decode(z[:, :, :1], vstate)  # a shot's first latent frame: then steady blocks
    # The block decoded as the VAE worker plans it: frames per call from the device's working
    # set (a quarter of its free memory at the peak, platform/accel.py), the peak beside it.
    from streamdiff.models.wan.kernels import CPU_DECODE_WORKING_SET_BYTES, plan_block
    from streamdiff.platform import for_device

    plat = for_device(dev if dev == "cpu" or ":" in dev else f"{dev}:0")
    working_set = plat.decode_working_set(CPU_DECODE_WORKING_SET_BYTES)
    width = vcfg.decoder_dim // vcfg.patch_size**2
    plan = plan_block(
        tuple(z.shape[1:]), 1, torch.device(dev).type, width, vcfg.spatial_factor, vcfg.temporal_factor,
        z.element_size(), working_set,
    )  # fmt: skip
    before = torch.cuda.memory_allocated() if dev.startswith("cuda") else 0
    free = torch.cuda.mem_get_info()[0] if dev.startswith("cuda") else 0
    if dev.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    vtimes = []
    for _ in range(1 if a.quick else 3):
        sync(dev)
        t0 = time.perf_counter()
        with torch.no_grad():
            frames = vae.decode_rows(z, vstate, plan, 0, None, False)
        sync(dev)
        vtimes.append(1000 * (time.perf_counter() - t0))
    out["vae_block_ms"] = round(statistics.median(vtimes), 1)
    out["vae_frames"] = frames.shape[2]
    out["vae_frames_per_call"] = plan.frames_per_call
    out["vae_working_set_gib"] = round(min(working_set, 2**40) / GIB, 2)
    if dev.startswith("cuda"):
        from streamdiff.platform.accel import DECODE_SHARE

        peak = torch.cuda.max_memory_allocated() - before
        out["vae_peak_gib"] = round(peak / GIB, 2)
        out["vae_peak_share_of_free"] = round(peak / max(free, 1), 3)  # the plan aims at DECODE_SHARE
        out["vae_peak_within_share"] = peak <= DECODE_SHARE * free
    print(f"longlive2: {out}", flush=True)
    return out


def check_world(dev: str, a) -> dict:
    """The world models' DiT work on the device, random bf16 weights: the 1.3B at 832x480 in
    4-frame blocks behind a window of 20, plain and with minWM's PRoPE path (what the camera
    costs), and Matrix-Game's DiT (15 action modules, 36 channels in, CLIP-wide context) at
    640x352 in 3-frame blocks behind a window of 6: ms per steady block (the steps and the clean
    pass), peak memory, and the planner's priced session bytes. Tiny widths on the CPU."""
    from dataclasses import replace

    from streamdiff.controls import camera_row
    from streamdiff.models.presets import MATRIX_GAME_DIT
    from streamdiff.models.wan.action import ActionConfig, block_actions
    from streamdiff.models.wan.dit_config import DiTConfig
    from streamdiff.models.wan.sampler import denoise_block, step_timesteps
    from streamdiff.placement.cost import GIB, model_cost

    dtype, out = (torch.float32 if dev == "cpu" else torch.bfloat16), {}
    runs = (
        ("wan-1.3b", DiTConfig(), None, (832, 480), 4, 20, (1000, 750, 500, 250)),
        ("minwm", DiTConfig(prope=True), "minwm-action2v", (832, 480), 4, 20, (1000, 750, 500, 250)),
        ("matrix-game", replace(MATRIX_GAME_DIT, action=ActionConfig(4, True)), "matrix-game-2-universal",
         (640, 352), 3, 6, (1000, 666, 333)),
    )  # fmt: skip
    for name, cfg, preset, (w, h), fpb, window, steps in runs:
        if dev == "cpu":  # the loops at tiny widths: the code path, not the figure
            tiny = ActionConfig(4, True, blocks=(0,), heads=2, keyboard_hidden_dim=128, mouse_hidden_dim=128)
            cfg = replace(cfg, dim=64, ffn_dim=128, num_heads=1, num_layers=2, text_dim=32, text_len=8,
                          image_dim=32 if cfg.image_dim else 0, action=tiny if cfg.action else None)  # fmt: skip
            w, h = 128, 64
        model, _ = random_dit(cfg, dtype, dev)
        if dev.startswith("cuda"):
            torch.cuda.reset_peak_memory_stats()
        lh, lw = h // 8, w // 8
        state = model.new_state(lh, lw, window)
        ctx = (1, 257, cfg.image_dim) if cfg.image_dim else (1, cfg.text_len, cfg.text_dim)
        model.set_prompt(state, torch.randn(*ctx, device=dev).to(dtype))
        ts, times, history = step_timesteps(steps, 5.0, True), [], []
        for b in range(2 if a.quick else window // fpb + 3):  # steady once the window is full
            if cfg.prope:
                state.camera = torch.tensor([camera_row(torch.eye(4).double().numpy())] * fpb)
            if cfg.cond_channels:
                state.cond = torch.randn(1, cfg.cond_channels, fpb, lh, lw, device=dev)
            if cfg.action is not None:
                history += [([1.0, 0.0, 0.0, 0.0], [0.1, 0.0])] * fpb
                state.actions = block_actions(cfg.action, history, state.next_frame, fpb, dev)
            noise = torch.randn(1, cfg.out_channels, fpb, lh, lw, device=dev)
            renoise = [torch.randn_like(noise) for _ in steps[1:]]
            sync(dev)
            t0 = time.perf_counter()
            x0 = denoise_block(model, state, noise, ts, renoise)
            sync(dev)
            times.append(1000 * (time.perf_counter() - t0))
            if not torch.isfinite(x0).all():
                raise RuntimeError(f"{name} block {b}: non-finite latents")
        r = {"size": f"{w}x{h}", "block_ms": round(statistics.median(times[-3:]), 1),
             "session_gib": round(state.kv.nbytes / GIB, 2)}  # fmt: skip
        if preset is not None:  # the planner prices the real configuration
            r["priced_session_gib"] = round(model_cost(preset, (w, h), 2).session_bytes / GIB, 2)
        if dev.startswith("cuda"):
            r["peak_gib"] = round(torch.cuda.max_memory_allocated() / GIB, 2)
        out[name] = r
        del model, state
        if dev.startswith("cuda"):
            torch.cuda.empty_cache()
    print(f"world: {out}", flush=True)
    return out


# ----------------------------------------------------------------------------- 2. numerics


def rel_rms(x: torch.Tensor, ref: torch.Tensor) -> float:
    x, ref = x.float(), ref.float()
    return ((x - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt().clamp_min(1e-12)).item()


def to_bf16_as_diffusers(model: torch.nn.Module) -> None:
    """bf16 the way diffusers' from_pretrained(torch_dtype=bf16) leaves a model: the modules it
    names in `_keep_in_fp32_modules` stay in float32 (its best bf16 behaviour, our bar)."""
    model.to(torch.bfloat16)
    keep = getattr(model, "_keep_in_fp32_modules", None) or []
    for name, module in model.named_modules():
        if any(k in name.split(".") for k in keep):
            module.float()


def check_numerics(dev: str, a) -> dict:
    from diffusers import AutoencoderKLWan, WanTransformer3DModel

    from streamdiff.models.wan.dit import DiTConfig, WanDiT
    from streamdiff.models.wan.loading import load_into, normalize_dit_state_dict, normalize_vae_state_dict
    from streamdiff.models.wan.vae import VAEConfig, WanVAEDecoder

    bf16 = torch.bfloat16
    w, h = (int(v) for v in a.size.split("x"))
    g = torch.Generator().manual_seed(0)
    res = {}

    # DiT: one latent frame of the real config (1560 tokens at 832x480), per-frame timesteps.
    layers = 2 if a.quick else 30
    torch.manual_seed(0)
    ref = WanTransformer3DModel(**{**WAN21_1_3B_DIFFUSERS, "num_layers": layers}).eval()
    with torch.no_grad():  # away from the init's symmetric values
        for p in ref.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.02)
    ours = WanDiT(DiTConfig(num_layers=layers)).eval()
    load_into(ours, normalize_dit_state_dict(ref.state_dict()), "diffusers DiT")
    x = torch.randn(1, 16, 2, h // 8, w // 8, generator=g)
    ctx = torch.randn(1, 512, 4096, generator=g)
    t = torch.tensor([[750.0, 750.0]])
    tok = (h // 16) * (w // 16)
    with torch.no_grad():
        ref = ref.to(dev)
        exact = ref(x.to(dev), t.repeat_interleave(tok, dim=1).to(dev), ctx.to(dev)).sample.float()
        to_bf16_as_diffusers(ref)
        theirs = ref(x.to(dev, bf16), t.repeat_interleave(tok, dim=1).to(dev), ctx.to(dev, bf16)).sample
        del ref
        ours = ours.to(dev).cast(bf16)
        mine = ours.forward_full(x.to(dev, bf16), t.to(dev), ctx.to(dev, bf16))
    res["dit"] = {
        "layers": layers,
        "tokens": 2 * tok,
        "ours_bf16": rel_rms(mine, exact),
        "diffusers_bf16": rel_rms(theirs, exact),
    }
    del ours

    # VAE: 3 latent frames of the real config (--quick: a sixth of its width; the real one in
    # bf16 took minutes on an AVX2 CPU, which has no bf16 arithmetic).
    torch.manual_seed(0)
    base = 16 if a.quick else 96
    vref = AutoencoderKLWan(base_dim=base, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=2).eval()
    with torch.no_grad():
        for p in vref.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.01)
    vours = WanVAEDecoder(VAEConfig(base_dim=base)).eval()
    load_into(vours, normalize_vae_state_dict(vref.state_dict(), VAEConfig(base_dim=base)), "diffusers VAE")
    z = torch.randn(1, 16, 3, h // 8, w // 8, generator=g)
    zd = z * vours.std + vours.mean
    with torch.no_grad():
        vref = vref.to(dev)
        exact = vref.decode(zd.to(dev)).sample.float()
        to_bf16_as_diffusers(vref)
        theirs = vref.decode(zd.to(dev, bf16)).sample
        del vref
        vours = vours.to(dev, bf16)
        vours.mean, vours.std = vours.mean.float(), vours.std.float()
        mine = vours.decode(z.to(dev), vours.new_state())
    res["vae"] = {
        "frames": 3,
        "base_dim": base,
        "ours_bf16": rel_rms(mine, exact),
        "diffusers_bf16": rel_rms(theirs, exact),
    }
    for r in res.values():
        r["tolerance"] = 1.5 * r["diffusers_bf16"] + 1e-3
        r["ok"] = r["ours_bf16"] <= r["tolerance"]
    res["ok"] = all(r["ok"] for r in res.values() if isinstance(r, dict))
    return res


# ----------------------------------------------------------------------------- 3. VAE group


def _group_rank(rank, world, addr, backend, dev, size, quick, q):
    try:
        from streamdiff.models.wan.kernels import plan_block
        from streamdiff.models.wan.vae import VAEConfig, WanVAEDecoder
        from streamdiff.parallel.vae_group import ExchangeHalo, init_group
        from streamdiff.platform import select

        # Each rank on its own device where there are two (NCCL refuses two ranks on one), with
        # its index: NCCL's device_id needs one, and the rank's device is selected before use.
        if dev != "cpu":
            count = torch.cuda.device_count() if dev.startswith("cuda") else torch.xpu.device_count()
            dev = f"{dev.split(':')[0]}:{rank % count}"
            select(dev)
        init_group(addr, rank, world, dev, 120, backend)
        cfg = VAEConfig(base_dim=16 if quick else 96)
        torch.manual_seed(0)
        vae = WanVAEDecoder(cfg).eval().to(dev, torch.bfloat16)
        vae.mean, vae.std = vae.mean.float(), vae.std.float()
        w, h = size
        g = torch.Generator().manual_seed(1)
        state, strips, times = vae.new_state(), [], []
        for f in (1, 3, 3, 3):
            z = torch.randn(1, 16, f, h // 8, w // 8, generator=g).to(dev)
            plan = plan_block(z.shape, 2, torch.device(dev).type, cfg.base_dim, 8, 4, 2)
            sync(dev)
            t0 = time.perf_counter()
            y = vae.decode_rows(z, state, plan, rank, ExchangeHalo(rank, list(plan.bands)))
            sync(dev)
            times.append(time.perf_counter() - t0)
            strips.append(y.float().cpu().numpy())  # numpy: torch tensors would travel as shared-memory handles
        q.put((rank, strips, times, None))
    except Exception:
        q.put((rank, None, None, traceback.format_exc()))


def check_vae_group(dev: str, a) -> dict:
    from streamdiff.models.wan.vae import VAEConfig, WanVAEDecoder
    from streamdiff.spawn import torch_context
    from streamdiff.supervisor.topology import free_port

    w, h = (int(v) for v in a.size.split("x"))
    cfg = VAEConfig(base_dim=16 if a.quick else 96)
    torch.manual_seed(0)
    vae = WanVAEDecoder(cfg).eval().to(dev, torch.bfloat16)
    vae.mean, vae.std = vae.mean.float(), vae.std.float()
    g = torch.Generator().manual_seed(1)
    state, ref, ref_t = vae.new_state(), [], []
    for f in (1, 3, 3, 3):
        z = torch.randn(1, 16, f, h // 8, w // 8, generator=g).to(dev)
        sync(dev)
        t0 = time.perf_counter()
        ref.append(vae.decode(z, state).float().cpu())
        sync(dev)
        ref_t.append(time.perf_counter() - t0)
    del vae
    out = {"k1_block_s": ref_t[1:]}
    backends = ["gloo"] if dev == "cpu" else (["nccl", "gloo"] if dev.startswith("cuda") else ["xccl", "gloo"])
    ctx = torch_context()  # the daemon's own: each rank forks from a server that imported torch once
    for backend in backends:
        q = ctx.Queue()
        addr = f"tcp://127.0.0.1:{free_port()}"
        procs = [ctx.Process(target=_group_rank, args=(r, 2, addr, backend, dev, (w, h), a.quick, q)) for r in (0, 1)]
        for p in procs:
            p.start()
        got = {}
        try:
            for _ in procs:
                rank, strips, times, err = q.get(timeout=a.group_timeout_s)
                got[rank] = (strips, times, err)
        except Exception as exc:  # queue.Empty: a hang
            got = {0: (None, None, f"no answer within {a.group_timeout_s}s: {exc!r}")}
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
        errs = [e for _, _, e in got.values() if e]
        if errs:
            out[backend] = {"ok": False, "error": errs[0][-1500:]}
            continue
        diffs = [
            (torch.cat([torch.from_numpy(got[r][0][i]) for r in (0, 1)], dim=-2) - ref[i]).abs().max().item()
            for i in range(len(ref))
        ]
        out[backend] = {
            "ok": max(diffs) <= 2e-2,
            "max_abs_diff": max(diffs),
            "k2_block_s": [max(a_, b_) for a_, b_ in zip(got[0][1][1:], got[1][1][1:])],
        }
    out["ok"] = any(v.get("ok") for k, v in out.items() if isinstance(v, dict))
    return out


# ----------------------------------------------------------------------------- 4. daemon


def stage_means(metrics_text: str) -> dict:
    """Mean seconds per block of each stage, from the daemon's own /metrics histogram."""
    from prometheus_client.parser import text_string_to_metric_families

    sums, counts = {}, {}
    for fam in text_string_to_metric_families(metrics_text):
        if fam.name != "streamdiff_stage_block_seconds":
            continue
        for smp in fam.samples:
            if smp.name.endswith("_sum"):
                sums[smp.labels["stage"]] = smp.value
            elif smp.name.endswith("_count"):
                counts[smp.labels["stage"]] = smp.value
    return {k: {"blocks": int(counts[k]), "mean_s": sums[k] / counts[k]} for k in sums if counts.get(k)}


def stream_and_check(dev: str, a, flags: list[str], frames: int, prompt: str) -> dict:
    """Start `streamdiffd --device dev *flags`, stream `frames` at a.size, check the bytes."""
    from streamdiff.testing import Daemon, check_video, http, stream_video

    w, h = (int(v) for v in a.size.split("x"))
    t_start = time.monotonic()
    d = Daemon("--device", dev, "--compile", a.daemon_compile, *flags, timeout_s=a.daemon_timeout_s)
    try:
        started = time.monotonic() - t_start
        t0 = time.monotonic()
        body = {"prompt": prompt, "num_frames": frames, "size": a.size}
        data, arrivals, _ = stream_video(d.url, body, timeout=a.daemon_timeout_s)
        wall = time.monotonic() - t0
        frags, _ = check_video(data, frames, w, h, 16)
        health = d.health()
        stages = stage_means(http.get(d.url + "/metrics", timeout=10).text)
        said = [ln for ln in d.logs().splitlines() if any(w in ln for w in (" ready ", "layout", "profile", "plan"))]
    finally:
        d.stop()
    return {
        "ok": True,
        "flags": flags,
        "start_s": started,
        "frames": frames,
        "fragments": len(frags),
        "time_to_first_chunk_s": arrivals[0][0],
        "wall_s": wall,
        "fps": frames / wall,
        "stage_block_s": stages,
        "placement": health.get("placement"),
        "workers": {n: {"ready": v["ready"], "busy_s": v["busy_s"]} for n, v in health["workers"].items()},
        "log": said[-12:],
    }


def one_layout(dev: str) -> list[str]:
    """Disaggregated where two devices are visible; one device runs both stages."""
    from streamdiff.platform.devices import device_count

    n = 2 if dev == "cpu" else device_count(dev)
    return ["--dit-gpus", "1", "--vae-gpus", "1"] + ([] if n >= 2 else ["--mode", "aggregated"])


def write_random_release(root: Path, dev: str, quick: bool) -> Path:
    """The real 1.3B DiT and VAE configs with random weights in the diffusers layout, as
    Wan-AI/Wan2.1-T2V-1.3B-Diffusers ships them, and a umT5 of the real width (4096) with 2
    layers and a word-level tokenizer: umT5-XXL's 5.7B random weights would cost minutes to
    write and load and only the text encoding, once per scene, would differ."""
    from diffusers import AutoencoderKLWan, WanTransformer3DModel
    from transformers import UMT5Config, UMT5EncoderModel

    from streamdiff.testing import write_tokenizer

    d = root / "wan-random"
    torch.manual_seed(0)
    with torch.device(dev):  # initialising 1.3B weights on an accelerator takes seconds
        small = {"num_attention_heads": 1, "ffn_dim": 256, "num_layers": 1} if quick else {}
        dit = WanTransformer3DModel(**{**WAN21_1_3B_DIFFUSERS, **small})
    dit.to("cpu", torch.bfloat16).save_pretrained(str(d / "transformer"))
    del dit
    with torch.device(dev):
        vae = AutoencoderKLWan(base_dim=8 if quick else 96, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=2)
    vae.to("cpu").save_pretrained(str(d / "vae"))
    del vae
    t5 = dict(d_kv=8, d_ff=64, num_heads=2) if quick else dict(d_kv=64, d_ff=10240, num_heads=64)
    with torch.device(dev):
        enc = UMT5EncoderModel(
            UMT5Config(
                vocab_size=64,
                d_model=4096,
                num_layers=2,
                relative_attention_num_buckets=32,
                relative_attention_max_distance=128,
                feed_forward_proj="gated-gelu",
                layer_norm_epsilon=1e-6,
                dropout_rate=0.0,
                **t5,
            )
        )
    enc.to("cpu", torch.bfloat16).save_pretrained(str(d / "text_encoder"))
    del enc
    write_tokenizer(d / "tokenizer")
    (d / "model_index.json").write_text(json.dumps({"_class_name": "WanPipeline"}))
    if dev.startswith("cuda"):
        torch.cuda.empty_cache()
    return d


def check_daemon_real(dev: str, a) -> dict:
    t0 = time.monotonic()
    d = write_random_release(Path(a.workdir), dev, a.quick)
    written = time.monotonic() - t0
    # --size: the workers time their start-up blocks at it (832x480 on the device; the CPU's 128x64)
    flags = ["--model", str(d), "--dtype", a.dtype, "--size", a.size, *one_layout(dev)]
    r = stream_and_check(dev, a, flags, 33 if a.quick else 81, "a red fox runs through snow")
    r["checkpoint_write_s"] = written
    return r


def check_daemon(dev: str, a) -> dict:
    # no layout flags: the daemon profiles the device and plans (on the CPU, --only daemon --quick:
    # a fixed layout)
    return stream_and_check(dev, a, one_layout(dev) if a.quick else [], 49, "a ship at sea")


def check_pytest(dev: str, a) -> dict:
    """Its two daemons start cold, each within the daemons' limit (the tests read it), and
    stream: the whole run gets both and a stage's time besides."""
    env = {
        **os.environ,
        "STREAMDIFF_TEST_DEVICE": dev.split(":")[0],
        "STREAMDIFF_DEVICE_COLD_S": str(a.daemon_timeout_s),
    }
    r = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "device", "tests/device"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=2 * a.daemon_timeout_s + a.stage_timeout_s,
        env=env,
    )
    tail = r.stdout.strip().splitlines()[-1:] or [r.stderr[-300:]]
    return {"ok": r.returncode == 0, "summary": tail[0]}


CHECKS = {  # in the order of what a short lease most needs
    "stages": check_stages,
    "compile": check_compile,
    "taehv": check_taehv,
    "krea14b": check_krea14b,
    "longlive2": check_longlive2,
    "world": check_world,
    "daemon_real": check_daemon_real,
    "numerics": check_numerics,
    "daemon": check_daemon,
    "vae_group": check_vae_group,
    "pytest": check_pytest,
}

# What --quick skips unless named in --only, and why: the suite runs the quick check on the CPU,
# where each costs seconds and shows nothing the others do not.
QUICK_SKIPS = {
    "daemon": "daemon_real streams through the same code; the daemon plans only on a device",
    "stages.framewise": "the chunk-wise child's script with --frames-per-block 1",
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", help="cuda, xpu or cpu (default: the accelerator present)")
    ap.add_argument("--quick", action="store_true", help="trimmed configs and sizes (for the CPU)")
    ap.add_argument("--only", help="comma-separated checks: " + ",".join(CHECKS))
    ap.add_argument("--json", help="where to write the results (default $OUT/device_check.json)")
    ap.add_argument(
        "--daemon-compile",
        default="off",
        choices=("auto", "on", "off"),
        help="--compile for the daemons it starts (default off: a short lease times the stream, and "
        "the compile check times compiling on its own)",
    )
    a = ap.parse_args()
    dev = pick_device(a.device)
    a.size = "128x64" if a.quick else "832x480"
    a.dtype = "float32" if dev == "cpu" else "bfloat16"
    a.blocks = 1 if a.quick else 3
    a.stage_timeout_s = 300
    a.group_timeout_s = 90  # two NCCL ranks on one GPU may hang rather than refuse
    a.daemon_timeout_s = 300
    out_dir = Path(os.environ.get("OUT") or ROOT / "docs" / "results")
    a.workdir = tempfile.mkdtemp(prefix="device_check-")
    results = {
        "device": dev,
        "name": torch.cuda.get_device_name() if dev.startswith("cuda") else dev,
        "torch": torch.__version__,
        "cpu": cpu_model(),
        "cpus": os.cpu_count(),
        "quick": a.quick,
    }
    path = Path(a.json) if a.json else out_dir / ("device_check_quick.json" if a.quick else "device_check.json")
    a.skips = QUICK_SKIPS if a.quick and not a.only else {}
    names = a.only.split(",") if a.only else [n for n in CHECKS if n not in a.skips]
    if a.skips:
        results["skipped"] = a.skips
    for name in names:
        t0 = time.monotonic()
        try:
            r = CHECKS[name](dev, a)
        except Exception:
            r = {"ok": False, "error": traceback.format_exc()[-3000:]}
        r["check_s"] = round(time.monotonic() - t0, 1)
        results[name] = r
        ok = r.get("ok", "error" not in r)
        print(f"device_check {name}: {'ok' if ok else 'FAILED'} in {r['check_s']}s", flush=True)
        if "error" in r:
            print(r["error"], flush=True)
        if dev.startswith("cuda"):
            torch.cuda.empty_cache()
        path.write_text(json.dumps(results, indent=1, default=str))
    print(f"device_check: results in {path}", flush=True)
    return 0 if all(results[n].get("ok", "error" not in results[n]) for n in names) else 1


if __name__ == "__main__":
    sys.exit(main())
