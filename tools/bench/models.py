#!/usr/bin/env python3
"""Per-block DiT and VAE times of each model preset on the current device.

Steady state: blocks are generated until the DiT's attention window is full (the per-block cost
stops growing), then `--blocks` more are timed; the VAE decodes the same latents. Prints one
line per preset and, with --json, writes the figures.

  python tools/bench/models.py                          # tiny preset, CPU, one thread
  python tools/bench/models.py --preset wan2.1-t2v-1.3b --random-weights --size 832x480 --device cuda
  python tools/bench/models.py --calibrate              # the tiny preset's DiT layer fraction
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from streamdiff.models.presets import ModelSpec, get_preset, resolve_dtype  # noqa: E402
from streamdiff.models.wan.dit import WanDiT  # noqa: E402
from streamdiff.models.wan.sampler import denoise_block, warped_timesteps  # noqa: E402
from streamdiff.models.wan.text import TinyTextEncoder  # noqa: E402
from streamdiff.models.wan.vae import WanVAEDecoder  # noqa: E402


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    elif device.startswith("xpu"):
        torch.xpu.synchronize()


def peak_mem(device: str) -> float | None:
    if device.startswith("cuda"):
        return torch.cuda.max_memory_allocated() / 2**30
    if device.startswith("xpu"):
        return torch.xpu.max_memory_allocated() / 2**30
    return None


def build(spec: ModelSpec, device: str, random_weights: bool, layers: int | None):
    """The preset's modules; `random_weights` builds the real configs without checkpoints."""
    preset = get_preset(spec) if (spec.preset == "tiny" or not random_weights) else None
    if preset is None:  # a real configuration (presets.WAN_ARCHS), random weights: no weights directory
        from streamdiff.models.catalog import checkpoint_preset
        from streamdiff.models.presets import WAN_ARCHS, Preset
        from streamdiff.models.wan.sampler import SamplerConfig

        cp = checkpoint_preset(spec.preset)  # a published checkpoint: its DiT, its authors' sampler
        arch = cp.dit if cp is not None else spec.preset
        if arch not in WAN_ARCHS:
            raise SystemExit(f"--random-weights builds a checkpoint preset or one of {sorted(WAN_ARCHS)}")
        dcfg, vcfg, size, _fps = WAN_ARCHS[arch]
        sampler = {**(cp.sampler_settings() if cp is not None else {}), **spec.sampler}
        preset = Preset(spec.preset, dcfg, vcfg, SamplerConfig(**sampler), "umt5", size)
    dtype = resolve_dtype(spec, device)
    dcfg = preset.dit if layers is None else type(preset.dit)(**{**preset.dit.__dict__, "num_layers": layers})
    torch.manual_seed(0)
    with torch.device(device):
        dit = WanDiT(dcfg)
        vae = WanVAEDecoder(preset.vae)
    dit = dit.cast(dtype).eval()
    vae = vae.to(dtype).eval()
    vae.mean, vae.std = vae.mean.float(), vae.std.float()
    return preset, dit, vae


def bench(
    spec: ModelSpec,
    device: str,
    size: tuple[int, int],
    blocks: int,
    random_weights: bool,
    layers: int | None = None,
    skip_vae: bool = False,
    warm_blocks: int | None = None,
) -> dict:
    preset, dit, vae = build(spec, device, random_weights, layers)
    s = preset.sampler
    w, h = size
    lh, lw = h // preset.vae.spatial_factor, w // preset.vae.spatial_factor
    f = s.frames_per_block
    ctx = TinyTextEncoder(dit.cfg.text_dim, dit.cfg.text_len).encode(["a benchmark prompt"])
    state = dit.new_state(lh, lw, s.window_frames, s.sink_frames)
    dit.set_prompt(state, ctx.to(device))
    ts_first = warped_timesteps(s.first_block_steps or s.steps, s.shift)
    ts = warped_timesteps(s.steps, s.shift)
    g = torch.Generator().manual_seed(0)
    vstate = vae.new_state()
    shape = (1, dit.cfg.in_channels, f, lh, lw)

    def one_dit(first: bool) -> tuple[float, torch.Tensor]:
        steps = ts_first if first else ts
        noise = torch.randn(shape, generator=g)
        renoise = [torch.randn(shape, generator=g) for _ in steps[1:]]
        sync(device)
        t0 = time.perf_counter()
        x0 = denoise_block(dit, state, noise, steps, renoise, s.context_t)
        sync(device)
        return time.perf_counter() - t0, x0

    def one_vae(x0: torch.Tensor) -> float:
        sync(device)
        t0 = time.perf_counter()
        vae.decode(x0, vstate)
        sync(device)
        return time.perf_counter() - t0

    first_dit, x0 = one_dit(True)
    first_vae = 0.0 if skip_vae else one_vae(x0)
    # Fill the attention window so the timed blocks are at the steady-state cost.
    warm = max(0, (s.window_frames - s.sink_frames) // f - 1) if warm_blocks is None else warm_blocks
    for _ in range(warm):
        _, x0 = one_dit(False)
    dit_t, vae_t = [], []
    for _ in range(blocks):
        t, x0 = one_dit(False)
        dit_t.append(t)
        if not skip_vae:
            vae_t.append(one_vae(x0))
    out = {
        "preset": preset.name,
        "device": device,
        "dtype": str(resolve_dtype(spec, device)).split(".")[-1],
        "size": f"{w}x{h}",
        "frames_per_block": f,
        "steps": len(ts),
        "dit_layers": dit.cfg.num_layers,
        "dit_full_layers": preset.dit.num_layers,
        "threads": torch.get_num_threads(),
        "first_block_dit_s": first_dit,
        "first_block_vae_s": first_vae,
        "window_filled": warm_blocks is None,
        "dit_block_s": statistics.median(dit_t),
        "dit_block_min_s": min(dit_t),
        "dit_block_max_s": max(dit_t),
        "frames_out_per_block": preset.vae.frames_out(f, first_block=False),
    }
    if vae_t:
        out.update(
            vae_block_s=statistics.median(vae_t),
            vae_block_min_s=min(vae_t),
            vae_block_max_s=max(vae_t),
            dit_vae_ratio=statistics.median(dit_t) / statistics.median(vae_t),
            vae_per_latent_frame_ms=1000 * statistics.median(vae_t) / f,
        )
    mem = peak_mem(device)
    if mem is not None:
        out["peak_mem_gib"] = mem
    return out


def price(r: dict, name: str, size: tuple[int, int], at: tuple[int, int]) -> dict:
    """The measured block priced at size `at`: the DiT by the ratio of its FLOPs a block there and
    here (the planner's own pricing across configurations), the VAE by the ratio of pixels (its
    convolutions are per pixel; the middle attention, a small share, grows faster)."""
    from streamdiff.placement.cost import model_cost

    dit = r["dit_block_s"] * model_cost(name, at).block_flops / model_cost(name, size).block_flops
    vae = r["vae_block_s"] * (at[0] * at[1]) / (size[0] * size[1])
    return {"size": f"{at[0]}x{at[1]}", "dit_block_s": dit, "vae_block_s": vae, "dit_vae_ratio": dit / vae}


def show(r: dict) -> None:
    line = (
        f"{r['preset']:>16} {r['size']:>8} {r['device']:>5} {r['dtype']:>8} threads={r['threads']} "
        f"layers={r['dit_layers']} block={r['frames_per_block']}f/{r['steps']}st: "
        f"DiT {1000 * r['dit_block_s']:.0f} ms/block"
    )
    if "vae_block_s" in r:
        line += (
            f", VAE {1000 * r['vae_block_s']:.0f} ms/block ({r['vae_per_latent_frame_ms']:.0f} ms/latent frame), "
            f"DiT/VAE {r['dit_vae_ratio']:.2f}, {r['frames_out_per_block']} frames/block"
        )
    if "peak_mem_gib" in r:
        line += f", peak {r['peak_mem_gib']:.1f} GiB"
    if "priced" in r:
        p = r["priced"]
        line += (
            f"; priced at {p['size']}: DiT {p['dit_block_s']:.1f} s, VAE {p['vae_block_s']:.1f} s a block, "
            f"DiT/VAE {p['dit_vae_ratio']:.2f}"
        )
    print(line, flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", action="append", help="tiny (default); with --random-weights, a presets.WAN_ARCHS name")
    ap.add_argument("--model", help="weights directory for real presets")
    ap.add_argument("--random-weights", action="store_true", help="real configs without checkpoints")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--size", help="WIDTHxHEIGHT (default: the preset's)")
    ap.add_argument("--frames-per-block", type=int)
    ap.add_argument("--blocks", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--dit-vae-ratio", type=float, default=0.74)
    ap.add_argument("--warm-blocks", type=int, help="blocks before timing (default: fill the attention window)")
    ap.add_argument("--layers", type=int, help="DiT layers (default: the preset's)")
    ap.add_argument("--calibrate", action="store_true", help="measure the tiny DiT's per-layer fraction")
    ap.add_argument(
        "--full-depth",
        action="store_true",
        help="time the DiT at 1 and 2 layers and give its full depth's time (t1 + (L - 1)(t2 - t1)): "
        "a 5B's 30 layers at full width are minutes a block on two CPU cores",
    )
    ap.add_argument(
        "--price",
        metavar="WxH",
        help="also price the measured block at this size: the DiT by its FLOPs a block "
        "(placement.cost.model_cost, from the configuration), the VAE by its pixels",
    )
    ap.add_argument("--json", help="append results to this JSON file")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    os.environ.setdefault("OMP_NUM_THREADS", str(a.threads))
    results = []
    for name in a.preset or ["tiny"]:
        sampler = {"frames_per_block": a.frames_per_block} if a.frames_per_block else {}
        spec = ModelSpec(preset=name, path=a.model, dtype=a.dtype, dit_vae_ratio=a.dit_vae_ratio, sampler=sampler)
        size = tuple(int(v) for v in a.size.split("x")) if a.size else None
        if size is None:
            size = (256, 144) if name == "tiny" else (832, 480)
        if a.calibrate:
            one = bench(spec, a.device, size, a.blocks, a.random_weights, layers=1)
            three = bench(spec, a.device, size, a.blocks, a.random_weights, layers=3, skip_vae=True)
            per_layer = (three["dit_block_s"] - one["dit_block_s"]) / 2
            overhead = one["dit_block_s"] - per_layer
            frac, over = per_layer / one["vae_block_s"], overhead / one["vae_block_s"]
            layers = max(1, round((a.dit_vae_ratio - over) / frac))
            print(
                f"per-layer DiT {1000 * per_layer:.1f} ms/block, rest of the DiT {1000 * overhead:.1f} ms, "
                f"VAE {1000 * one['vae_block_s']:.0f} ms/block: TINY_LAYER_FRACTION = {frac:.4f}, "
                f"TINY_DIT_OVERHEAD_FRACTION = {over:.4f} -> {layers} layers for ratio {a.dit_vae_ratio}"
            )
            continue
        if a.full_depth:
            r = bench(spec, a.device, size, a.blocks, a.random_weights, layers=1, warm_blocks=a.warm_blocks)
            two = bench(spec, a.device, size, a.blocks, a.random_weights, 2, skip_vae=True, warm_blocks=a.warm_blocks)
            depth, per_layer = r["dit_full_layers"], two["dit_block_s"] - r["dit_block_s"]
            full = r["dit_block_s"] + (depth - 1) * per_layer
            r.update(dit_layers=depth, dit_block_s=full, dit_per_layer_s=per_layer)
            r["dit_vae_ratio"] = r["dit_block_s"] / r["vae_block_s"]
        else:
            r = bench(spec, a.device, size, a.blocks, a.random_weights, layers=a.layers, warm_blocks=a.warm_blocks)
        if a.price:
            r["priced"] = price(r, name, size, tuple(int(v) for v in a.price.split("x")))
        show(r)
        results.append(r)
    if a.json and results:
        p = Path(a.json)
        old = json.loads(p.read_text()) if p.exists() else []
        p.write_text(json.dumps(old + results, indent=1))


if __name__ == "__main__":
    main()
