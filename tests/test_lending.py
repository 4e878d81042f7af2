"""Shared cores' ledger (platform/cpu_lending.py): a worker runs on its own threads plus those of every
worker waiting now, and changes its count before each DiT block and VAE convolution."""

from __future__ import annotations

import pytest
import torch

from streamdiff.platform.cpu_lending import HostSlot, Lender, LendSpec, create_ledger
from streamdiff.workers.lend import install_lender


@pytest.fixture(autouse=True)
def _restore_threads():
    """Lenders change this process's thread count: undo it."""
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def _pair(tmp_path, threads=(1, 1)):
    path = str(tmp_path / "cores")
    create_ledger(path, len(threads))
    return [Lender(LendSpec(path, i, threads)) for i in range(len(threads))]


def test_a_worker_borrows_the_threads_of_the_workers_waiting_now(tmp_path):
    dit, vae, third = _pair(tmp_path, (1, 1, 2))
    assert [x.threads_now() for x in (dit, vae, third)] == [4, 4, 4]  # every other one waits
    dit.running(True)
    assert vae.threads_now() == 3 and third.threads_now() == 3
    vae.running(True)
    assert torch.get_num_threads() == 3 and vae.current == 3  # what it took when it started
    third.running(True)
    vae.adjust()  # the hook before its next convolution
    assert torch.get_num_threads() == 1 and vae.threads_now() == 1
    dit.running(False)  # a worker that ends its batch goes back to its own threads
    assert dit.current == 1 and vae.threads_now() == 2
    vae.adjust()
    assert torch.get_num_threads() == 2
    assert third.borrowed_s() == 0.0 and vae.borrowed_s() > 0.0  # third started with all busy


def test_a_restarted_worker_clears_its_stale_byte(tmp_path):
    dit, vae = _pair(tmp_path)
    dit.running(True)  # and then killed mid-batch: its byte stays set
    assert vae.threads_now() == 1
    Lender(dit.spec)  # its restart
    assert vae.threads_now() == 2


def test_hooks_go_before_every_dit_block_and_vae_convolution(tmp_path):
    from streamdiff.models.wan.dit import DiTBlock, DiTConfig, WanDiT
    from streamdiff.models.wan.vae import VAEConfig, WanVAEDecoder
    from streamdiff.models.wan.vae_blocks import CausalConv3d

    dit, vae = _pair(tmp_path)
    dec = WanVAEDecoder(VAEConfig(base_dim=4, num_res_blocks=0))
    net = WanDiT(DiTConfig(dim=32, ffn_dim=64, num_heads=2, num_layers=3, text_dim=16, text_len=4))
    convs = [x for x in dec.modules() if isinstance(x, CausalConv3d)]
    assert len(convs) > 3 and install_lender(vae, dec) > len(convs)  # the norms, blocks and resamplers too
    assert all(c._forward_pre_hooks for c in convs)
    assert install_lender(dit, net) == 3 == sum(isinstance(x, DiTBlock) for x in net.modules())
    vae.running(True)  # the DiT waits: two threads
    assert torch.get_num_threads() == 2
    dit.running(True)  # ... and now runs: the next convolution goes back to one
    for hook in convs[-1]._forward_pre_hooks.values():
        hook(convs[-1], ())
    assert torch.get_num_threads() == 1


def test_a_borrowing_thread_runs_on_every_shared_core_and_goes_home_after(tmp_path):
    """The thread that runs the forward keeps to its own core unless it borrows (so the
    supervisor's encoder, on the DiT's core, never lands beside it there)."""
    import os
    import threading

    every = sorted(os.sched_getaffinity(0))
    if len(every) < 2:
        pytest.skip("needs two cores")
    path = str(tmp_path / "cores")
    create_ledger(path, 3)
    seen = []

    def vae_worker():  # a thread of its own: affinity is per thread
        os.sched_setaffinity(0, {every[1]})
        vae = Lender(LendSpec(path, 1, (1, 1, 0), (0, 1, 0), tuple(every[:2])))
        host = HostSlot(LendSpec(path, 2, (1, 1, 0), (0, 1, 0), tuple(every[:2])))
        vae.running(True)  # the DiT and the encoders wait
        seen.append((os.sched_getaffinity(0), torch.get_num_threads()))
        with host.running():  # an encoder starts on the DiT's core: that core is taken
            vae.adjust()
            seen.append((os.sched_getaffinity(0), torch.get_num_threads()))
        vae.adjust()
        vae.running(False)
        seen.append((os.sched_getaffinity(0), torch.get_num_threads()))

    t = threading.Thread(target=vae_worker)
    t.start()
    t.join()
    both, home = set(every[:2]), {every[1]}
    assert seen == [(both, 2), (home, 1), (home, 1)]


def test_a_cpu_convolution_lets_the_lender_in_before_each_temporal_tap(tmp_path):
    """A full-resolution 3D conv takes up to 38 ms on one EPYC core: a worker also changes its
    thread count before each of its temporal taps (each a conv2d), not only before the module."""
    from streamdiff.models.wan import kernels
    from streamdiff.models.wan.vae import VAEConfig, WanVAEDecoder

    dit, vae = _pair(tmp_path)
    dec = WanVAEDecoder(VAEConfig(base_dim=4, num_res_blocks=0))
    install_lender(vae, torch.nn.Sequential(dec))
    assert dec.checkpoint == vae.adjust
    calls = []
    x, w = torch.randn(1, 4, 5, 6, 6), torch.randn(2, 4, 3, 3, 3)
    y = kernels.conv3d_valid_t(x, w, None, 1, 1, lambda: calls.append(1))
    assert len(calls) == 3 and y.shape == (1, 2, 3, 6, 6)
    ref = torch.nn.functional.conv3d(x, w, None, padding=(0, 1, 1))
    assert torch.allclose(y, ref, atol=1e-5)
