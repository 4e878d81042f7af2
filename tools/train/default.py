#!/usr/bin/env python3
"""Train the embedded default on the synthetic grammar (issue 13), on this CPU.

  tools/train/default.py vae --out train/ --steps 3000      # the VAE: encoder + the decoder that ships
  tools/train/default.py vae --frames 61 --chunk 4 --crop 128x96 --batch 2 --lr 1e-3 --steps 12000 --keep-every 2000
                                                            # long clips chunk by chunk from the start (issue 36)
  tools/train/default.py dit --out train/ --steps 4000      # then the DiT and the text encoder
  tools/train/default.py recon --out train/ --clips 24      # the checker on clips through the VAE alone
  tools/train/default.py eval --out train/ --prompts 50     # the checker on held-out prompts, a contact sheet
  tools/train/default.py plot --out train/ --png curves.png # the training curves
  tools/train/default.py export --out train/                # the decoder, DiT and text encoder into
                                                            # streamdiff/models/weights/ (the default)

Every stage resumes from its checkpoint in --out and appends its curve to <stage>_curve.jsonl.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def plot(out: Path, png: Path) -> int:
    import json

    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed (pip install matplotlib): no plot", file=sys.stderr)
        return 1

    def rows(name: str) -> list[dict]:
        f = out / f"{name}_curve.jsonl"
        seen: dict[int, dict] = {}
        for line in f.read_text().splitlines() if f.exists() else []:
            r = json.loads(line)
            seen[r["step"]] = r  # a resumed run logs its last steps again: the later wins
        return [seen[k] for k in sorted(seen)]

    vae, dit = rows("vae"), rows("dit")
    fig, axes = plt.subplots(1, 2 if dit else 1, figsize=(11 if dit else 6, 4), squeeze=False)
    axes = axes[0]
    if vae:
        ax = axes[0]
        ax.plot([r["step"] for r in vae], [r["psnr_db"] for r in vae], label="PSNR (dB, training clips)")
        ax2 = ax.twinx()
        ax2.plot([r["step"] for r in vae], [r["object_l1"] for r in vae], color="tab:red", label="object L1")
        ax.set_xlabel("VAE step")
        ax.set_ylabel("PSNR dB")
        ax2.set_ylabel("object L1 (of 2)")
        ax.set_title("VAE")
    if dit:
        full = [r for r in dit if "loss" in r]  # rows of first-block-alone steps only have no loss
        axes[1].plot([r["step"] for r in full], [r["loss"] for r in full])
        axes[1].set_xlabel("DiT step")
        axes[1].set_ylabel("flow-matching loss")
        axes[1].set_title("DiT")
    fig.tight_layout()
    fig.savefig(png, dpi=90)
    print(f"wrote {png}")
    return 0


def ran_canvas(out: Path) -> bool:
    """Whether the DiT run in `out` trained with the position canvas (runs before it had none)."""
    import json

    f = out / "dit_run.json"
    return f.exists() and json.loads(f.read_text()).get("canvas", False)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="stage", required=True)
    v = sub.add_parser("vae", help="train the VAE")
    v.add_argument("--out", default="train")
    v.add_argument("--steps", type=int, default=3000)
    v.add_argument("--batch", type=int, default=4)
    v.add_argument("--frames", type=int, default=9, help="frames per clip, 1 + 4k")
    v.add_argument("--crop", default="64x48", help="WxH of the crop around the object, multiples of 16")
    v.add_argument("--chunk", type=int, default=0, help="latent frames per chunk of a long clip (0: whole clips)")
    v.add_argument(
        "--one-chunk", action="store_true", help="one step per clip, on a random chunk (fresh clips each step)"
    )
    v.add_argument("--lr", type=float, default=2e-3, help="peak learning rate of this run's cosine schedule")
    v.add_argument("--object-weight", type=float, default=8.0, help="loss weight of the object's pixels")
    v.add_argument("--edge-weight", type=float, default=8.0, help="added weight on the band around its outline")
    v.add_argument("--save-seconds", type=float, default=600.0, help="save a resumable checkpoint this often")
    v.add_argument("--keep-every", type=int, default=0, help="keep vae_stepN.pt every N steps (milestones)")
    v.add_argument("--edge-px", type=int, default=1, help="pixels either side of the outline in its band")
    v.add_argument(
        "--freeze-encoder", action="store_true", help="train the decoder alone (the DiT's latents stay as encoded)"
    )
    v.add_argument("--threads", type=int, default=2)
    d = sub.add_parser("dit", help="encode clips with the trained VAE, then train the DiT and text encoder")
    d.add_argument("--out", default="train")
    d.add_argument("--steps", type=int, default=4000)
    d.add_argument("--batch", type=int, default=4)
    d.add_argument("--clips", type=int, default=768)
    d.add_argument("--blocks", type=int, default=3, help="blocks per training clip")
    d.add_argument("--lr", type=float, default=5e-4)
    d.add_argument("--object-weight", type=float, default=8.0, help="loss weight of the object's latent pixels")
    d.add_argument("--spread", type=float, default=0.1, help="how far clips stray from their prompt's own start (0-1)")
    d.add_argument("--first-only", type=float, default=0.5, help="share of steps training the first block alone")
    d.add_argument("--no-canvas", action="store_true", help="no position canvas before the first block")
    d.add_argument("--threads", type=int, default=2)
    r = sub.add_parser("recon", help="the checker on held-out clips through the VAE alone")
    r.add_argument("--out", default="train")
    r.add_argument("--clips", type=int, default=24)
    r.add_argument("--frames", type=int, default=61, help="frames per clip, 1 + 4k")
    r.add_argument("--threads", type=int, default=2)
    e = sub.add_parser("eval", help="generate held-out prompts from the checkpoints and check them")
    e.add_argument("--out", default="train")
    e.add_argument("--prompts", type=int, default=24, help="held-out prompts to judge (at most 48)")
    e.add_argument("--threads", type=int, default=2)
    x = sub.add_parser("export", help="write the run's decoder as the embedded default's shipped weights")
    x.add_argument("--out", default="train")
    x.add_argument("--to", default="streamdiff/models/weights", help="the folder of the package's weights")
    x.add_argument("--threads", type=int, default=2)
    pl = sub.add_parser("plot", help="plot the curves of a run")
    pl.add_argument("--out", default="train")
    pl.add_argument("--png", default="train/curves.png")
    a = ap.parse_args()
    if a.stage == "plot":
        return plot(Path(a.out), Path(a.png))
    import torch

    from streamdiff.models.presets import get_preset
    from streamdiff.models.spec import ModelSpec
    from streamdiff.train.vae import VAERun, train_vae

    torch.set_num_threads(a.threads)
    TEXT_SEED = ModelSpec().seed + 2  # noqa: N806
    from streamdiff.train.dit import DiTRun, encode_dataset, train_dit
    from streamdiff.train.evaluate import evaluate, reconstruct, trained_dit_config, trained_sampler

    log = lambda s: print(s, flush=True)  # noqa: E731
    preset = get_preset(ModelSpec(preset="tiny-random"))  # the seeded architecture, whatever has shipped
    cfg = preset.vae
    if a.stage == "vae":
        crop = tuple(int(v) for v in a.crop.split("x"))
        run = VAERun(
            steps=a.steps,
            batch=a.batch,
            frames=a.frames,
            crop=crop,
            chunk=a.chunk,
            one_chunk=a.one_chunk,
            lr=a.lr,
            object_weight=a.object_weight,
            edge_weight=a.edge_weight,
            edge_px=a.edge_px,
            freeze_encoder=a.freeze_encoder,
            save_seconds=a.save_seconds,
            keep_every=a.keep_every,
        )
        train_vae(Path(a.out), cfg, run, log=log)
    elif a.stage == "dit":
        run = DiTRun(
            steps=a.steps,
            batch=a.batch,
            clips=a.clips,
            blocks=a.blocks,
            lr=a.lr,
            object_weight=a.object_weight,
            spread=a.spread,
            first_only=a.first_only,
            canvas=not a.no_canvas,
        )
        sampler = trained_sampler(preset.sampler, run.canvas)
        encode_dataset(Path(a.out), cfg, sampler, run, log=log)
        train_dit(Path(a.out), trained_dit_config(preset.dit), sampler, run, text_seed=TEXT_SEED, log=log)
    elif a.stage == "export":
        from dataclasses import asdict

        from streamdiff.train.dit import export_dit
        from streamdiff.train.vae import export_vae

        to = Path(a.to)
        log(f"wrote {export_vae(Path(a.out), cfg, to / 'tiny-vae.safetensors')}")
        if (Path(a.out) / "dit.pt").exists():
            base, trained = asdict(preset.sampler), asdict(trained_sampler(preset.sampler, ran_canvas(Path(a.out))))
            sampler = {k: v for k, v in trained.items() if v != base[k]}
            dit_cfg = trained_dit_config(preset.dit)
            log(f"wrote {export_dit(Path(a.out), dit_cfg, sampler, TEXT_SEED, to / 'tiny-dit.safetensors')}")
    elif a.stage == "recon":
        reconstruct(Path(a.out), cfg, a.clips, a.frames, preset.sampler.frames_per_block, log=log)
    else:
        sampler = trained_sampler(preset.sampler, ran_canvas(Path(a.out)))
        evaluate(Path(a.out), trained_dit_config(preset.dit), cfg, sampler, TEXT_SEED, a.prompts, log=log)
    return 0


if __name__ == "__main__":
    sys.exit(main())
