"""A ticket's life cycle (supervisor/scheduler/tickets.py `advance`): every legal transition is
accepted and leaves the ticket holding exactly the slots its new state owns; any other is
refused, naming the block and both states."""

from __future__ import annotations

import pytest

from streamdiff.ipc.shm import SlotPool
from streamdiff.plan import Scene, plan_blocks
from streamdiff.supervisor.scheduler.tickets import (
    FINAL,
    NEXT,
    OWNS,
    T_CANCELLED,
    T_DIT,
    T_EMITTED,
    T_FAILED,
    T_FRAMES,
    T_LATENT,
    T_QUEUED,
    T_VAE,
    Ticket,
    TicketError,
    advance,
)

FORWARD = [T_QUEUED, T_DIT, T_LATENT, T_VAE, T_FRAMES, T_EMITTED]
STATES = [*FORWARD, T_CANCELLED, T_FAILED]


def ticket_in(state: str, latent: SlotPool, frames: SlotPool) -> Ticket:
    """A fresh ticket walked forward to `state` (or to the state before a final one)."""
    t = Ticket(plan_blocks([Scene("p", 16)], 3, 4)[0])
    for s in FORWARD[1 : FORWARD.index(state) + 1] if state in FORWARD else []:
        advance(t, s, latent, frames)
    return t


def holds(t: Ticket) -> tuple[str, ...]:
    return tuple(k for k, slot in (("latent", t.latent_slot), ("frame", t.frame_slot)) if slot is not None)


def test_the_forward_path_takes_and_gives_each_states_slots():
    latent, frames = SlotPool(2), SlotPool(2)
    t = ticket_in(T_QUEUED, latent, frames)
    for state in FORWARD[1:]:
        advance(t, state, latent, frames)
        assert t.state == state
        assert holds(t) == OWNS[state]
        assert latent.used == ("latent" in OWNS[state]) and frames.used == ("frame" in OWNS[state])
    assert latent.used == frames.used == 0


@pytest.mark.parametrize("start", [s for s in STATES if s not in FINAL])
@pytest.mark.parametrize("end", [T_CANCELLED, T_FAILED])
def test_every_live_state_may_end_and_gives_back_its_slots(start, end):
    latent, frames = SlotPool(2), SlotPool(2)
    t = ticket_in(start, latent, frames)
    t.encoding = start == T_FRAMES  # an encode out: ending clears it
    advance(t, end, latent, frames)
    assert (t.state, holds(t), t.encoding) == (end, (), False)
    assert latent.used == frames.used == 0


@pytest.mark.parametrize("start", STATES)
@pytest.mark.parametrize("to", STATES)
def test_any_other_transition_is_refused(start, to):
    if to in NEXT[start]:
        return
    latent, frames = SlotPool(2), SlotPool(2)
    t = ticket_in(start, latent, frames) if start in FORWARD else ticket_in(T_QUEUED, latent, frames)
    if start not in FORWARD:
        advance(t, start, latent, frames)
    before = (t.state, holds(t), latent.used, frames.used)
    with pytest.raises(TicketError, match=f"block 0: a ticket does not go from {start} to {to}"):
        advance(t, to, latent, frames)
    assert (t.state, holds(t), latent.used, frames.used) == before  # refused: nothing moved


def test_the_table_is_the_life_cycle():
    """Forward one stage at a time, out from any live state, nothing from a final one."""
    for i, state in enumerate(FORWARD[:-1]):
        assert set(NEXT[state]) == {FORWARD[i + 1], T_CANCELLED, T_FAILED}
    assert all(NEXT[s] == () for s in FINAL)
    assert set(NEXT) == set(OWNS) == set(STATES)
