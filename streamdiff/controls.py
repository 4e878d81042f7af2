"""Controls of an interactive world-model session: what a client sends, and what each block gets
(supervisor process and `streamdiffd generate`; no torch).

A model that takes controls names its control space (`CheckpointPreset.controls`). A control
is one JSON object with a client `seq` that increases, in one of two modes:

- **held** (the default): `{"seq", "keyboard": [keys held], "mouse": [pitch, yaw]}`. The latest
  wins. A key pressed and released between two blocks still shapes the next block (a press
  shorter than a block lasts one block), and so does a mouse move that stopped.
- **script**: `{"seq", "mode": "script", "per": "frame" | "block", "script": [entry, ...]}`, an
  entry per latent frame or per block, for deterministic replay; an entry is `{"keyboard",
  "mouse"}` or, per frame, a raw `{"camera": {"w2c": 4x4, "K": 3x3 | [fx, fy, cx, cy]}}`. When it
  runs out nothing is held.

A control lands at the first block not yet started, or at a later one it names (`"block": n`),
never inside a block: `Timeline.receive` says which, and `Timeline.block` gives each block, as
the DiT starts it, its conditioning and the newest `seq` that shaped it.

Matrix-Game's spaces (`matrix-game-*`) take the release's keys, a multi-hot in its order, and its
mouse units; each latent frame gets what is held (`action_row`).

The `camera` space is minWM's (shengshu-ai/minWM, Wan21/wan_utils/camera_trajectory.py): keys
move the camera 0.08 units or turn it 3 degrees per latent frame, composed in the camera's own
frame. A shot's frame 0 is at the identity and what is held at frame i moves the camera from
frame i-1 into frame i, so a control changes the pose of the very first frame of the block it
lands at (the authors' trajectory "w*19" is 20 frames of `w` here, the first one still). The
mouse turns it by `[pitch, yaw]` degrees per latent frame, at most the trained 3 each.
"""

from __future__ import annotations

import json
import math
from collections import deque
from dataclasses import dataclass, field

import numpy as np

MAX_SCRIPT_ENTRIES = 4096  # a script's entries (frames or blocks): minutes of video
MAX_PENDING = 64  # controls waiting for the block they name
MAX_SEQ = 2**63 - 1
STEP = 0.08  # minWM: camera units per latent frame
TURN_DEG = 3.0  # minWM: degrees per latent frame
INTRINSICS = (0.5, 0.5, 0.5, 0.5)  # minWM's inference: normalised fx, fy, cx, cy


class ControlError(ValueError):
    """A control refused: `status` (400 bad, 409 too late or out of order, 429 too many waiting),
    the field to blame."""

    def __init__(self, message: str, param: str | None = None, status: int = 400, code: str = "invalid_control"):
        super().__init__(message)
        self.message, self.param, self.status, self.code = message, param, status, code


@dataclass(frozen=True)
class Space:
    name: str
    keys: tuple[str, ...]
    mouse: bool
    camera: bool  # raw {w2c, K} entries accepted in scripts
    mouse_max: float = TURN_DEG  # the largest |pitch| or |yaw| a latent frame
    idle: str | None = None  # the key a model's multi-hot holds when nothing is held


# minWM's keys (camera_trajectory._MOTIONS): w/s forward/back, d/a right/left, u/dn up/down,
# j/l yaw left/right, i/k pitch up/down.
CAMERA = Space("camera", ("w", "s", "a", "d", "u", "dn", "j", "l", "i", "k"), mouse=True, camera=True)
# Matrix-Game 2.0's action spaces (utils/conditions.py): the keyboard multi-hot in the release's
# order, the mouse [pitch, yaw] in its units (0.1 a camera key, CAM_VALUE); Temple Run's one-hot
# always holds a key, "nomove" when nothing else is held.
MG_MOUSE = 0.1
MATRIX_GAME = {
    "matrix-game-universal": Space(
        "matrix-game-universal", ("forward", "back", "left", "right"), True, False, MG_MOUSE
    ),
    "matrix-game-gta-drive": Space("matrix-game-gta-drive", ("forward", "back"), True, False, MG_MOUSE),
    "matrix-game-templerun": Space(
        "matrix-game-templerun",
        ("nomove", "jump", "slide", "turnleft", "turnright", "leftside", "rightside"),
        False,
        False,
        0.0,
        "nomove",
    ),
}
SPACES = {s.name: s for s in (CAMERA, *MATRIX_GAME.values())}


@dataclass(frozen=True)
class Entry:
    keys: frozenset[str] = frozenset()
    mouse: tuple[float, float] = (0.0, 0.0)
    camera: tuple[float, ...] | None = None  # 16 w2c values (row-major) + fx, fy, cx, cy


@dataclass(frozen=True)
class Control:
    seq: int
    mode: str  # held | script
    held: Entry = Entry()
    script: tuple[Entry, ...] = ()
    per: str = "frame"  # frame | block
    block: int | None = None  # the block it names, or None: the first not started


# ----------------------------------------------------------------------------- parsing


def _number(v, param: str) -> float:
    if isinstance(v, bool) or not isinstance(v, int | float):
        raise ControlError(f"'{param}' must be a number, got {type(v).__name__}", param)
    x = float(v)
    if not math.isfinite(x):
        raise ControlError(f"'{param}' must be finite, got {v!r}", param)
    return x


def _keys(v, space: Space, param: str) -> frozenset[str]:
    if not isinstance(v, list) or not all(isinstance(k, str) for k in v):
        raise ControlError(f"'{param}' must be a list of key names", param)
    unknown = [k for k in v if k not in space.keys]
    if unknown:
        raise ControlError(f"'{param}': unknown key {unknown[0]!r} (this model's: {', '.join(space.keys)})", param)
    return frozenset(v)


def _mouse(v, space: Space, param: str) -> tuple[float, float]:
    if not space.mouse:
        raise ControlError(f"'{param}': this model takes no mouse", param)
    if not isinstance(v, list) or len(v) != 2:
        raise ControlError(f"'{param}' must be [pitch, yaw]", param)
    out = (_number(v[0], f"{param}[0]"), _number(v[1], f"{param}[1]"))
    if any(abs(x) > space.mouse_max for x in out):
        raise ControlError(f"'{param}': at most {space.mouse_max:g} a latent frame each, got {list(out)}", param)
    return out


_PLAIN = (int, float)  # JSON's numbers (not bool, an int's subclass)


def _matrix(v, n: int, param: str) -> list[list[float]]:
    if not isinstance(v, list) or len(v) != n or not all(isinstance(r, list) and len(r) == n for r in v):
        raise ControlError(f"'{param}' must be a {n}x{n} list of rows", param)
    if all(type(x) in _PLAIN and math.isfinite(x) for r in v for x in r):  # the common case, fast
        return [[float(x) for x in r] for r in v]
    return [[_number(x, f"{param}[{i}][{j}]") for j, x in enumerate(r)] for i, r in enumerate(v)]


def _camera(v, param: str) -> tuple[float, ...]:
    """A raw camera's 16 w2c values (row-major) and fx, fy, cx, cy; whether w2c is rigid is
    `_check_rigid`'s, for a whole script at once (per entry, numpy's checks cost 0.1 ms each:
    half a second of the event loop for a 4096-frame script)."""
    if not isinstance(v, dict) or set(v) - {"w2c", "K"} or "w2c" not in v:
        raise ControlError(f"'{param}' must be {{'w2c': 4x4, 'K'?: 3x3 or [fx, fy, cx, cy]}}", param)
    w2c = [x for row in _matrix(v["w2c"], 4, f"{param}.w2c") for x in row]
    k = v.get("K", list(INTRINSICS))
    if isinstance(k, list) and len(k) == 3:
        m = _matrix(k, 3, f"{param}.K")
        k = [m[0][0], m[1][1], m[0][2], m[1][2]]
    if not isinstance(k, list) or len(k) != 4:
        raise ControlError(f"'{param}.K' must be a 3x3 matrix or [fx, fy, cx, cy]", f"{param}.K")
    k = [_number(x, f"{param}.K[{i}]") for i, x in enumerate(k)]
    if k[0] <= 0 or k[1] <= 0:
        raise ControlError(f"'{param}.K': focal lengths must be positive, got {k[:2]}", f"{param}.K")
    return (*w2c, *k)


def _check_rigid(entries: tuple[Entry, ...]) -> None:
    """Every raw camera of a script is a rigid transform: a rotation (R R^T = I within 1e-3), a
    translation, a last row of 0 0 0 1 (as np.allclose would judge each); ControlError naming the
    first that is not."""
    at = [i for i, e in enumerate(entries) if e.camera is not None]
    if not at:
        return
    w2c = np.array([entries[i].camera[:16] for i in at]).reshape(-1, 4, 4)
    r = w2c[:, :3, :3]
    last = np.abs(w2c[:, 3] - [0, 0, 0, 1]) <= 1e-8 + 1e-5 * np.array([0, 0, 0, 1])
    ortho = np.abs(r @ r.transpose(0, 2, 1) - np.eye(3)) <= 1e-3 + 1e-5 * np.eye(3)
    bad = ~(last.all(axis=1) & ortho.all(axis=(1, 2)))
    if bad.any():
        param = f"script[{at[int(np.argmax(bad))]}].camera"
        raise ControlError(f"'{param}.w2c' is not a rigid transform (rotation, translation, last row 0 0 0 1)", param)


def _entry(v, space: Space, param: str, per: str) -> Entry:
    """An entry of a script (`param` script[i]) or a held control's keys and mouse (`param` "")."""
    at = f"{param}." if param else ""
    if not isinstance(v, dict):
        raise ControlError(f"'{param}' must be an object", param)
    unknown = set(v) - {"keyboard", "mouse", "camera"}
    if unknown:
        raise ControlError(f"'{param}': unknown field {sorted(unknown)[0]!r}", param)
    if "camera" in v:
        if not space.camera:
            raise ControlError(f"'{at}camera': this model takes no raw camera", f"{at}camera")
        if per != "frame" or len(v) != 1:
            raise ControlError(f"'{at}camera' is a latent frame's pose alone (a script per frame)", param)
        return Entry(camera=_camera(v["camera"], f"{at}camera"))
    keys = _keys(v.get("keyboard", []), space, f"{at}keyboard")
    mouse = _mouse(v["mouse"], space, f"{at}mouse") if "mouse" in v else (0.0, 0.0)
    return Entry(keys, mouse)


def parse_control(body, space: Space | None) -> Control:
    """A control as a client sends it, checked against the model's space: a `Control`, or
    ControlError naming the field."""
    if space is None:
        raise ControlError("this model takes no controls", None, 400, "controls_unsupported")
    if not isinstance(body, dict):
        raise ControlError("a control must be a JSON object", None)
    unknown = set(body) - {"seq", "mode", "keyboard", "mouse", "script", "per", "block"}
    if unknown:
        raise ControlError(f"unknown field {sorted(unknown)[0]!r}", sorted(unknown)[0])
    seq = body.get("seq")
    if isinstance(seq, bool) or not isinstance(seq, int) or not 0 <= seq <= MAX_SEQ:
        raise ControlError(f"'seq' must be an integer in [0, 2^63), got {seq!r}", "seq")
    block = body.get("block")
    if block is not None and (isinstance(block, bool) or not isinstance(block, int) or block < 0):
        raise ControlError(f"'block' must be a block number >= 0, got {block!r}", "block")
    mode = body.get("mode", "held")
    if mode == "held":
        if "script" in body or "per" in body:
            raise ControlError("'script' and 'per' belong to mode 'script'", "mode")
        return Control(seq, mode, _entry({k: body[k] for k in ("keyboard", "mouse") if k in body}, space, "", "block"),
                       block=block)  # fmt: skip
    if mode != "script":
        raise ControlError(f"'mode' must be 'held' or 'script', got {mode!r}", "mode")
    if "keyboard" in body or "mouse" in body:
        raise ControlError("a script's keys and mouse go in its entries", "mode")
    per = body.get("per", "frame")
    if per not in ("frame", "block"):
        raise ControlError(f"'per' must be 'frame' or 'block', got {per!r}", "per")
    script = body.get("script")
    if not isinstance(script, list) or not script:
        raise ControlError("'script' must be a non-empty list of entries", "script")
    if len(script) > MAX_SCRIPT_ENTRIES:
        raise ControlError(f"'script' has {len(script)} entries; at most {MAX_SCRIPT_ENTRIES}", "script")
    entries = tuple(_entry(e, space, f"script[{i}]", per) for i, e in enumerate(script))
    _check_rigid(entries)
    return Control(seq, mode, script=entries, per=per, block=block)


# ----------------------------------------------------------------------------- the pose


def _rot_x(a: float) -> np.ndarray:
    c, s = np.cos(a), np.sin(a)
    return np.array([[1, 0, 0], [0, c, -s], [0, s, c]])


def _rot_y(a: float) -> np.ndarray:
    c, s = np.cos(a), np.sin(a)
    return np.array([[c, 0, s], [0, 1, 0], [-s, 0, c]])


def move(c2w: np.ndarray, entry: Entry) -> np.ndarray:
    """The camera-to-world pose after one latent frame of `entry` held, in minWM's order: yaw,
    then pitch, then forward, right and up along the turned camera's axes (opposite keys cancel)."""
    k = entry.keys
    yaw = TURN_DEG * (("l" in k) - ("j" in k)) + entry.mouse[1]
    pitch = TURN_DEG * (("i" in k) - ("k" in k)) + entry.mouse[0]
    out = c2w.copy()
    if yaw:
        out[:3, :3] = out[:3, :3] @ _rot_y(np.radians(yaw))
    if pitch:
        out[:3, :3] = out[:3, :3] @ _rot_x(np.radians(pitch))
    forward = STEP * (("w" in k) - ("s" in k))
    right = STEP * (("d" in k) - ("a" in k))
    up = STEP * (("u" in k) - ("dn" in k))
    for amount, axis in ((forward, (0, 0, 1)), (right, (1, 0, 0)), (up, (0, -1, 0))):  # up is -Y (OpenCV)
        if amount:
            out[:3, 3] += out[:3, :3] @ (amount * np.array(axis, dtype=np.float64))
    return out


def camera_row(w2c: np.ndarray, intrinsics=INTRINSICS) -> list[float]:
    """A latent frame's camera as GenerateBlock carries it: w2c (float32, row-major), fx, fy, cx, cy."""
    return [*w2c.astype(np.float32).reshape(-1).tolist(), *map(float, intrinsics)]


# ----------------------------------------------------------------------------- a session's timeline


@dataclass
class BlockControl:
    seq: int | None  # the newest control that shaped the block
    camera: list[list[float]] = field(default_factory=list)  # per latent frame (camera spaces)
    # per latent frame, action spaces: the keyboard multi-hot then, with a mouse, pitch and yaw
    actions: list[list[float]] = field(default_factory=list)


def action_row(space: Space, e: Entry) -> list[float]:
    """A latent frame's action as GenerateBlock carries it: the multi-hot in the space's key
    order (its idle key where nothing is held), then the mouse if the space has one."""
    keys = e.keys or (frozenset({space.idle}) if space.idle else frozenset())
    return [float(k in keys) for k in space.keys] + (list(e.mouse) if space.mouse else [])


class Timeline:
    """One session's controls: those waiting for their block, the state held, a script running,
    and (camera spaces) the pose. `block` is called once per block, in order, as the DiT starts it."""

    def __init__(self, space: Space) -> None:
        self.space = space
        self.pending: list[tuple[int, Control]] = []  # (landing block, control), in arrival order
        self.last_seq: int | None = None  # the newest received
        self.seq: int | None = None  # the newest applied
        self.held = Entry()
        self.pulse_keys: set[str] = set()  # keys pressed since the last block
        self.pulse_mouse: tuple[float, float] | None = None  # the last mouse move since the last block
        self.script: deque[Entry] = deque()
        self.per = "frame"
        self.c2w = np.eye(4)  # the pose of the last frame given out
        self.shot_frame = 0  # frames given out in this shot

    def receive(self, c: Control, first_unstarted: int) -> int:
        """Queue `c`; returns the block where it lands, or ControlError (409: a seq not after the
        last, a block already started; 429: too many waiting)."""
        if self.last_seq is not None and c.seq <= self.last_seq:
            raise ControlError(f"'seq' {c.seq} is not after {self.last_seq}", "seq", 409, "seq_not_increasing")
        if c.block is not None and c.block < first_unstarted:
            why = f"block {c.block} has started; the first not started is {first_unstarted}"
            raise ControlError(why, "block", 409, "block_started")
        if len(self.pending) >= MAX_PENDING:
            raise ControlError(f"{MAX_PENDING} controls are waiting for their blocks", None, 429, "too_many_pending")
        at = first_unstarted if c.block is None else c.block
        if c.block is None and self.pending and c.mode == "held":  # coalesced: the latest held state wins
            self._fold_pulses(at)
        self.pending.append((at, c))
        self.last_seq = c.seq
        return at

    def _fold_pulses(self, at: int) -> None:
        """Held controls waiting for block `at` replaced by their keys' pulse (a flood is one entry)."""
        keep = []
        for b, c in self.pending:
            if b == at and c.mode == "held" and c.block is None:
                self.pulse_keys |= c.held.keys
                if c.held.mouse != (0.0, 0.0):
                    self.pulse_mouse = c.held.mouse
                self.seq = c.seq if self.seq is None else max(self.seq, c.seq)
            else:
                keep.append((b, c))
        self.pending = keep

    def _apply(self, c: Control) -> None:
        self.seq = c.seq if self.seq is None else max(self.seq, c.seq)
        if c.mode == "held":
            self.held, self.script = c.held, deque()
            self.pulse_keys |= c.held.keys
            if c.held.mouse != (0.0, 0.0):
                self.pulse_mouse = c.held.mouse
        else:
            self.held, self.script, self.per = Entry(), deque(c.script), c.per

    def block(self, index: int, frames: int, shot_start: bool) -> BlockControl:
        """The conditioning of block `index` (`frames` latent frames) and the seq that shaped it."""
        due = [c for b, c in self.pending if b <= index]
        self.pending = [(b, c) for b, c in self.pending if b > index]
        for c in due:
            self._apply(c)
        if shot_start:
            self.c2w, self.shot_frame = np.eye(4), 0
        pressed = Entry(
            self.held.keys | frozenset(self.pulse_keys),
            self.held.mouse if self.held.mouse != (0.0, 0.0) or self.pulse_mouse is None else self.pulse_mouse,
        )
        self.pulse_keys, self.pulse_mouse = set(), None
        if self.script and self.per == "block":
            entries = [self.script.popleft()] * frames
        else:  # a script's frames, then what is held (nothing, after a script)
            entries = [self.script.popleft() if self.script else pressed for _ in range(frames)]
        out = BlockControl(self.seq)
        if not self.space.camera:  # an action space: each latent frame's keys and mouse, as they are
            out.actions = [action_row(self.space, e) for e in entries]
            return out
        for e in entries:  # the camera: the pose integrated frame by frame
            if e.camera is not None:
                w2c = np.array(e.camera[:16], dtype=np.float64).reshape(4, 4)
                out.camera.append(camera_row(w2c, e.camera[16:]))
                self.c2w = np.linalg.inv(w2c)
            else:
                if self.shot_frame:  # a shot's first frame is where the shot starts
                    self.c2w = move(self.c2w, e)
                out.camera.append(camera_row(np.linalg.inv(self.c2w)))
            self.shot_frame += 1
        return out


CONTROL_SCHEME = "urn:streamdiff:control:2026"  # the emsg scheme of a fragment's control


def control_marker(block, seq: int) -> tuple[int, str, bytes, str]:
    """The event a world model's fragment carries (an emsg at its first frame): the newest
    control `seq` that shaped the block, with the block and its first frame."""
    info = {"seq": seq, "block": block.index, "start_frame": block.start_frame}
    return 0, str(seq), json.dumps(info).encode(), CONTROL_SCHEME
