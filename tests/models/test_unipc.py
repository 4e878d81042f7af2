"""The UniPC block solver (models/wan/unipc.py) against diffusers' `UniPCMultistepScheduler` with
LongLive 2.0's settings, and its schedule against the authors' timesteps (the note's figures)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from streamdiff.models.wan.unipc import FlowUniPC, flow_sigmas

diffusers = pytest.importorskip("diffusers")

# LongLive 2.0 (../shared/notes/wan22.md, section 3): 4 steps, shift 5, order 2, final sigma 0;
# the timesteps its FlowUniPCMultistepScheduler gives at these settings.
AUTHORS_TIMESTEPS = [999.80, 937.27, 833.06, 624.69]


def diffusers_unipc(steps: int, shift: float, order: int = 2):
    """diffusers' solver configured as the authors' (flow sigmas, x0 prediction, bh2, the last
    step at order 1), given the authors' unshifted sigmas to shift."""
    s = diffusers.UniPCMultistepScheduler(
        num_train_timesteps=1000,
        solver_order=order,
        prediction_type="flow_prediction",
        use_flow_sigmas=True,
        flow_shift=shift,
        predict_x0=True,
        solver_type="bh2",
        lower_order_final=True,
        final_sigmas_type="zero",
    )
    top = 1 - 1 / 1000
    s.set_timesteps(sigmas=np.array([top * (1 - k / steps) for k in range(steps)]))
    return s


def test_the_schedule_is_the_authors():
    sig = flow_sigmas(4, 5.0)
    assert FlowUniPC(sig).timesteps == pytest.approx(AUTHORS_TIMESTEPS, abs=0.01)
    ref = diffusers_unipc(4, 5.0)
    assert sig == pytest.approx(ref.sigmas.tolist(), abs=1e-6) and sig[-1] == 0.0


def flow_model(x: torch.Tensor, t: float, w: torch.Tensor) -> torch.Tensor:
    """A stand-in for the DiT: a fixed nonlinear flow of the sample and the timestep, so that
    every step's prediction differs and each of the solver's terms counts."""
    return torch.tanh(torch.einsum("ij,bjf->bif", w, x) * (0.5 + t / 1000)) + 0.1 * x


@pytest.mark.parametrize(("steps", "shift", "order"), [(4, 5.0, 2), (3, 5.0, 2), (6, 3.0, 2), (4, 5.0, 1), (1, 5.0, 2)])
def test_each_step_equals_diffusers(steps, shift, order):
    g = torch.Generator().manual_seed(steps)
    w = torch.randn(8, 8, generator=g, dtype=torch.float64) / 3
    noise = torch.randn(2, 8, 5, generator=g, dtype=torch.float64)
    ours, ref = FlowUniPC(flow_sigmas(steps, shift), order=order), diffusers_unipc(steps, shift, order)
    x = y = noise
    for i, t in enumerate(ref.timesteps):
        # diffusers hands the model its timestep as an integer (999 for 999.80); the authors'
        # solver, and ours, the float. The solver's arithmetic runs on the sigmas either way.
        t_float = 1000 * float(ref.sigmas[i])
        assert ours.timesteps[i] == pytest.approx(t_float, rel=1e-6) and int(t) == int(t_float)
        x = ours.step(flow_model(x, ours.timesteps[i], w), x)
        y = ref.step(flow_model(y, t_float, w), t, y).prev_sample
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-5)
    assert ours.done
    with pytest.raises(RuntimeError):
        ours.step(torch.zeros_like(x), x)


def test_a_flow_that_is_exactly_right_lands_on_its_x0():
    """A model whose flow is exact (v = noise - x0) is followed to x0 whatever the steps."""
    g = torch.Generator().manual_seed(0)
    x0, noise = torch.randn(1, 4, 3, generator=g), torch.randn(1, 4, 3, generator=g)
    solver = FlowUniPC(flow_sigmas(4, 5.0))
    x = (1 - solver.sigmas[0]) * x0 + solver.sigmas[0] * noise
    while not solver.done:
        x = solver.step(noise - x0, x)
    torch.testing.assert_close(x, x0)


@pytest.mark.parametrize("sigmas", [[0.9, 0.5], [1.0, 0.5, 0.0], [0.5, 0.7, 0.0], [0.9, 0.9, 0.0], [0.5]])
def test_a_schedule_it_cannot_follow_is_refused(sigmas):
    with pytest.raises(ValueError, match="sigma"):
        FlowUniPC(sigmas)


# ----------------------------------------------------------------------------- the sampler kind

UNIPC = {"kind": "unipc", "steps": [1000, 937, 833, 625], "shift": 5.0}


def test_a_unipc_step_list_is_its_solvers_timesteps():
    from streamdiff.models.wan.sampler import SamplerConfig, unipc_timesteps

    assert unipc_timesteps((1000, 937, 833, 625), 5.0) == pytest.approx(AUTHORS_TIMESTEPS, abs=0.01)
    SamplerConfig(kind="unipc", steps=(1000, 937, 833, 625)).validate()
    with pytest.raises(ValueError, match=r"\[1000, 937, 833, 625\] for 4 steps, got \[1000, 750, 500, 250\]"):
        SamplerConfig(kind="unipc").validate()


def test_an_engine_block_is_diffusers_unipc_on_the_dit_then_the_clean_pass():
    """A block of the engine under `kind = "unipc"` equals diffusers' solver driving the same DiT
    from the same noise (a fresh solver per block, no noise after the first), the clean pass at
    t = 0 committing it; then the next block, at its own positions, likewise. Two sessions in
    one batch equal each alone."""
    from streamdiff.models.engines import DiTEngine
    from streamdiff.models.spec import ModelSpec

    eng = DiTEngine(ModelSpec(preset="tiny-random", sampler=UNIPC))
    ref = DiTEngine(ModelSpec(preset="tiny-random"))  # the same seeded weights: the reference's DiT
    w, h = 128, 64
    a, b, r = (e.open_session(w, h, seed=5) for e in (eng, eng, ref))
    for e, s in ((eng, a), (eng, b), (ref, r)):
        e.set_scene(s, "a red fox", new_shot=True)
    got = [eng.generate_block(a, 3) for _ in range(2)]
    other = eng.open_session(w, h, seed=6)
    eng.set_scene(other, "a blue ball", new_shot=True)
    pair = eng.generate_blocks([b, other], 3)  # b's first block, batched
    torch.testing.assert_close(pair[0], got[0], rtol=1e-5, atol=1e-5)
    gen = torch.Generator().manual_seed(5)
    for block in got:
        noise = torch.randn((1, 3, 16, *r.latent_hw), generator=gen).permute(0, 2, 1, 3, 4)
        sched, x = diffusers_unipc(4, 5.0), noise
        for i, t in enumerate(sched.timesteps):
            t_float = 1000 * float(sched.sigmas[i])
            v = ref.model.forward_block(x, torch.full((1, 3), t_float), r.state, False)
            x = sched.step(v, t, x).prev_sample
        ref.model.forward_block(x, torch.zeros(1, 3), r.state, True)
        torch.testing.assert_close(block, x, rtol=1e-4, atol=1e-4)


def test_a_held_first_frame_is_longlive2s_image_to_video_first_block():
    """LongLive 2.0's image-to-video first chunk (pipeline/causal_diffusion_inference.py, the
    `first_i2v_block` steps; utils/i2v_conditioning.py), transcribed: before each solver step the
    block's first latent frame is the image's and its timestep 0; after the step it is the image's
    again; the clean pass commits the block with it. The next block, from that cache, agrees too."""
    from streamdiff.models.engines import DiTEngine
    from streamdiff.models.spec import ModelSpec
    from streamdiff.models.wan.sampler import denoise_block, unipc_timesteps

    eng = DiTEngine(ModelSpec(preset="tiny-random", sampler=UNIPC))
    model, (w, h) = eng.model, (128, 64)
    ours, ref = (eng.open_session(w, h, seed=1) for _ in range(2))
    for s in (ours, ref):
        eng.set_scene(s, "a red fox", new_shot=True)
    g = torch.Generator().manual_seed(2)
    noise, image = torch.randn(1, 16, 3, 8, 16, generator=g), torch.randn(1, 16, 1, 8, 16, generator=g)
    ts = unipc_timesteps(UNIPC["steps"], UNIPC["shift"])
    got = denoise_block(model, ours.state, noise, ts, [], unipc=True, hold=image)

    solver, x = FlowUniPC([t / 1000.0 for t in ts] + [0.0]), noise.clone()
    for t in ts:
        x[:, :, :1] = image
        timestep = torch.full((1, 3), t)
        timestep[:, 0] = 0
        x = solver.step(model.forward_block(x, timestep, ref.state, False), x)
        x[:, :, :1] = image
    model.forward_block(x, torch.zeros(1, 3), ref.state, True)
    torch.testing.assert_close(got, x, rtol=0, atol=0)
    assert torch.equal(got[:, :, :1], image)
    after = [denoise_block(model, s.state, noise, ts, [], unipc=True) for s in (ours, ref)]
    torch.testing.assert_close(after[0], after[1], rtol=0, atol=0)
    with pytest.raises(ValueError, match="UniPC"):
        denoise_block(model, ours.state, noise, [1000.0, 500.0], [noise], hold=image)
