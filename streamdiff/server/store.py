"""Finished videos on disk, for a cluster (supervisor process).

With `[store] dir` set, every video that completes is written there as `<id>.mp4` with its
video object beside it as `<id>.json`: on a filesystem the nodes share, any node can then answer
`GET /v1/videos/{id}` and `/content` (ranges included) for a finished video whatever node made
it, and a restarted node still has its own. Files are written under a temporary name and renamed,
so a reader never sees half a video; the writes run off the event loop.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

_ID = re.compile(r"^video_[0-9a-f]{24}_[a-z0-9-]{1,63}$")


def node_of(video_id: str) -> str | None:
    """The node that issued `video_id` (ids are `video_<hex>_<node>`), or None for another form."""
    return video_id.rsplit("_", 1)[1] if _ID.match(video_id) else None


class VideoStore:
    def __init__(self, directory: str) -> None:
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)

    def _paths(self, video_id: str) -> tuple[Path, Path] | None:
        if not _ID.match(video_id):  # never a path built from arbitrary input
            return None
        return self.dir / f"{video_id}.mp4", self.dir / f"{video_id}.json"

    def save(self, video_id: str, chunks: list[bytes], video: dict) -> None:
        """Blocking: call from a thread."""
        paths = self._paths(video_id)
        if paths is None:
            return
        for path, write in (
            (paths[0], lambda f: f.writelines(chunks)),
            (paths[1], lambda f: f.write(json.dumps(video).encode())),
        ):
            tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
            with open(tmp, "wb") as f:
                write(f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)

    def video(self, video_id: str) -> dict | None:
        paths = self._paths(video_id)
        if paths is None or not paths[1].exists():
            return None
        try:
            return json.loads(paths[1].read_text())
        except (OSError, ValueError):
            return None

    def content(self, video_id: str) -> Path | None:
        paths = self._paths(video_id)
        return paths[0] if paths is not None and paths[0].exists() and paths[1].exists() else None

    def remove(self, video_id: str) -> None:
        paths = self._paths(video_id)
        for p in paths or ():
            p.unlink(missing_ok=True)
