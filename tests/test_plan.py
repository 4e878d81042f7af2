"""The frame arithmetic of a request (plan.py): whole blocks on the block grid, exact frame counts."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from streamdiff.plan import Scene, plan_blocks, replan_from

scenes_st = st.lists(st.tuples(st.integers(1, 90), st.sampled_from(["cut", "continue"])), min_size=1, max_size=5).map(
    lambda xs: [Scene(f"p{i}", n, tr) for i, (n, tr) in enumerate(xs)]
)


@given(scenes_st, st.integers(1, 4))
def test_every_block_is_whole_and_every_scene_gets_exactly_its_frames(scenes, fpb):
    blocks = plan_blocks(scenes, fpb, 4)
    assert all(b.latent_frames == fpb for b in blocks)  # the DiT only sees its trained block size
    for si, sc in enumerate(scenes):
        mine = [b for b in blocks if b.scene == si]
        assert sum(b.emit for b in mine) == sc.frames
        assert all(1 <= b.emit <= b.frames_out for b in mine)  # surplus only at the end, never a block of none
        assert all(b.emit == b.frames_out for b in mine[:-1])
        assert mine[0].first_of_scene and mine[0].shot_start == (si == 0 or sc.transition == "cut")
    # the timeline is contiguous: each block's first emitted frame follows the one before
    assert [b.start_frame for b in blocks] == [sum(x.emit for x in blocks[:i]) for i in range(len(blocks))]


def test_a_scenes_surplus_frames_are_decoded_and_dropped():
    # 2.5 s at 16 fps = 40 frames: 1 + ceil(39 / 4) = 11 latent frames -> 4 whole blocks of 3
    # (12 latent frames, 45 decoded), 5 dropped at the end; a continue scene starts on the grid.
    blocks = plan_blocks([Scene("a", 40), Scene("b", 8, "continue")], 3, 4)
    assert [(b.latent_frames, b.frames_out, b.emit) for b in blocks] == [
        (3, 9, 9), (3, 12, 12), (3, 12, 12), (3, 12, 7), (3, 12, 8),
    ]  # fmt: skip


@given(scenes_st, st.integers(1, 4), st.data())
def test_steering_keeps_the_blocks_already_planned(scenes, fpb, data):
    blocks = plan_blocks(scenes, fpb, 4)
    at = data.draw(st.integers(1, len(blocks)))
    kept, replanned = replan_from(scenes, blocks, at, Scene("new", 17, "continue"), fpb, 4)
    assert replanned[:at] == blocks[:at]
    assert all(b.latent_frames == fpb for b in replanned)
    assert sum(b.emit for b in replanned[at:]) == 17
