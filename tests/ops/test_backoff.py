"""The restart back-off: exponential while a worker keeps dying, and forgotten once it has
stayed up (one restart that happens to follow a long-past crash loop waits for nothing)."""

from __future__ import annotations

from streamdiff.supervisor.workers import MAX_BACKOFF_S, WorkerState, note_death


def test_back_off_grows_in_a_crash_loop_and_decays_after_stable_uptime():
    w = WorkerState(spec=None)
    t, delays = 1000.0, []
    for _ in range(9):  # dies within seconds of every start
        delays.append(note_death(w, t, reset_s=300))
        w.ready_since = t + 1
        t += 5
    assert delays == [0.0, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, MAX_BACKOFF_S, MAX_BACKOFF_S]
    # Up for ten minutes, then one death: no back-off, and the count starts again.
    w.ready_since = t
    assert note_death(w, t + 600, reset_s=300) == 0.0
    w.ready_since = t + 601
    assert note_death(w, t + 605, reset_s=300) == 0.5
    # A death before it ever became ready again keeps counting.
    assert note_death(w, t + 606, reset_s=300) == 1.0
