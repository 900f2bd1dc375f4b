"""The strict JSON contract (snapshot/files/strict_json.py) and its two users' errors.

Random and mutated headers are fuzzed in tests/unit/test_fuzz.py; here each rule of the contract
is tried once, by name.
"""

from __future__ import annotations

import pytest

from elastic_ddp.snapshot.exchange.transport import FrameError, parse_header
from elastic_ddp.snapshot.files.errors import SnapshotError
from elastic_ddp.snapshot.files.file_layout import SnapshotHeader
from elastic_ddp.snapshot.files.strict_json import StrictJSONError, encode_object, parse_object

REFUSED = {
    "bad UTF-8": b'{"a": "\xff"}',
    "UTF-16": '{"a": 1}'.encode("utf-16"),
    "a BOM": b'\xef\xbb\xbf{"a": 1}',
    "NaN": b'{"a": NaN}',
    "Infinity": b'{"a": Infinity}',
    "-Infinity": b'{"a": -Infinity}',
    "a float overflow": b'{"a": 1e999}',
    "not JSON": b'{"a": 1',
    "two documents": b'{"a": 1} {"b": 2}',
    "too deep": b'{"a":' * 100_000,
    "empty": b"",
}


@pytest.mark.parametrize("raw", REFUSED.values(), ids=REFUSED.keys())
def test_what_is_not_strict_json_is_refused_as_not_json(raw):
    with pytest.raises(StrictJSONError, match=r"^not JSON \(\w+\)$"):
        parse_object(raw)


@pytest.mark.parametrize(("raw", "kind"), [(b"[1, 2]", "list"), (b"null", "NoneType"), (b'"text"', "str"),
                                           (b"3", "int")])
def test_a_document_that_is_not_an_object_is_refused_by_its_kind(raw, kind):
    with pytest.raises(StrictJSONError, match=f"^a JSON {kind}, not an object$"):
        parse_object(raw)


def test_an_object_reads_back_as_written():
    document = {"step": 12, "wall_time": 1.5e9, "name": "é", "nested": {"list": [1, -2.5, None, True]}}
    raw = encode_object(document)
    assert raw.isascii() and b" " not in raw
    assert parse_object(raw) == document


def test_the_writer_refuses_what_the_reader_would_refuse():
    with pytest.raises(ValueError):
        encode_object({"a": float("nan")})


def test_each_user_names_its_input_and_raises_its_own_error():
    with pytest.raises(FrameError, match=r"^frame header is not JSON \(ValueError\)$"):
        parse_header(b'{"a": NaN}')
    with pytest.raises(FrameError, match="^frame header is a JSON list, not an object$"):
        parse_header(b"[]")
    with pytest.raises(SnapshotError, match=r"^snap\.pt: its header is not JSON \(JSONDecodeError\)$"):
        SnapshotHeader.from_bytes(b"{", "snap.pt")
    with pytest.raises(SnapshotError, match="^snap.pt: its header is a JSON list, not an object$"):
        SnapshotHeader.from_bytes(b"[]", "snap.pt")
