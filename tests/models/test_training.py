"""Training the embedded default (streamdiff/train, tools/train/default.py): the paths training
backpropagates through compute what inference computes, the encoder is causal and shaped for the
decoder, and a run writes its curve, checkpoints and resumes where it stopped."""

from __future__ import annotations

import json

import pytest
import torch

from streamdiff.models.wan.dit import DiTConfig, WanDiT
from streamdiff.models.wan.vae import VAEConfig, WanVAEDecoder, decode_clip
from streamdiff.models.wan.vae_encoder import WanVAEEncoder

VAE = VAEConfig(base_dim=4, num_res_blocks=0)


def test_the_training_decode_is_the_inference_decode_and_backpropagates():
    torch.manual_seed(0)
    vae = WanVAEDecoder(VAE)
    z = torch.randn(1, 16, 3, 4, 6)
    with torch.no_grad():
        ref = vae.decode(z, vae.new_state())
    y = decode_clip(vae, z)
    assert y.shape == ref.shape == (1, 3, 9, 32, 48)
    assert (y.clamp(-1, 1) - ref).abs().max().item() < 1e-5
    y.square().mean().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in vae.parameters())


def test_the_encoder_is_causal_and_gives_the_decoders_latent_shape():
    torch.manual_seed(0)
    enc = WanVAEEncoder(VAE)
    x = torch.randn(1, 3, 9, 32, 48)
    mu, logvar = enc(x)
    assert mu.shape == logvar.shape == (1, 16, 3, 4, 6)  # 1 + 4k frames -> 1 + k latent frames
    later = x.clone()
    later[:, :, 5:] += 1.0  # frames of the last latent frame only
    mu2, _ = enc(later)
    assert torch.equal(mu2[:, :, :2], mu[:, :, :2]) and not torch.equal(mu2[:, :, 2], mu[:, :, 2])


def test_a_long_clip_chunk_by_chunk_is_the_whole_clip():
    """Truncated backpropagation through time: encoder and decoder carry their causal caches
    across chunks (the first 1 + 4k frames, then 4k each), and the chunks' latents and frames
    equal the whole clip's, so training on chunks trains what a streamed video computes."""
    torch.manual_seed(0)
    enc, dec = WanVAEEncoder(VAE), WanVAEDecoder(VAE)
    x = torch.randn(1, 3, 1 + 4 * 7, 32, 48)
    with torch.no_grad():
        mu = enc(x)[0]
        ref = decode_clip(dec, mu)
        state, enc_state, mus, ys = dec.new_state(), enc.new_state(), [], []
        for f0, f1 in ((0, 9), (9, 17), (17, 29)):  # 3 + 2 + 3 latent frames
            mus.append(enc(x[:, :, f0:f1], enc_state)[0])
            ys.append(decode_clip(dec, mus[-1], state))
    assert (torch.cat(mus, 2) - mu).abs().max().item() < 1e-5
    assert (torch.cat(ys, 2) - ref).abs().max().item() < 1e-5 and ref.shape[2] == 29
    # the daemon's image-to-video and video encodes are the same encoder: its first latent
    # frame is the image's, and a video chunk by chunk (1, then 4 frames) is the whole clip's
    norm = (mu - enc.mean) / enc.std
    image = enc.encode_image(x[:, :, :1])
    assert (image - norm[:, :, :1]).abs().max().item() < 1e-5
    live = enc.new_state()
    chunks = [enc.encode_chunk(x[:, :, :1], live)] + [enc.encode_chunk(x[:, :, f : f + 4], live) for f in (1, 5)]
    assert (torch.cat(chunks, 2) - norm[:, :, :3]).abs().max().item() < 1e-5
    with pytest.raises(ValueError, match="1 \\+ 4k"):
        enc(x[:, :, :4])
    with pytest.raises(ValueError, match="4k"):
        enc(x[:, :, 1:4], enc_state)


def test_a_run_from_before_the_encoder_was_the_daemons_resumes(tmp_path):
    """Runs saved their encoder under the training module's own names (`quant` for the
    release's `conv1`, no `encoder.` prefix, the conv after the ResBlock's norm at index 5, the
    downsampler's conv bare): such a checkpoint loads into the daemon's encoder, same numbers."""
    import re

    from streamdiff.train.vae import encoder

    torch.manual_seed(1)
    enc = encoder(VAE)
    old = {}
    for k, v in enc.state_dict().items():
        k = re.sub(r"\.resample\.1\.", ".resample.", k.replace(".residual.6.", ".residual.5."))
        old[k.replace("encoder.", "", 1) if k.startswith("encoder.") else k.replace("conv1.", "quant.", 1)] = v
    assert "quant.weight" in old and "conv1.weight" in old and not any(k.startswith("encoder.") for k in old)
    fresh = encoder(VAE)
    fresh.load_state_dict(old)
    x = torch.randn(1, 3, 5, 32, 48)
    with torch.no_grad():
        assert torch.equal(fresh(x)[0], enc(x)[0])


def test_the_dit_under_autograd_streams_the_same_blocks_as_inference():
    """Under autograd the KV cache replaces its buffers instead of writing into them, so the
    graph keeps every block's keys; the numbers are those of the in-place inference path."""
    cfg = DiTConfig(dim=24, ffn_dim=48, freq_dim=16, num_heads=2, num_layers=2, text_dim=8, text_len=5)
    torch.manual_seed(0)
    model = WanDiT(cfg)
    ctx = torch.randn(1, 5, 8)
    blocks = [torch.randn(1, 16, 2, 4, 6) for _ in range(3)]

    def stream(grad: bool):
        with torch.set_grad_enabled(grad):
            st = model.new_state(4, 6, window_frames=6)
            st.cross = [blk.cross_attn.project_context(model.text_embedding(ctx)) for blk in model.blocks]
            outs = []
            for x in blocks:
                outs.append(model._forward(x, torch.full((1, 2), 600.0), [st], commit=False))
                model._forward(x, torch.zeros(1, 2), [st], commit=True)
            return outs

    ref, got = stream(False), stream(True)
    for a, b in zip(got, ref, strict=True):
        assert (a.detach() - b).abs().max().item() < 1e-5
    torch.stack(got).square().mean().backward()
    assert model.blocks[0].self_attn.k.weight.grad.abs().sum() > 0  # through the cached keys too


def test_a_training_run_logs_checkpoints_and_resumes(tmp_path):
    from dataclasses import replace

    from streamdiff.models.wan.sampler import SamplerConfig
    from streamdiff.synthetic import Caption
    from streamdiff.train.dit import DiTRun, encode_dataset, train_dit
    from streamdiff.train.vae import VAERun, train_vae

    run = VAERun(steps=2, batch=1, frames=9, chunk=1, crop=(64, 48), log_every=1, save_every=1)
    train_vae(tmp_path, VAE, run, log=lambda s: None)
    train_vae(tmp_path, VAE, VAERun(**{**run.__dict__, "steps": 3}), log=lambda s: None)  # resumes at 2
    curve = [json.loads(line) for line in (tmp_path / "vae_curve.jsonl").read_text().splitlines()]
    assert [r["step"] for r in curve] == [1, 2, 3] and all(r["rec_l1"] > 0 for r in curve)
    sampler = SamplerConfig(frames_per_block=1, window_frames=5, sink_frames=1, canvas=True)  # trained_sampler's
    dit_run = DiTRun(steps=2, batch=2, blocks=2, clips=3, log_every=1, save_every=1, switch=1.0, first_only=0.0)
    encode_dataset(tmp_path, VAE, sampler, dit_run, log=lambda s: None)
    data = torch.load(tmp_path / "latents.pt", weights_only=False)
    assert data["latents"].shape == (3, 16, 2, 18, 32) and len(data["prompts"]) == 3
    assert data["masks"].shape == (3, 2, 18, 32) and 0 < data["masks"].float().mean() < 0.25
    # Each block's prompt: every clip steered here (switch 1.0), its object's colour only.
    steers = [[Caption.parse(p) for p in ps] for ps in data["prompts"]]
    assert all(len(c) == 2 and c[0].colour != c[1].colour and replace(c[1], colour=c[0].colour) == c[0] for c in steers)
    cfg = DiTConfig(dim=24, ffn_dim=48, freq_dim=16, num_heads=2, num_layers=1, text_dim=8, text_len=64)
    train_dit(tmp_path, cfg, sampler, dit_run, text_seed=1, log=lambda s: None)
    rows = [json.loads(line) for line in (tmp_path / "dit_curve.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and len(rows[0]["per_block"]) == 2
    assert torch.load(tmp_path / "dit.pt", weights_only=True)["step"] == 2
    train_dit(tmp_path, cfg, sampler, replace(dit_run, steps=3, batch=1, first_only=1.0), 1, log=lambda s: None)
    rows = [json.loads(line) for line in (tmp_path / "dit_curve.jsonl").read_text().splitlines()]
    assert rows[-1]["step"] == 3 and "first_alone" in rows[-1] and "loss" not in rows[-1]  # the first block alone
    from streamdiff.train.evaluate import evaluate, reconstruct

    rec = reconstruct(tmp_path, VAE, n=2, frames=9, latents_per_block=1, log=lambda s: None)
    assert rec["step"] == 3 and (tmp_path / "recon_3.json").exists() and (tmp_path / "recon_3.png").exists()
    assert 0.0 <= rec["colour"] <= 1.0 and rec["psnr_db"] > 0
    got = evaluate(tmp_path, cfg, VAE, sampler, text_seed=1, n=2, blocks=2, log=lambda s: None)
    report = json.loads((tmp_path / "eval_3.json").read_text())
    assert got["prompts"] == 2 and len(report["videos"]) == 2 and (tmp_path / "sheet_3.png").exists()


def test_the_loss_weights_the_drawn_object_and_a_band_around_its_outline():
    """The object's mask is its drawn pixels (a ball's, not its box), and the edge band is the
    pixels within `px` of the outline on either side: where the first attempt blurred."""
    import random

    import numpy as np

    from streamdiff.synthetic import COLOURS
    from streamdiff.train.vae import VAERun, batch_of, edge_mask

    x, mask = batch_of(VAERun(batch=1, frames=5, crop=(256, 144)), random.Random(3), 256, 144)
    pixels = ((x[0].permute(1, 2, 3, 0) + 1) * 127.5).round().to(torch.uint8).numpy()  # (T, h, w, 3)
    colours = {tuple(int(v) for v in p) for p in pixels[mask[0, 0].numpy() > 0]}
    assert len(colours) == 1 and colours.pop() in COLOURS.values()
    assert mask.sum() > 0 and (~(mask[0, 0].numpy() > 0)).any()
    square = torch.zeros(1, 1, 1, 12, 12)
    square[..., 3:9, 3:9] = 1.0  # 6x6
    band = edge_mask(square, 1)
    assert band.sum().item() == 8 * 8 - 4 * 4  # dilated to 8x8, eroded to 4x4
    assert band[..., 5, 5].item() == 0 and band[..., 3, 3].item() == 1 and band[..., 2, 5].item() == 1
    assert np.array_equal(edge_mask(torch.zeros(1, 1, 2, 5, 5)).numpy(), np.zeros((1, 1, 2, 5, 5)))


def test_a_killed_run_resumes_its_schedule_and_keeps_milestones(tmp_path):
    """Killed after a checkpoint, a run resumes on the learning rate it would have had; resumed
    with another recipe it starts a new phase (its warmup) at that step. Milestone copies are
    kept every keep_every steps, and each resumes a run."""
    from streamdiff.train.vae import VAERun, train_vae

    run = VAERun(steps=4, batch=1, frames=5, chunk=1, crop=(32, 32), lr=1e-3, log_every=1, save_every=1)
    train_vae(tmp_path / "whole", VAE, run, log=lambda s: None)

    class Killed(Exception):
        pass

    def kill_at_3(line):
        if line.startswith("vae step 3:"):
            raise Killed  # step 3 logged, not saved: the checkpoint holds step 2

    killed = VAERun(**{**run.__dict__, "keep_every": 2})
    try:
        train_vae(tmp_path / "killed", VAE, killed, log=kill_at_3)
    except Killed:
        pass
    assert torch.load(tmp_path / "killed" / "vae_step2.pt", weights_only=True)["step"] == 2
    train_vae(tmp_path / "killed", VAE, killed, log=lambda s: None)

    def lrs(d):
        return {r["step"]: r["lr"] for r in map(json.loads, (d / "vae_curve.jsonl").read_text().splitlines())}

    whole, resumed = lrs(tmp_path / "whole"), lrs(tmp_path / "killed")
    assert [resumed[s] for s in (1, 2, 3, 4)] == [whole[s] for s in (1, 2, 3, 4)]
    # Another recipe (one step per clip on a random chunk, another lr) starts a new phase.
    other = VAERun(**{**run.__dict__, "steps": 6, "lr": 2e-3, "one_chunk": True})
    train_vae(tmp_path / "killed", VAE, other, log=lambda s: None)
    assert lrs(tmp_path / "killed")[5] == 2e-3 / 100  # the first step of its warmup
    assert torch.load(tmp_path / "killed" / "vae.pt", weights_only=True)["meta"]["phase_start"] == 4


def test_the_dit_never_trains_on_the_held_out_prompts_weights_the_object_and_learns_steers():
    import random

    from streamdiff.synthetic import COLOURS, Caption, check, clip, held_out_prompts
    from streamdiff.train.dit import latent_mask, recolour

    held = held_out_prompts()
    assert len({c.prompt for c in held}) == len(held) == 48
    c = clip(Caption("red", "square", "right", "blue"), frames=9, rng=random.Random(1))
    m = latent_mask(c.frames, COLOURS["red"])
    assert m.shape == (3, 18, 32)
    for j, f in enumerate((0, 4, 8)):  # each latent frame's last pixel frame: its box is inside
        x0, y0, x1, y1 = c.boxes[f]
        assert m[j, y0 // 8, x0 // 8] == 1 and m[j, (y1 - 1) // 8, (x1 - 1) // 8] == 1
    assert m.mean() < 0.2
    steered = recolour(c.frames, 5, "red", "yellow")  # a steer at frame 5: the object is yellow from there
    assert (check(steered[:5]).colour, check(steered[5:]).colour) == ("red", "yellow")
    assert (steered[:5] == c.frames[:5]).all() and check(steered[5:]).background == "blue"


def test_a_frozen_encoder_keeps_the_latents_the_dit_learns(tmp_path):
    """Resumed with the encoder frozen, a run trains the decoder alone: the encoder's weights (so
    the DiT's encoded data set) stay as they were, the decoder's move."""
    from streamdiff.train.vae import VAERun, train_vae

    run = VAERun(steps=1, batch=1, frames=5, chunk=1, crop=(32, 32), lr=1e-3, log_every=1, save_every=1)
    train_vae(tmp_path, VAE, run, log=lambda s: None)
    before = torch.load(tmp_path / "vae.pt", weights_only=True)
    train_vae(tmp_path, VAE, VAERun(**{**run.__dict__, "steps": 3, "freeze_encoder": True}), log=lambda s: None)
    after = torch.load(tmp_path / "vae.pt", weights_only=True)
    assert after["step"] == 3
    for k, v in before["encoder"].items():
        assert torch.equal(v, after["encoder"][k]), k
    assert any(not torch.equal(v, after["decoder"][k]) for k, v in before["decoder"].items())


def test_the_embedded_preset_loads_shipped_weights_and_tiny_random_never_does(tmp_path):
    from streamdiff.models.presets import build_vae, embedded_weights, load_embedded_vae
    from streamdiff.models.spec import ModelSpec
    from streamdiff.models.wan.loading import CheckpointError
    from streamdiff.train.vae import VAERun, export_vae, load_vae, train_vae

    train_vae(tmp_path, VAE, VAERun(steps=1, batch=1, frames=5, crop=(32, 32)), log=lambda s: None)
    dest = export_vae(tmp_path, VAE, tmp_path / "weights" / "tiny-vae.safetensors")
    assert embedded_weights("tiny", "vae", tmp_path / "weights") == dest
    assert embedded_weights("tiny-random", "vae", tmp_path / "weights") is None
    model = WanVAEDecoder(VAE)
    load_embedded_vae(model, dest)
    _, trained, _ = load_vae(tmp_path, VAE)
    z = torch.randn(1, 16, 2, 4, 6)
    got, want = model.decode(z, model.new_state()), trained.decode(z, trained.new_state())
    assert (got - want).abs().max().item() < 1e-5  # the same weights; safetensors keeps no layout
    wrong = WanVAEDecoder(VAEConfig(base_dim=8, num_res_blocks=0))
    try:
        load_embedded_vae(wrong, dest)
        raise AssertionError("weights of another width loaded")
    except CheckpointError as exc:
        assert "tiny-vae.safetensors" in str(exc)
    seeded, _ = build_vae(ModelSpec(preset="tiny-random"))
    default, _ = build_vae(ModelSpec())
    same = all(torch.equal(a, b) for a, b in zip(seeded.state_dict().values(), default.state_dict().values()))
    assert same == (embedded_weights("tiny", "vae") is None)  # tiny differs once trained weights ship


def test_the_trained_dit_ships_with_its_configuration_and_loads_whole(tmp_path):
    """Exported, the DiT and text encoder load into the configuration the file's metadata names,
    and compute what the training checkpoint computes; a file of another configuration, or one that
    is not a trained DiT, is refused with the file named."""
    import pytest

    from streamdiff.models.presets import load_trained_part, trained_dit
    from streamdiff.models.wan.loading import CheckpointError
    from streamdiff.models.wan.text import TinyTextEncoder
    from streamdiff.train import save
    from streamdiff.train.dit import TEXT_LAYERS, export_dit, text_encoder

    cfg = DiTConfig(dim=24, ffn_dim=48, freq_dim=16, num_heads=2, num_layers=1, text_dim=8, text_len=64)
    torch.manual_seed(0)
    dit, text = WanDiT(cfg), text_encoder(cfg, 3)
    with torch.no_grad():
        text.embed.add_(1.0)  # not the seeded weights
        for layer in text.layers:
            layer.fc2.normal_()  # nor the identity the added layers start as
    save(tmp_path / "dit.pt", {"dit": dit, "text": text}, torch.optim.SGD(dit.parameters(), lr=0.1), 7)
    weights = tmp_path / "weights"
    sampler = {"shift": 1.0, "canvas": True, "sink_frames": 1, "window_frames": 13}  # trained_sampler's
    export_dit(tmp_path, cfg, sampler, 3, weights / "tiny-dit.safetensors")
    got = trained_dit("tiny", weights)
    assert got.config == cfg and got.sampler == sampler and got.text_layers == TEXT_LAYERS > 1
    assert trained_dit("tiny-random", weights) is None
    dit2, text2 = WanDiT(cfg), TinyTextEncoder(8, 64, seed=99, layers=got.text_layers)
    load_trained_part(dit2, got.path, "dit")
    load_trained_part(text2, got.path, "text")
    assert all(torch.equal(a, b) for a, b in zip(dit.state_dict().values(), dit2.state_dict().values(), strict=True))
    prompt = ["a red ball moving left on a blue background"]
    assert torch.equal(text.encode(prompt), text2.encode(prompt))
    with pytest.raises(CheckpointError, match="tiny-dit.safetensors"):
        load_trained_part(WanDiT(DiTConfig(**{**cfg.__dict__, "dim": 32})), got.path, "dit")
    bad = tmp_path / "bad" / "tiny-dit.safetensors"
    bad.parent.mkdir()
    bad.write_bytes(b"not a safetensors file")
    with pytest.raises(CheckpointError, match="not the embedded default's trained DiT"):
        trained_dit("tiny", bad.parent)


def test_added_text_layers_start_as_the_identity():
    """The trained default's deeper text encoder starts as the seeded one-layer encoder (its added
    layers' output projections are zero): its keys, and its embeddings to the layer norm's eps."""
    from streamdiff.models.wan.text import TinyTextEncoder

    one, three = TinyTextEncoder(16, 32, seed=5), TinyTextEncoder(16, 32, seed=5, layers=3)
    prompts = ["a red ball moving left on a blue background", "anything else"]
    assert (one.encode(prompts) - three.encode(prompts)).abs().max() < 1e-4
    assert list(one.state_dict()) == ["embed", "qkv", "out"] and len(three.state_dict()) == 3 + 2 * 4
