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
