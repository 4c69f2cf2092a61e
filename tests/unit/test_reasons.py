"""The refusal reasons: one enum, the same names in docs/protocol.md, and on the wire as strings."""

from __future__ import annotations

import re
from pathlib import Path

from dipaco.protocols import messages as m
from dipaco.protocols.reasons import Reason

DOC = Path(__file__).resolve().parents[2] / "docs" / "protocol.md"


def _documented() -> set[str]:
    text = DOC.read_text()
    section = text[text.index("## 8. What is checked") : text.index("Transfer reasons (`timeout`")]
    return set(re.findall(r"^\| `([a-z-]+)` \|", section, re.M))


def test_the_enum_and_the_protocol_document_name_the_same_reasons() -> None:
    documented = _documented()
    assert len(documented) > 30
    assert {r.value for r in Reason} == documented


def test_a_reason_travels_as_its_string_and_compares_equal_to_it() -> None:
    reply = m.decode_message(m.encode_message(m.Error(reason=Reason.STALE, message="late")))
    assert reply.reason == "stale" == Reason.STALE
    assert type(reply.reason) is str  # the decoder makes no enum from the wire
    assert Reason("not-your-task") is Reason.NOT_YOUR_TASK


def test_every_reason_the_coordinator_raises_is_a_member() -> None:
    """No refusal in the coordinator's code is a bare string any more."""
    root = Path(__file__).resolve().parents[2] / "dipaco" / "coordinator"
    bare = []
    for file in root.glob("*.py"):
        for n, line in enumerate(file.read_text().splitlines(), 1):
            if re.search(r'_reject\([^,]+,\s*"|reason="[a-z-]+"', line):
                bare.append(f"{file.name}:{n}: {line.strip()}")
    assert not bare, bare
