"""Controls of a world-model session (streamdiff/controls.py), at the timeline: held state
(latest wins, a press shorter than a block lasts one block), scripts per frame and per block,
controls naming a later block, coalescing, refusals; and minWM's pose integrator against its
trajectory convention (Wan21/wan_utils/camera_trajectory.py, transcribed: 0.08 units or 3
degrees per latent frame, yaw then pitch then moves along the turned axes, w2c = inv(c2w))."""

from __future__ import annotations

import numpy as np
import pytest

from streamdiff.controls import CAMERA, INTRINSICS, ControlError, Timeline, parse_control


def ctl(**kw):
    return parse_control(kw, CAMERA)


def w2c_of(row: list[float]) -> np.ndarray:
    return np.array(row[:16]).reshape(4, 4)


def authors_trajectory(steps: list[str]) -> np.ndarray:
    """A transcription of minWM's `_generate_c2w_trajectory` + `parse_trajectory` for one key per
    step: identity first, then after each step; float32 w2c."""
    moves = {"w": ("f", 0.08), "s": ("f", -0.08), "d": ("r", 0.08), "a": ("r", -0.08), "u": ("u", 0.08),
             "dn": ("u", -0.08), "j": ("yaw", -3.0), "l": ("yaw", 3.0), "i": ("pitch", 3.0),
             "k": ("pitch", -3.0)}  # fmt: skip
    t, out = np.eye(4), [np.eye(4)]
    for key in steps:
        kind, v = moves[key]
        if kind == "yaw":
            c, s = np.cos(np.radians(v)), np.sin(np.radians(v))
            t[:3, :3] = t[:3, :3] @ np.array([[c, 0, s], [0, 1, 0], [-s, 0, c]])
        elif kind == "pitch":
            c, s = np.cos(np.radians(v)), np.sin(np.radians(v))
            t[:3, :3] = t[:3, :3] @ np.array([[1, 0, 0], [0, c, -s], [0, s, c]])
        else:
            axis = {"f": [0, 0, v], "r": [v, 0, 0], "u": [0, -v, 0]}[kind]
            t[:3, 3] += t[:3, :3] @ np.array(axis)
        out.append(t.copy())
    return np.stack([np.linalg.inv(c).astype(np.float32) for c in out])


def test_a_script_per_frame_is_the_authors_trajectory():
    steps = ["w"] * 5 + ["j"] * 4 + ["i"] * 3 + ["d", "d", "dn", "l", "k", "s", "a", "u"]
    tl = Timeline(CAMERA)
    tl.receive(ctl(seq=0, mode="script", script=[{"keyboard": [k]} for k in ["w", *steps]]), 0)
    rows = [r for b in range(6) for r in tl.block(b, 4, b == 0).camera][: len(steps) + 1]
    got = np.stack([w2c_of(r) for r in rows]).astype(np.float32)
    np.testing.assert_array_equal(got, authors_trajectory(steps))
    assert all(r[16:] == list(INTRINSICS) for r in rows)


def test_held_keys_latest_wins_and_a_short_press_lasts_one_block():
    tl = Timeline(CAMERA)
    assert tl.block(0, 4, True).seq is None  # nothing yet: standing still
    assert tl.receive(ctl(seq=1, keyboard=["w"]), 1) == 1
    assert tl.receive(ctl(seq=2, keyboard=[]), 1) == 1  # released before block 1 started
    b1 = tl.block(1, 4, False)
    assert b1.seq == 2
    z = [w2c_of(r)[2, 3] for r in b1.camera]  # w2c's z translation: -forward
    assert np.allclose(np.diff(z), -0.08)  # the press moved it the whole block
    b2 = tl.block(2, 4, False)
    assert np.allclose([w2c_of(r) for r in b2.camera], w2c_of(b1.camera[-1]))  # and then it stood still
    tl.receive(ctl(seq=3, mouse=[0, 2.0]), 3)
    tl.receive(ctl(seq=4, mouse=[0, 0]), 3)  # a mouse move that stopped still turns one block
    b3 = tl.block(3, 4, False)
    yaw = [np.degrees(np.arctan2(w2c_of(r)[2, 0], w2c_of(r)[0, 0])) for r in b3.camera]  # w2c: R^T (float32)
    assert np.allclose(np.diff(yaw), 2.0, atol=1e-5) and b3.seq == 4


def test_a_flood_of_held_controls_is_one_waiting_entry():
    tl = Timeline(CAMERA)
    for i in range(1000):
        tl.receive(ctl(seq=i, keyboard=[["w"], ["a"], []][i % 3]), 5)
    assert len(tl.pending) == 1
    b = tl.block(5, 4, False)
    assert b.seq == 999  # last held: none; pulses: w and a from the flood
    x = [w2c_of(r) for r in b.camera]
    assert np.allclose(x[1][:3, 3] - x[0][:3, 3], [0.08, 0, -0.08])  # right and forward, each frame


def test_a_script_per_block_then_nothing_held_and_a_later_block_named():
    tl = Timeline(CAMERA)
    tl.receive(ctl(seq=1, keyboard=["l"]), 0)
    tl.receive(ctl(seq=2, mode="script", per="block", script=[{"keyboard": ["w"]}, {"keyboard": ["s"]}]), 1)
    tl.receive(ctl(seq=3, block=4, keyboard=["d"]), 1)
    seqs, moves = [], []
    for b in range(6):
        out = tl.block(b, 4, b == 0)
        seqs.append(out.seq)
        c = [np.linalg.inv(w2c_of(r)) for r in out.camera]
        local = [np.linalg.inv(c[i])[:3, :3] @ (c[i + 1][:3, 3] - c[i][:3, 3]) for i in range(3)]
        moves.append(np.round(local[-1], 6).tolist())
    assert seqs == [1, 2, 2, 2, 3, 3]
    assert moves[1] == [0, 0, 0.08] and moves[2] == [0, 0, -0.08]  # the script's two blocks
    assert moves[3] == [0, 0, 0]  # it ran out: nothing held (the earlier `l` is gone too)
    assert moves[4] == [0.08, 0, 0]  # the control that named block 4


def test_a_raw_camera_sets_the_pose_and_keys_go_on_from_it():
    tl = Timeline(CAMERA)
    pose = [[0, 0, 1, 0.5], [0, 1, 0, 0], [-1, 0, 0, 2.0], [0, 0, 0, 1]]
    k = [[0.7, 0, 0.4], [0, 0.9, 0.6], [0, 0, 1]]
    tl.receive(ctl(seq=1, mode="script", script=[{"camera": {"w2c": pose, "K": k}}, {"keyboard": ["w"]}]), 0)
    rows = tl.block(0, 4, True).camera
    assert rows[0][:16] == sum(pose, []) and rows[0][16:] == pytest.approx([0.7, 0.9, 0.4, 0.6])
    after = np.linalg.inv(w2c_of(rows[1]))
    assert np.allclose(
        after[:3, 3], np.linalg.inv(np.array(pose))[:3, 3] + np.array([0, 0, 1.0]) @ after[:3, :3].T * 0.08
    )
    assert rows[1][16:] == list(INTRINSICS)


def test_a_cut_starts_the_pose_at_the_identity():
    tl = Timeline(CAMERA)
    tl.receive(ctl(seq=1, keyboard=["w"]), 0)
    tl.block(0, 4, True)
    first = tl.block(1, 4, True).camera[0]
    assert np.array_equal(w2c_of(first), np.eye(4))


@pytest.mark.parametrize(
    "body, param",
    [
        ({"seq": -1}, "seq"),
        ({"seq": True}, "seq"),
        ({"seq": 1, "keyboard": ["W"]}, "keyboard"),
        ({"seq": 1, "mouse": [float("nan"), 0]}, "mouse[0]"),
        ({"seq": 1, "mouse": [0, float("inf")]}, "mouse[1]"),
        ({"seq": 1, "mode": "live"}, "mode"),
        ({"seq": 1, "script": [{}]}, "mode"),
        ({"seq": 1, "mode": "script", "per": "shot", "script": [{}]}, "per"),
        ({"seq": 1, "mode": "script", "keyboard": ["w"], "script": [{}]}, "mode"),
        ({"seq": 1, "mode": "script", "script": [{"camera": {"w2c": np.eye(4).tolist(), "K": [0, 1, 0, 0]}}]},
         "script[0].camera.K"),
        ({"seq": 1, "mode": "script", "script": [{"camera": {"w2c": np.eye(3).tolist()}}]}, "script[0].camera.w2c"),
        ({"seq": 1, "block": -2}, "block"),
    ],
)  # fmt: skip
def test_a_bad_control_names_its_field(body, param):
    with pytest.raises(ControlError) as e:
        parse_control(body, CAMERA)
    assert e.value.param == param and e.value.status == 400


def test_order_lateness_and_the_waiting_limit():
    tl = Timeline(CAMERA)
    tl.receive(ctl(seq=5), 0)
    with pytest.raises(ControlError) as e:
        tl.receive(ctl(seq=5), 0)
    assert (e.value.status, e.value.code) == (409, "seq_not_increasing")
    with pytest.raises(ControlError) as e:
        tl.receive(ctl(seq=6, block=2), 3)
    assert (e.value.status, e.value.param) == (409, "block")
    for i in range(63):
        tl.receive(ctl(seq=10 + i, block=100 + i), 3)
    with pytest.raises(ControlError) as e:
        tl.receive(ctl(seq=99, block=500), 3)
    assert e.value.status == 429
    with pytest.raises(ControlError) as e:
        parse_control({"seq": 1}, None)
    assert e.value.code == "controls_unsupported"
