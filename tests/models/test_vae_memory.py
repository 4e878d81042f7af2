"""What a VAE decode call allocates, counted storage by storage as an allocator sees it (a
dispatch mode that adds each new storage's bytes and takes them off when it is freed), against
the estimate its frames per call are sized by (kernels.plan_block). On an accelerator the frames
per call come from a share of its free memory through that estimate (Platform.decode_working_set,
PEAK_PER_ESTIMATE); here the decoders are narrow (widths 8 and 12 for 96 and 160/256) at 416x240,
in float32 on the CPU: the bound is per latent frame and channel, so it holds at full width."""

from __future__ import annotations

import copy
import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from streamdiff.models.wan.kernels import DecodePlan, plan_block
from streamdiff.models.wan.vae import WAN22_LATENTS_MEAN, WAN22_LATENTS_STD, VAEConfig, WanVAEDecoder
from streamdiff.platform.accel import PEAK_PER_ESTIMATE


class LiveBytes(TorchDispatchMode):
    """The bytes of the storages made while it is active and still alive, and their peak."""

    def __init__(self) -> None:
        super().__init__()
        self.live = self.peak = 0
        self.held: dict[int, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for x in tree_flatten(out)[0]:
            if isinstance(x, torch.Tensor):
                st = x.untyped_storage()
                key, n = st.data_ptr(), st.nbytes()
                if n and key not in self.held:
                    self.held[key] = n
                    self.live += n
                    self.peak = max(self.peak, self.live)
                    weakref.finalize(st, self._gone, key)
        return out

    def _gone(self, key: int) -> None:
        self.live -= self.held.pop(key, 0)


WAN21 = (VAEConfig(base_dim=8, num_res_blocks=1), 8)
WAN22 = (
    VAEConfig(
        base_dim=8, decoder_base_dim=12, z_dim=48, num_res_blocks=2, residual=True, patch_size=2,
        latents_mean=WAN22_LATENTS_MEAN, latents_std=WAN22_LATENTS_STD,
    ),
    16,
)  # fmt: skip


@pytest.mark.parametrize("cfg,sf", [WAN21, WAN22], ids=["wan2.1", "wan2.2"])
def test_a_decode_calls_peak_per_latent_frame_is_within_the_estimate_times_its_bound(cfg, sf):
    torch.manual_seed(0)
    dec = WanVAEDecoder(cfg).eval()
    h, w, tf = 240 // sf, 416 // sf, cfg.temporal_factor
    z = torch.randn(1, cfg.z_dim, 6, h, w)
    state = dec.new_state()
    peaks, outs = {}, {}
    with torch.no_grad():
        dec.decode(z[:, :, :1], state)  # the shot's first frame: steady blocks after it
        for per_call in (1, 5):
            s = copy.deepcopy(state)
            count = LiveBytes()
            with count:
                outs[per_call] = dec.decode_rows(z[:, :, 1:], s, DecodePlan(((0, h),), per_call), 0, None, False)
            peaks[per_call] = count.peak
    torch.testing.assert_close(outs[1], outs[5], atol=1e-5, rtol=0)  # chunked as planned, as one call
    # the working-set estimate of a latent frame (kernels.plan_block: input, output and the conv's
    # buffer of the last stage's width at full resolution, float32)
    width = cfg.decoder_dim // cfg.patch_size**2
    estimate = width * tf * (h * sf) * (w * sf) * 4 * 3
    per_frame = (peaks[5] - peaks[1]) / 4
    assert 1.5 * estimate < per_frame <= PEAK_PER_ESTIMATE * estimate  # the bound is needed, and holds


def test_off_the_cpu_the_frames_per_call_follow_the_working_set_and_every_rank_agrees():
    shape, args = (16, 12, 60, 104), (96, 8, 4, 2)  # LongLive-size latents, the 2.1 decoder in bf16
    one = plan_block(shape, 1, "cuda", *args, 2**40)
    assert one.frames_per_call == 12  # room for the whole block: one call, as before
    per_frame = 96 * 4 * 480 * 832 * 2 * 3
    tight = plan_block(shape, 1, "cuda", *args, 5 * per_frame)
    assert tight.frames_per_call == 5
    group = [plan_block(shape, 2, "cuda", *args, 5 * per_frame) for _ in range(2)]
    assert group[0] == group[1] and group[0].frames_per_call >= 5  # a band's rows: more frames fit
