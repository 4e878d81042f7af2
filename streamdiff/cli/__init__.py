"""`streamdiffd`: the command line. The first word picks the command; each lives in a module of
its own here, and takes its flags and their mapping to the config from `streamdiff.flags`.

    streamdiffd [FLAGS]            the daemon (daemon.py)
    streamdiffd generate ...       one video to a file, no server (generate.py)
    streamdiffd profile|plan ...   measure the stages, rank layouts (placement.py)
    streamdiffd models             the published checkpoints' presets (models.py)
"""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "models":
        from .models import main as models_main

        return models_main(argv[1:])
    if argv and argv[0] == "generate":
        from .generate import main as generate_main

        return generate_main(argv[1:])
    if argv and argv[0] in ("profile", "plan"):
        from .placement import main as placement_main

        return placement_main(argv)
    from .daemon import main as daemon_main

    return daemon_main(argv)
