"""Every shard of a VAE group decodes a block under one plan: property test over the sizes the
limits allow, shard counts 2-4 and frames per block, with a working set small enough to force
the CPU's chunked decode. Each rank's decode runs here in one process with a halo that records
every exchange (and answers zero rows); neighbours must post the same exchanges, in the same
order, with the same shapes — exactly what gloo, NCCL and oneCCL need to stay in step."""

from __future__ import annotations

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from streamdiff.config import LimitsConfig
from streamdiff.models.wan.kernels import plan_block
from streamdiff.models.wan.vae import VAEConfig, WanVAEDecoder
from streamdiff.models.wan.vae_blocks import Halo

CFG = VAEConfig(base_dim=4, num_res_blocks=0)
LIM = LimitsConfig()


class RecordingHalo(Halo):
    """One rank's halo: records the rows it would send; zero rows come back; gather gives a
    zero frame of the full height (shard_front's attention), local cuts this rank's band."""

    rows = 1

    def __init__(self, bands, rank: int) -> None:
        self.bands, self.rank = bands, rank
        self.sent: list[tuple[int, ...]] = []

    def post(self, x: torch.Tensor):
        self.sent.append(tuple(x[..., :1, :].shape))
        return None

    def complete(self, pending, dest: torch.Tensor) -> None:
        dest[..., :1, :] = 0
        dest[..., -1:, :] = 0

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        r0, r1 = self.bands[self.rank]
        s = x.shape[-2] // (r1 - r0)
        self.sent.append(("gather", *x.shape[:-2], s * self.bands[-1][1], x.shape[-1]))
        return torch.zeros((*x.shape[:-2], s * self.bands[-1][1], x.shape[-1]), dtype=x.dtype)

    def local(self, x: torch.Tensor) -> torch.Tensor:
        r0, r1 = self.bands[self.rank]
        s = x.shape[-2] // self.bands[-1][1]
        return x[..., r0 * s : r1 * s, :]


_VAE = None


def vae() -> WanVAEDecoder:
    global _VAE
    if _VAE is None:
        torch.manual_seed(0)
        _VAE = WanVAEDecoder(CFG).eval()
    return _VAE


sizes = st.integers(LIM.min_size // 16, LIM.max_height // 16)  # heights, in units of 16 pixels


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    h16=st.integers(LIM.min_size // 16, LIM.max_height // 16),  # heights and widths in units of 16 pixels
    w16=st.integers(LIM.min_size // 16, LIM.max_width // 16),
    world=st.integers(2, 4),
    frames=st.sampled_from([1, 2, 3]),
    budget_log2=st.floats(14, 28),
    shard_front=st.booleans(),
)
def test_ranks_post_the_same_exchanges(h16, w16, world, frames, budget_log2, shard_front):
    h, w = 2 * h16, 2 * w16  # latent rows and columns
    z = torch.randn(1, CFG.z_dim, frames, h, w)
    plan = plan_block(z.shape, world, "cpu", CFG.base_dim, 8, 4, 4, int(2**budget_log2))
    logs = []
    for rank in range(world):
        halo = RecordingHalo(plan.bands, rank)
        state = vae().new_state()
        first = plan_block(z[:, :, :1].shape, world, "cpu", CFG.base_dim, 8, 4, 4, int(2**budget_log2))
        vae().decode_rows(z[:, :, :1], state, first, rank, halo, shard_front)  # the shot's first frame
        vae().decode_rows(z, state, plan, rank, halo, shard_front)  # a later block, from the cache
        logs.append(halo.sent)
    for rank in range(world - 1):
        assert logs[rank] == logs[rank + 1], (rank, len(logs[rank]), len(logs[rank + 1]))


def test_the_plan_is_sized_for_the_largest_band():
    # 40 latent rows over 3 shards: 14, 13, 13. A budget that fits three frames of a 13-row band
    # but only two of the 14-row one: every rank decodes two frames per call.
    per_row_frame = 4 * 4 * 8 * 52 * 8 * 4 * 3  # base_dim * temporal * (8 px per row) * 8 w * bytes * 3
    plan = plan_block((1, 16, 3, 40, 52), 3, "cpu", 4, 8, 4, 4, 3 * 13 * per_row_frame)
    assert plan.bands == ((0, 14), (14, 27), (27, 40)) and plan.frames_per_call == 2
    # the same rule off the CPU, with the device's working set (a share of its free memory)
    assert plan_block((1, 16, 3, 40, 52), 3, "cuda", 4, 8, 4, 4, 3 * 13 * per_row_frame).frames_per_call == 2
    assert plan_block((1, 16, 3, 40, 52), 3, "cuda", 4, 8, 4, 4, 2**40).frames_per_call == 3
