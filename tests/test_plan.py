"""The frame arithmetic of a request (plan.py): whole blocks on the block grid, exact frame counts."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from streamdiff.plan import Scene, cache_frames, most_held_frames, plan_blocks, replan_from

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


def shots(blocks) -> list[int]:
    """Latent frames of each shot of a plan."""
    out: list[int] = []
    for b in blocks:
        if b.shot_start or not out:
            out.append(0)
        out[-1] += b.latent_frames
    return out


@given(scenes_st, st.integers(1, 4), st.data())
def test_no_steer_makes_a_shot_outgrow_the_videos_bound(scenes, fpb, data):
    """`most_held_frames` bounds every shot of a fixed-length video through any steers, as the
    scheduler makes them (the rest of the video as one new scene, cut or continue), so a KV
    cache allocated for it at open never has to evict what a full window would have held."""
    blocks = plan_blocks(scenes, fpb, 4)
    bound = most_held_frames(blocks)
    assert max(shots(blocks)) <= bound
    total = sum(sc.frames for sc in scenes)
    for _ in range(data.draw(st.integers(0, 3))):
        at = data.draw(st.integers(1, len(blocks)))
        if at >= len(blocks) or blocks[at].start_frame >= total:
            break
        new = Scene("steer", total - blocks[at].start_frame, data.draw(st.sampled_from(["cut", "continue"])))
        scenes, blocks = replan_from(scenes, blocks, at, new, fpb, 4)
        assert max(shots(blocks)) <= bound


def test_a_cache_holds_the_window_or_a_shorter_video_and_never_less_than_the_sinks_and_a_block():
    assert cache_frames(21, 3, 0) == 21  # a live video: the window
    assert cache_frames(21, 3, 9) == 9  # a 33-frame video of blocks of 3
    assert cache_frames(21, 3, 81) == 21
    assert cache_frames(12, 6, 3) == 6  # sinks 3 + a block of 3
    # 33 frames: 9 latent frames in 3 blocks; from an image, its latent frame is a block of its own
    assert most_held_frames(plan_blocks([Scene("", 33)], 3, 4)) == 9
    assert most_held_frames(plan_blocks([Scene("", 33, image=b"png")], 3, 4)) == 10
    assert most_held_frames(plan_blocks([Scene("a", 1), Scene("b", 1, "continue")], 3, 4)) == 6  # every block
