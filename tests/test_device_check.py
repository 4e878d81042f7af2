"""tools/device/check.py, trimmed, on the CPU: the script a GPU session runs must not rot between
the rare sessions that have a device. Every check it makes there runs here on small configs."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from .helpers import ROOT


@pytest.mark.timeout(400)
def test_device_check_runs_on_the_cpu(tmp_path):
    out = tmp_path / "dc.json"
    r = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "device" / "check.py"), "--device", "cpu", "--quick", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=380,
        env={**os.environ, "OUT": str(tmp_path)},
    )
    res = json.loads(out.read_text())
    ll2 = res["longlive2"]  # LongLive 2.0's block on the 5B's loop, and the Wan 2.2 VAE's decode of it
    assert ll2["block_ms"] > 0 and ll2["vae_block_ms"] > 0 and ll2["vae_frames"] == 32
    assert r.returncode == 0, (r.stdout[-2000:], {k: v for k, v in res.items() if isinstance(v, dict)})
    st = res["stages"]  # --quick: chunk-wise only, and no `daemon` check (QUICK_SKIPS says why)
    assert st["chunkwise"]["frames_per_block"] == 3 and "framewise" not in st
    assert st["chunkwise"]["dit_block_s"] > 0 and st["chunkwise"]["vae_block_s"] > 0
    assert set(res["skipped"]) == {"daemon", "stages.framewise"} and "daemon" not in res
    assert res["taehv"]["ok"] and res["taehv"]["taehv-published"]["frames"] == 12  # TAEHV timed (832x480 on a GPU)
    num = res["numerics"]
    assert num["dit"]["ok"] and num["vae"]["ok"] and num["dit"]["diffusers_bf16"] > 0
    assert res["vae_group"]["gloo"]["max_abs_diff"] <= 2e-2
    # pytest -m device tests/device with the CPU standing in for the device (the event timer skips)
    assert res["pytest"]["ok"] and " passed" in res["pytest"]["summary"], res["pytest"]
    # the daemon serving a release written in the diffusers layout (the real configs, trimmed here)
    real = res["daemon_real"]
    assert real["frames"] == 33 and real["fragments"] >= 3 and real["placement"]["layout"] == "disagg-1+1"
    assert real["stage_block_s"]["dit"]["blocks"] >= 3 and real["stage_block_s"]["vae"]["mean_s"] > 0
