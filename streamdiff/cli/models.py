"""`streamdiffd models`: the published checkpoints' presets (models/catalog.py), as a table or JSON."""

from __future__ import annotations

import argparse
import json

from ..models.catalog import CHECKPOINT_PRESETS, table


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(
        prog="streamdiffd models",
        description="The published causal Wan checkpoints this daemon runs as their authors run them "
        "(streamdiffd --preset NAME --model WAN_DIR --dit-checkpoint FILE).",
    )
    ap.add_argument("--json", action="store_true", help="one JSON object per preset, one per line")
    a = ap.parse_args(argv)
    if a.json:
        for p in CHECKPOINT_PRESETS.values():
            print(json.dumps(p.to_json()))
    else:
        print(table())
    return 0
