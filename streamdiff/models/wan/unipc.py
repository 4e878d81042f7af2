"""UniPC for flow-matching models, as LongLive 2.0 samples each block of the Wan 2.2 5B.

LongLive 2.0 builds a fresh multistep solver per block (`FlowUniPCMultistepScheduler`, Wan's copy
of diffusers' UniPC with flow sigmas): 4 steps at shift 5, order 2 with the last step at order
1, the model's flow turned into a prediction of x0, B(h) = e^h - 1 ("bh2"), a final sigma of 0
(../shared/notes/wan22.md, section 3). Written here rather than taken from diffusers, which is
only a test dependency of this project; tests/models/test_unipc.py holds it to diffusers'
`UniPCMultistepScheduler` step for step.

Flow matching: x_t = (1 - sigma) x0 + sigma * noise and the model predicts v = noise - x0, so
alpha_t = 1 - sigma, sigma_t = sigma, x0 = x_t - sigma * v and the half log-SNR is
lambda = log(1 - sigma) - log(sigma). A step from sigma_s to sigma_t (h = lambda_t - lambda_s > 0)
is the exponential-integrator update

    x_t = sigma_t / sigma_s * x_s + alpha_t * (1 - e^-h) * x0_s  - alpha_t * B(-h) * (terms in the
    differences of earlier x0 predictions),

the predictor using the x0 predictions made so far, the corrector (UniC) redoing the previous
step once the model has seen where it landed. The coefficients are Python floats, so a step
queues tensor work only (no host synchronisation on an accelerator)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch


def flow_sigmas(steps: int, shift: float, train_steps: int = 1000) -> list[float]:
    """The authors' schedule: `steps` sigmas evenly spaced from 1 - 1/train_steps down to 0 (the
    last left out), each shifted as s -> shift*s / (1 + (shift-1)*s), then a final 0. At 4 steps
    and shift 5 the timesteps (1000 * sigma) are 999.80, 937.27, 833.06, 624.69."""
    if steps < 1:
        raise ValueError(f"a UniPC block needs at least one step, got {steps}")
    top = 1.0 - 1.0 / train_steps
    base = [top * (1 - k / steps) for k in range(steps)]
    return [shift * s / (1 + (shift - 1) * s) for s in base] + [0.0]


def _lam(sigma: float) -> float:
    return math.log(1.0 - sigma) - math.log(sigma)


class FlowUniPC:
    """One block's solver: `step(flow, x)` once per sigma but the last, each with the model's
    flow at `timesteps[i]` on the sample the previous step returned; the last step returns the
    block's clean latent (x0)."""

    def __init__(self, sigmas: Sequence[float], order: int = 2) -> None:
        if order not in (1, 2):
            raise ValueError(f"UniPC order 1 or 2, got {order}")
        if len(sigmas) < 2 or sigmas[-1] != 0.0 or not all(a > b for a, b in zip(sigmas, sigmas[1:])):
            raise ValueError(f"sigmas must fall strictly and end at 0, got {list(sigmas)}")
        if not 0.0 < sigmas[0] < 1.0:
            raise ValueError(f"the first sigma must lie in (0, 1), got {sigmas[0]}")
        self.sigmas = [float(s) for s in sigmas]
        self.order = order
        self.i = 0
        self._x0: list[torch.Tensor] = []  # the x0 predictions so far, newest last (at most `order`)
        self._last: torch.Tensor | None = None  # the sample the previous predictor step started from
        self._last_order = 0

    @property
    def timesteps(self) -> list[float]:
        """What the model is given at each step: 1000 * sigma (the DiT's timestep scale)."""
        return [1000.0 * s for s in self.sigmas[:-1]]

    @property
    def done(self) -> bool:
        return self.i == len(self.sigmas) - 1

    def step(self, flow: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """The model's flow `flow` at `x` (sigma = sigmas[i]) -> the sample at sigmas[i + 1]."""
        if self.done:
            raise RuntimeError("this block's UniPC steps are all taken")
        i, s = self.i, self.sigmas
        x0 = x - s[i] * flow
        if i > 0:  # UniC: redo the previous step with the x0 the model has just predicted
            x = self._update(self._last, s[i - 1], s[i], self._last_order, x0)
        self._x0 = (self._x0 + [x0])[-self.order :]
        # Lower orders at the start (one x0 known) and at the final step (to sigma 0).
        order = min(self.order, len(s) - 1 - i, i + 1)
        self._last, self._last_order = x, order
        self.i += 1
        if s[i + 1] == 0.0:  # the limit of the update at sigma 0 (order 1): the prediction itself
            return x0
        return self._update(x, s[i], s[i + 1], order, None)

    def _update(self, x: torch.Tensor, s0: float, t: float, order: int, x0_t: torch.Tensor | None) -> torch.Tensor:
        """From `x` at sigma s0 to sigma t: the predictor (x0_t None), or the corrector given the
        x0 predicted at t. `self._x0[-1]` is the prediction at s0, `self._x0[-2]` the one before."""
        h = _lam(t) - _lam(s0)
        phi1 = math.expm1(-h)  # h * phi_1(h), at -h: x0 is predicted
        bh = phi1  # B(h) = e^h - 1 ("bh2")
        alpha_t = 1.0 - t
        m0 = self._x0[-1]
        out = (t / s0) * x - (alpha_t * phi1) * m0
        d1 = rk = None
        if order == 2:  # the slope from the prediction before
            prev_sigma = self.sigmas[self.sigmas.index(s0) - 1]
            rk = (_lam(prev_sigma) - _lam(s0)) / h
            d1 = (self._x0[-2] - m0) / rk
        if x0_t is None:
            if d1 is not None:
                out = out - (alpha_t * bh * 0.5) * d1  # order 2: rho = 1/2
            return out
        # UniC's weights solve R rho = b, with R's rows the powers of (r_k, 1), b the phi terms.
        b, hk, fact = [], phi1 / -h - 1.0, 1
        for k in range(1, order + 1):
            b.append(hk * fact / bh)
            fact *= k + 1
            hk = hk / -h - 1.0 / fact
        if order == 1:
            rhos = [0.5]
        else:
            rho0 = (b[0] - b[1]) / (1.0 - rk)
            rhos = [rho0, b[0] - rho0]
        corr = rhos[-1] * (x0_t - m0)
        if d1 is not None:
            corr = corr + rhos[0] * d1
        return out - (alpha_t * bh) * corr
