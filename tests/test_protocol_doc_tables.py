"""docs/protocol.md §4 specifies every message exactly as the codec writes it.

Each message type has a heading ``#### <code> `<Name>``` followed by one table whose header is
``| field | key | wire type | since | default | constraints |``.  This test parses those tables and checks
them, both ways, against the codec's own tables (`protocol.codec._SCHEMA` with the invite's family
parameters, `protocol.codec.body_fields`): same message types, same fields in the same order, same body
keys, wire types and optionality.  A field the codec writes without a row, or a row naming a key the
codec does not write, fails here.
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest

from protocol import codec
from protocol.codec import _OMITTED_WHEN_EMPTY, _SCHEMA, Kind, _entries, _param_kind
from protocol.plan import known_wire_params

ROOT = Path(__file__).resolve().parents[1]
PROTOCOL_MD = ROOT / "docs" / "protocol.md"
MESSAGES_JSON = ROOT / "docs" / "test-vectors" / "messages.json"

#: The document's name for each codec wire kind (protocol.md §2.1).
WIRE_TYPE = {
    Kind.INT: "int",
    Kind.FLOAT: "float64",
    Kind.STR: "str",
    Kind.BOOL: "bool",
    Kind.BYTES: "bin",
    Kind.INTS: "array of int",
    Kind.BYTES_LIST: "array of bin",
    Kind.U32: "u32 vector",
}
HEADER = ["field", "key", "wire type", "since", "default", "constraints"]
_HEADING = re.compile(r"^#### (\d+) `(\w+)`")
_CODE = re.compile(r"^`([^`]+)`$")


@dataclasses.dataclass(frozen=True)
class Row:
    name: str
    key: str
    wire_type: str
    since: str
    required: bool
    omitted_when_empty: bool


def _cells(line: str) -> list[str]:
    """A Markdown table row's cells (``\\|`` is a literal bar inside a cell)."""
    return [c.strip().replace("\0", "|") for c in line.strip().replace("\\|", "\0").strip("|").split("|")]


def _unquote(cell: str, what: str) -> str:
    match = _CODE.match(cell)
    assert match, f"protocol.md §4: {what} cell {cell!r} is not one `code` span"
    return match.group(1)


def parse_tables(text: str) -> dict[int, tuple[str, list[Row]]]:
    """``type code -> (message name, rows)`` of every ``#### <code> `<Name>``` section's field table."""
    out: dict[int, tuple[str, list[Row]]] = {}
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        heading = _HEADING.match(lines[i])
        i += 1
        if not heading:
            continue
        code, name = int(heading.group(1)), heading.group(2)
        assert code not in out, f"protocol.md: two sections for type {code}"
        while i < len(lines) and not lines[i].startswith("|") and not lines[i].startswith("#"):
            i += 1
        assert i < len(lines) and lines[i].startswith("|"), f"protocol.md: type {code} {name} has no field table"
        assert _cells(lines[i]) == HEADER, f"protocol.md: type {code} {name}: table header {_cells(lines[i])}"
        i += 2  # header and |---| line
        rows: list[Row] = []
        while i < len(lines) and lines[i].startswith("|"):
            cells = _cells(lines[i])
            assert len(cells) == len(HEADER), f"protocol.md: type {code} {name}: row {lines[i]!r}"
            default = cells[4]
            rows.append(
                Row(
                    name=_unquote(cells[0], "field"),
                    key=_unquote(cells[1], "key"),
                    wire_type=cells[2],
                    since=cells[3],
                    required=default == "required",
                    omitted_when_empty="omitted when empty" in default,
                )
            )
            i += 1
        out[code] = (name, rows)
    return out


def codec_rows() -> dict[int, tuple[str, list[tuple[str, str, str, bool, bool]]]]:
    """``type code -> (class name, [(field, key, wire type, required, omitted when empty)])`` from the codec."""
    out = {}
    params = known_wire_params()
    for code, (cls, listed) in _SCHEMA.items():
        defaults = {f.name for f in dataclasses.fields(cls) if f.default is not dataclasses.MISSING}  # type: ignore[arg-type]
        defaults |= {f.name for f in dataclasses.fields(cls) if f.default_factory is not dataclasses.MISSING}  # type: ignore[arg-type]
        rows = []
        for item in _entries(listed):
            if isinstance(item, str):  # a family parameter of the invite: always optional
                rows.append((params[item].name, item, WIRE_TYPE[_param_kind(item)], False, False))
            else:
                name, key, kind = item
                rows.append((name, key, WIRE_TYPE[kind], name not in defaults, (code, key) in _OMITTED_WHEN_EMPTY))
        out[code] = (cls.__name__, rows)
    return out


@pytest.fixture(scope="module")
def doc() -> dict[int, tuple[str, list[Row]]]:
    return parse_tables(PROTOCOL_MD.read_text(encoding="utf-8"))


def test_every_message_type_has_a_table_and_no_other(doc: dict[int, tuple[str, list[Row]]]) -> None:
    want = {code: name for code, (name, _) in codec_rows().items()}
    got = {code: name for code, (name, _) in doc.items()}
    assert got == want


@pytest.mark.parametrize("code", sorted(_SCHEMA))
def test_table_matches_the_codec(doc: dict[int, tuple[str, list[Row]]], code: int) -> None:
    name, want = codec_rows()[code]
    rows = doc[code][1]
    documented = [(r.name, r.key, r.wire_type, r.required, r.omitted_when_empty) for r in rows]
    missing = [w for w in want if w[1] not in {r.key for r in rows}]
    extra = [r.key for r in rows if r.key not in {w[1] for w in want}]
    assert not missing, f"{name}: the codec writes fields protocol.md §4 does not list: {missing}"
    assert not extra, f"{name}: protocol.md §4 lists keys the codec does not write: {extra}"
    assert documented == want, f"{name}: protocol.md §4 rows differ from the codec (name, key, type, required, omitted)"


def test_since_column_matches_the_vectors(doc: dict[int, tuple[str, list[Row]]]) -> None:
    vectors = json.loads(MESSAGES_JSON.read_text(encoding="utf-8"))["messages"]
    for message in vectors:
        rows = {r.key: r.since for r in doc[message["type_code"]][1]}
        for field in message["fields"]:
            assert rows[field["key"]] == field["since"], f"{message['type']}.{field['name']}: since differs"


def test_encoder_omits_only_the_documented_fields(doc: dict[int, tuple[str, list[Row]]]) -> None:
    omitted = {(code, r.key) for code, (_, rows) in doc.items() for r in rows if r.omitted_when_empty}
    assert omitted == set(_OMITTED_WHEN_EMPTY)
    assert codec.encode  # the rule lives in codec.encode; §2 names the same set


def test_parser_sees_a_fake_row(doc: dict[int, tuple[str, list[Row]]]) -> None:
    # The parser is not vacuous: a table with a row the codec lacks is told apart.
    text = PROTOCOL_MD.read_text(encoding="utf-8")
    anchor = "| `model_version` | `mv` | int | 1.1 | 0 | version held, 0 = none |\n"
    assert anchor in text
    fake = text.replace(anchor, anchor + "| `fake` | `zz` | int | 1.7 | 0 | not a field |\n")
    rows = parse_tables(fake)[13][1]
    assert [r.key for r in rows] == ["d", "mv", "zz"]
    assert len(doc[13][1]) == 2
