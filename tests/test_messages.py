"""The control-plane messages: a tagged union of msgspec Structs over msgpack. Every message
round-trips exactly; a message of the wrong shape is refused with a ProtocolError (never a half-
filled object), so a worker and the supervisor can trust each field's type."""

from __future__ import annotations

import msgpack
import msgspec
import pytest

from streamdiff.ipc import messages as m
from streamdiff.models.spec import preset_card
from streamdiff.supervisor.core import loaded_model

EXAMPLES = [
    m.OpenSession("video_1", 256, 144, 2**63 - 1),
    m.GenerateBlock("video_1", 3, 3, 5, prompt="a fox", new_shot=True, seed=7),
    m.DecodeBlock("video_1", 3, 5, 2, [16, 3, 18, 32], 12, reset=True),
    m.CloseSession("video_1"),
    m.Shutdown(),
    m.Ready(
        "dit0",
        1234,
        m.ReadyInfo(
            "cpu",
            ["dit"],
            dit=m.DiTReady(
                m.StageCost(80.0, [256, 144], busy_ms=70.0),
                {"2": 60.0},
                m.DiTMemory(1024.0, 12, 4096.0, 2.0**33),
                card=preset_card("longlive2-5b"),  # a card with every kind of field set
                loaded={"checkpoint": "model_bf16.pt"},
            ),
        ),
    ),
    m.Heartbeat("vae0.1", 0.25),
    m.Heartbeat("dit0", 1.0, 0.5, m.CpuStats(borrowed_s=2.5)),  # the CPU platform's figures
    m.LatentDone("video_1", 3, 5, [16, 3, 18, 32], 12.5),
    m.FramesDone("video_1", 3, 1, 2, 40.0, skipped=True),
    m.Failed("vae0.0", "RequestError: no", "video_1", 3, "request"),
]


@pytest.mark.parametrize("msg", EXAMPLES, ids=lambda x: type(x).__name__)
def test_round_trip(msg):
    data = msg.encode()
    assert msgpack.unpackb(data)["t"] == msg.type  # a plain msgpack map, tagged
    assert m.decode(data) == msg


@pytest.mark.parametrize(
    "raw",
    [
        {"t": "gen", "session": "s"},  # missing fields
        {"t": "dec", "session": "s", "block": 1, "latent_slot": 0, "frame_slot": 0, "shape": ["x"], "frames_out": 1},
        {"t": "failed", "worker": "w", "message": "m", "kind": "whatever"},
        {"t": "nope"},
        {"session": "s"},
    ],
)
def test_malformed_messages_are_refused(raw):
    with pytest.raises(m.ProtocolError):
        m.decode(msgpack.packb(raw))
    with pytest.raises(m.ProtocolError):
        m.decode(b"\xc1 not msgpack")


def test_a_compiled_vae_says_so_beside_the_dits_load():
    """The VAE stage's compile figures travel in READY and join what the DiT loaded (so
    `/health` `model` and `/v1/models` `loaded`, beside the DiT's)."""
    cost = m.StageCost(10.0, [256, 144])
    compiled = {"mode": "on", "on": True, "graphs": 3, "compile_s": 9.4}
    vae = m.decode(m.Ready("vae0.0", 1, m.ReadyInfo("cpu", ["vae"], vae=m.VAEReady(cost, compile=compiled))).encode())
    dit = m.ReadyInfo("cpu", ["dit"], dit=m.DiTReady(cost, card=preset_card("tiny"), loaded={"compile": {}}))
    card, loaded = loaded_model(preset_card("tiny"), {"dit0": dit, "vae0.0": vae.info})
    assert card == preset_card("tiny") and loaded == {"compile": {}, "vae_compile": compiled}
    _, loaded = loaded_model(
        preset_card("tiny"), {"dit0": dit, "vae0.0": m.ReadyInfo("cpu", ["vae"], vae=m.VAEReady(cost))}
    )
    assert "vae_compile" not in loaded


def test_a_worker_whose_model_does_not_fit_the_rings_is_refused_by_field():
    """The supervisor sized its rings by the preset's card: a DiT reporting another block, or a
    VAE another factor, is refused naming the field; a dimension of its own is the loaded model's."""
    cost = m.StageCost(10.0, [256, 144])
    tiny = preset_card("tiny")

    def dit(card):
        return {"dit0": m.ReadyInfo("cpu", ["dit"], dit=m.DiTReady(cost, card=card))}

    with pytest.raises(RuntimeError, match="worker dit0 reports frames_per_block=1, expected 3"):
        loaded_model(tiny, dit(tiny.configured(frames_per_block=1)))
    with pytest.raises(RuntimeError, match="worker vae0.0 reports spatial_factor=16, expected 8"):
        loaded_model(tiny, {"vae0.0": m.ReadyInfo("cpu", ["vae"], vae=m.VAEReady(cost, spatial_factor=16))})
    wider = msgspec.structs.replace(tiny, window_frames=6)
    assert loaded_model(tiny, dit(wider))[0] == wider
