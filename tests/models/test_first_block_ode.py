"""SamplerConfig.first_block_ode: a shot's first block follows the flow ODE (the trained tiny
default's sampler, issue 36). Judged against diffusers' FlowMatchEulerDiscreteScheduler, which
nobody here wrote; in the engine, the first block alone follows it, draws no re-noise, and a
batch that mixes it with other sessions' blocks equals each session alone."""

from __future__ import annotations

import copy

import pytest
import torch

from streamdiff.models.engines import DiTEngine
from streamdiff.models.spec import ModelSpec
from streamdiff.models.wan.dit import DiTConfig, WanDiT
from streamdiff.models.wan.sampler import SamplerConfig, denoise_block, denoise_sessions

CFG = DiTConfig(dim=32, ffn_dim=64, num_heads=2, num_layers=2, text_dim=16, text_len=8)
SIGMAS = [1.0, 0.8, 0.55, 0.3, 0.1]


@pytest.fixture(scope="module")
def model() -> WanDiT:
    torch.manual_seed(0)
    return WanDiT(CFG).eval()


def fresh_state(model: WanDiT, prompt: torch.Tensor):
    st = model.new_state(4, 6, 12, 0)
    model.set_prompt(st, prompt)
    return st


@torch.no_grad()
def test_the_first_block_ode_is_diffusers_flow_euler(model):
    from diffusers import FlowMatchEulerDiscreteScheduler

    g = torch.Generator().manual_seed(3)
    prompt = torch.randn(1, CFG.text_len, CFG.text_dim, generator=g)
    noise = torch.randn(1, CFG.in_channels, 3, 4, 6, generator=g)
    ts = [1000.0 * s for s in SIGMAS]
    never = [torch.full(noise.shape, float("nan")) for _ in SIGMAS[1:]]  # the ODE must not read these
    ours = denoise_block(model, fresh_state(model, prompt), noise, ts, never, sigmas=SIGMAS, commit=False, ode=True)

    sched = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=1.0)
    sched.set_timesteps(sigmas=SIGMAS)
    assert sched.timesteps.tolist() == pytest.approx(ts)
    ref, st = noise.clone(), fresh_state(model, prompt)
    for t in sched.timesteps:
        v = model.forward_block(ref, torch.full((1, 3), float(t)), st, False)
        ref = sched.step(v, t, ref).prev_sample  # the last step goes to sigma 0: the clean sample
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)

    fresh = [torch.randn(noise.shape, generator=g) for _ in SIGMAS[1:]]
    other = denoise_block(model, fresh_state(model, prompt), noise, ts, fresh, sigmas=SIGMAS, commit=False)
    assert (other - ours).abs().max() > 1e-2  # fresh noise is another sampler


@torch.no_grad()
def test_a_batch_mixing_ode_and_fresh_rows_equals_each_alone(model):
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randn(1, CFG.text_len, CFG.text_dim, generator=g) for _ in range(2)]
    states = [fresh_state(model, p) for p in prompts]
    solo = copy.deepcopy(states)
    noise = torch.randn(2, CFG.in_channels, 3, 4, 6, generator=g)
    renoise = [torch.randn(noise.shape, generator=g) for _ in SIGMAS[1:]]
    ts = [1000.0 * s for s in SIGMAS]
    both = denoise_sessions(model, states, noise, [ts, ts], renoise, sigmas=[SIGMAS] * 2, ode=[True, False])
    for i, ode in enumerate((True, False)):
        one = denoise_block(model, solo[i], noise[i : i + 1], ts, [r[i : i + 1] for r in renoise], 0.0, SIGMAS, ode=ode)
        torch.testing.assert_close(both[i : i + 1], one, rtol=1e-5, atol=1e-5)


@torch.no_grad()
def test_the_engine_runs_the_shots_first_block_alone_by_the_ode():
    four = [1000, 750, 500, 250]
    spec = ModelSpec(preset="tiny-random", sampler={"first_block_ode": True, "first_block_steps": four})
    eng = DiTEngine(spec)
    plain = DiTEngine(ModelSpec(preset="tiny-random", sampler={"first_block_steps": [1000, 750, 500, 250]}))
    a, b = eng.open_session(64, 48, seed=7), plain.open_session(64, 48, seed=7)
    for e, s in ((eng, a), (plain, b)):
        e.set_scene(s, "a red ball moving left on a white background", cut=True)
    assert eng.follows_ode(a) and not plain.follows_ode(b)
    first = eng.generate_block(a, 3)
    assert (first - plain.generate_block(b, 3)).abs().max() > 1e-3  # the same initial noise, another path
    # the ODE drew no re-noise: the second block's noise is the generator's next draw after the first's
    assert not eng.follows_ode(a)
    gen = torch.Generator().manual_seed(7)
    c, (h, w) = eng.model.cfg.in_channels, a.latent_hw
    torch.randn((1, 3, c, h, w), generator=gen)
    assert torch.equal(a.generator.get_state(), gen.get_state())
    # a second session's first block batched with the first's second equals each alone
    c2 = eng.open_session(64, 48, seed=9)
    eng.set_scene(c2, "a blue square moving up on a black background", cut=True)
    twin_a, twin_c = copy.deepcopy(a), copy.deepcopy(c2)
    assert len(eng.steps_of(a)) == len(eng.steps_of(c2))  # sessions batch by step count
    both = eng.generate_blocks([a, c2], 3)
    torch.testing.assert_close(both[0], eng.generate_block(twin_a, 3), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(both[1], eng.generate_block(twin_c, 3), rtol=1e-5, atol=1e-5)


def test_the_ode_needs_the_block_sampler():
    with pytest.raises(ValueError, match="first_block_ode"):
        SamplerConfig(first_block_ode=True, kind="rolling").validate()
