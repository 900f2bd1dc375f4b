"""Strict JSON: the one reader and writer of the JSON headers that elastic_ddp reads from outside.

Two users: the header of a snapshot file (`file_layout.SnapshotHeader`) and the header of a frame
between ranks (`exchange.transport`). Both are untrusted bytes, so `parse_object` holds them to a
stricter contract than `json.loads`:

- the bytes are UTF-8 (from bytes, `json.loads` would also guess UTF-16 or UTF-32); a BOM is refused;
- the text is standard JSON: NaN, Infinity and -Infinity, which Python's json reads by default, are
  refused, and so is a number too large for a float (`1e999` would otherwise read as infinity);
- the document is one JSON object, nothing else at the top level;
- nesting too deep for the interpreter (RecursionError) is refused, never a crash.

Any refusal is a `StrictJSONError` (a ValueError) whose message reads on from "the header is"
("not JSON (JSONDecodeError)", "a JSON list, not an object"): each caller names its own input and
raises its own error type.
`encode_object` writes only what `parse_object` accepts back.

Not bounded here: the size. Each caller bounds the bytes before it reads them
(`file_layout.MAX_HEADER_BYTES`, `transport.FrameLimits`). Not checked: duplicate keys (the last
one wins) and what the object holds (each caller checks its own fields). Nothing here imports torch.
"""

from __future__ import annotations

import json
import math
from typing import Any


class StrictJSONError(ValueError):
    """Bytes that are not one strict JSON object; the message says why (see the module docstring)."""


def parse_object(raw: bytes) -> dict[str, Any]:
    """The JSON object in the UTF-8 bytes `raw`; StrictJSONError for anything else."""
    try:
        document = json.loads(raw.decode("utf-8"), parse_constant=_refuse_constant, parse_float=_finite_float)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise StrictJSONError(f"not JSON ({type(exc).__name__})") from exc
    if not isinstance(document, dict):
        raise StrictJSONError(f"a JSON {type(document).__name__}, not an object")
    return document


def encode_object(document: dict[str, Any]) -> bytes:
    """`document` as compact UTF-8 JSON; ValueError if it holds a non-finite number."""
    return json.dumps(document, separators=(",", ":"), allow_nan=False).encode()


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not allowed")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text[:40]} does not fit a float")
    return value
