"""The one reader of the JSON clients send (supervisor process): request bodies, the form fields
that carry JSON text (`scenes`, `controls`), WebSocket and WebRTC data-channel messages.

Python's `json` has no limits of its own a client can rely on: a document nested a few thousand
deep raises RecursionError, and an integer of thousands of digits ValueError, both of which
reached the handlers as 500s with a traceback. Here a document is scanned first, at C speed
(the strings cut out by one regular expression, the brackets' depth a cumulative sum), and
refused with one `JSONRefused` naming the limit it passes, before `json.loads` sees it:

- its size: `max_bytes` (the caller's: server.max_body_bytes, or the body limit with an image);
- its depth: server.json_max_depth, arrays and objects inside each other;
- its entries: server.json_max_entries, array elements and object members (counted by their
  separators, so the cost of everything that reads the document after is bounded too);
- its numbers: server.json_max_number_digits, the digits of one number (no field here takes more
  than a seed's 19).

The scan never decides what is valid JSON: json.loads does, afterwards, on the same text.
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass

import numpy as np

# A JSON string: a quote, then runs of plain characters or escapes, then a quote (the "unrolled
# loop" form, which the regex engine runs over a long string without backtracking).
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.S)
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
_OPEN = np.frombuffer(b"[{", np.uint8)


@dataclass(frozen=True)
class JSONLimits:
    max_bytes: int
    max_depth: int
    max_entries: int
    max_number_digits: int

    @classmethod
    def of(cls, server, max_bytes: int | None = None) -> JSONLimits:
        """The limits of a `[server]` config section (max_bytes: server.max_body_bytes unless given)."""
        _long_number(server.json_max_number_digits)  # compiled now, not at a client's first request
        return cls(
            server.max_body_bytes if max_bytes is None else max_bytes,
            server.json_max_depth,
            server.json_max_entries,
            server.json_max_number_digits,
        )


@functools.cache
def _long_number(digits: int) -> re.Pattern:
    return re.compile(rb"[0-9]{%d,}" % (digits + 1))


class JSONRefused(ValueError):
    """A document refused: `message` says why (and names the limit), `code` is the API's error code."""

    def __init__(self, message: str, code: str) -> None:
        super().__init__(message)
        self.message, self.code = message, code


def read_json(data: bytes | str, lim: JSONLimits, what: str = "the request body"):
    """`data` decoded as JSON within `lim`, or JSONRefused. `what` names it in the message."""
    raw = data.encode("utf-8", "surrogatepass") if isinstance(data, str) else bytes(data)
    if len(raw) > lim.max_bytes:
        raise JSONRefused(f"{what} is {len(raw)} bytes; the limit is {lim.max_bytes}", "json_too_large")
    bare = _STRING.sub(b'""', raw)  # what is left: brackets, separators, numbers, literals, spaces
    brackets = np.frombuffer(bare.translate(None, _NOT_BRACKETS), np.uint8)
    if brackets.size:
        depth = int(np.cumsum(np.where(np.isin(brackets, _OPEN), 1, -1)).max())
        if depth > lim.max_depth:
            raise JSONRefused(
                f"{what} nests arrays and objects {depth} deep; the limit is {lim.max_depth} (server.json_max_depth)",
                "json_too_deep",
            )
    entries = bare.count(b",") + int(np.isin(brackets, _OPEN).sum())
    if entries > lim.max_entries:
        raise JSONRefused(
            f"{what} has {entries} entries; the limit is {lim.max_entries} (server.json_max_entries)",
            "json_too_many_entries",
        )
    longest = max((len(d) for d in _long_number(lim.max_number_digits).findall(bare)), default=0)
    if longest:
        raise JSONRefused(
            f"{what} has a number of {longest} digits; the limit is {lim.max_number_digits} "
            "(server.json_max_number_digits)",
            "json_number_too_long",
        )
    try:
        return json.loads(raw or b"null")
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise JSONRefused(f"We could not parse the JSON of {what}: {exc}", "invalid_json") from None
    except (RecursionError, ValueError) as exc:  # past the scan only if the text fooled it: still refused
        raise JSONRefused(f"We could not parse the JSON of {what}: {exc}", "invalid_json") from None
