"""A conversation's turn index object (`pipeline.store.objects.turn_index`): its round trip, its
content-addressed key, and every way a stored one can be unusable, each refused with
`TurnIndexUnavailable` naming the object, never another exception and never a large
allocation a header asks for."""

from __future__ import annotations

import json
import tracemalloc
from dataclasses import replace

import numpy as np
import pytest

from pipeline.store.backends.local import LocalStore
from pipeline.store.objects import turn_index as turn_index_module
from pipeline.store.objects.turn_index import (
    IndexedTurn,
    TurnIndex,
    TurnIndexUnavailable,
    parse,
    read_turn_index,
    serialize,
    store_turn_index,
    turn_index_key,
)
from tests.support.stores import tiny_turn_index

FP = "0123456789abcdef0123"  # an encoder fingerprint (the key keeps 16 hex digits)


@pytest.fixture
def store(tmp_path) -> LocalStore:
    return LocalStore(tmp_path / "store")


def assert_same(got: TurnIndex, want: TurnIndex) -> None:
    assert (got.conversation_id, got.encoder_id, got.encoder_fingerprint, got.turns) == \
        (want.conversation_id, want.encoder_id, want.encoder_fingerprint, want.turns)
    assert got.embeddings.dtype == np.float16
    np.testing.assert_array_equal(got.embeddings, want.embeddings)


def test_serialize_and_parse_round_trip():
    index = tiny_turn_index("conv-1", FP, turns=5, dim=8)
    odd = IndexedTurn("t-ü", 7, "[Tuesday 3 June — session 7]", 'user: "quotes", émoji 🙂\nline')
    index = TurnIndex(index.conversation_id, index.encoder_id, FP, (*index.turns[:4], odd),
                      index.embeddings)
    assert_same(parse(serialize(index), "x"), index)


def test_token_spans_round_trip_and_a_format_1_index_reads_without_them():
    """Format 2 keeps each turn's token span (a turn may have none); a format-1 object, written
    before spans, still reads, its turns with no span."""
    index = tiny_turn_index("conv-1", FP, turns=3, dim=8)
    spanned = TurnIndex(index.conversation_id, index.encoder_id, FP, (
        replace(index.turns[0], span=(7, 19)), replace(index.turns[1], span=(19, 19)),
        index.turns[2]), index.embeddings)
    assert_same(parse(serialize(spanned), "x"), spanned)
    data = serialize(index)
    length = int.from_bytes(data[:8], "little")
    safetensors = json.loads(data[8:8 + length])
    header = json.loads(safetensors["__metadata__"]["index"])
    header |= {"format": 1, "turns": [row[:4] for row in header["turns"]]}
    meta = json.dumps({**safetensors, "__metadata__": {"index": json.dumps(header)}}).encode()
    meta += b" " * (-len(meta) % 8)
    old = parse(len(meta).to_bytes(8, "little") + meta + data[8 + length:], "old")
    assert old.turns == index.turns and all(t.span is None for t in old.turns)


def test_store_and_read_round_trip_under_a_key_of_its_content(store):
    index = tiny_turn_index("conv-1", FP)
    stored = store_turn_index(index, store)
    assert stored.key == turn_index_key("conv-1", FP, stored.sha256) == \
        f"turns/conv-1/{FP[:16]}/index-{stored.sha256[:16]}.safetensors"
    assert stored.size == len(store.get(stored.key))
    assert stored.fields() == {"turn_index_key": stored.key, "turn_index_sha256": stored.sha256,
                               "turn_index_bytes": stored.size}
    assert_same(read_turn_index(store, stored, "conv-1", FP), index)
    assert_same(read_turn_index(store, stored, "conv-1", None), index)  # no fingerprint to bind
    assert store_turn_index(index, store) == stored  # the same content, the same object
    grown = tiny_turn_index("conv-1", FP, turns=4)
    assert store_turn_index(grown, store).key != stored.key  # written beside, never over it


BROKEN = {  # how the stored bytes (or the read) go wrong, and what the refusal says
    "missing": (None, "is missing from the store"),
    "truncated": (lambda d: d[: len(d) // 2], r"holds \d+ bytes, its manifest says \d+"),
    "longer": (lambda d: d + b"\0", r"holds \d+\+ bytes, its manifest says \d+"),
    "bit flipped": (lambda d: d[:-3] + bytes([d[-3] ^ 0x01]) + d[-2:], "failed its checksum"),
}


@pytest.mark.parametrize("how", BROKEN)
def test_a_damaged_object_is_refused_naming_its_key(how, store):
    stored = store_turn_index(tiny_turn_index("conv-1", FP), store)
    change, message = BROKEN[how]
    if change is None:
        store.delete(stored.key)
    else:
        store.put(stored.key, change(store.get(stored.key)))
    with pytest.raises(TurnIndexUnavailable, match=f"^turn index {stored.key} {message}"):
        read_turn_index(store, stored, "conv-1", FP)


def test_an_index_of_another_conversation_or_encoder_is_refused(store):
    stored = store_turn_index(tiny_turn_index("conv-1", FP), store)
    with pytest.raises(TurnIndexUnavailable, match=f"^turn index {stored.key} belongs to "
                                                   "conversation 'conv-1', not 'conv-2'"):
        read_turn_index(store, stored, "conv-2", FP)
    other = "fedcba9876543210fedc"
    with pytest.raises(TurnIndexUnavailable, match=f"^turn index {stored.key} was embedded with "
                                                   rf"other encoder files \({FP}\)"):
        read_turn_index(store, stored, "conv-1", other)


def test_every_truncation_and_a_bad_header_raise_turn_index_unavailable():
    """Whatever the bytes, the parse refuses them with the one error naming the object: every
    prefix of a good object, a header that is not JSON, a turn list of the wrong shape, another
    format, an embeddings tensor that does not match the turns."""
    index = tiny_turn_index("conv-1", FP)
    data = serialize(index)
    for cut in range(0, len(data), 7):
        with pytest.raises(TurnIndexUnavailable, match="^turn index obj is corrupt: "):
            parse(data[:cut], "obj")
    length = int.from_bytes(data[:8], "little")
    safetensors = json.loads(data[8:8 + length])
    fields = json.loads(safetensors["__metadata__"]["index"])

    def raw(header) -> bytes:
        """The object with another safetensors header (the tensor's bytes unchanged)."""
        meta = json.dumps(header).encode()
        meta += b" " * (-len(meta) % 8)
        return len(meta).to_bytes(8, "little") + meta + data[8 + length:]

    def rewritten(index: str) -> bytes:
        return raw({**safetensors, "__metadata__": {"index": index}})

    def with_fields(**changes) -> bytes:
        return rewritten(json.dumps({**fields, **changes}))

    assert parse(with_fields(), "obj").turns == index.turns  # the rewriting keeps a good one
    for bad, why in [(rewritten("not json"), "JSONDecodeError"),
                     (rewritten("[]"), "TypeError"),
                     (raw([safetensors]), "AttributeError"),
                     (raw({k: v for k, v in safetensors.items() if k != "__metadata__"}),
                      "KeyError"),
                     (with_fields(turns=[["t", 0, "d"]]), "ValueError"),
                     (with_fields(turns={"a": 1}), "not a list"),
                     (with_fields(format=3), "format 3, this reader reads 1, 2"),
                     (with_fields(turns=[["t", 0, "d", "l", 0, 4]] * 2), "2 turns need"),
                     (with_fields(turns=[["t", 0, "d", "l"]]), "4 fields, format 2 has 6"),
                     (with_fields(turns=[["t", 0, "d", "l", 3, None]]), "half a span"),
                     (with_fields(turns=[["t", 0, "d", "l", 5, 3]]), r"span \[5, 3\]"),
                     (data[:8] + b"[" + data[9:], "JSONDecodeError")]:
        with pytest.raises(TurnIndexUnavailable, match=f"^turn index obj is corrupt: .*{why}"):
            parse(bad, "obj")


def test_a_header_claiming_a_huge_length_is_refused_without_allocating_it(monkeypatch):
    data = serialize(tiny_turn_index("conv-1", FP))
    huge = (2**62).to_bytes(8, "little") + data[8:]
    tracemalloc.start()
    try:
        with pytest.raises(TurnIndexUnavailable, match=r"^turn index obj is corrupt: .*its "
                                                       r"header claims 4,611,686,018,427,387,904"):
            parse(huge, "obj")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 2**20
    monkeypatch.setattr(turn_index_module, "MAX_TURNS", 2)  # a turn list past the limit
    with pytest.raises(TurnIndexUnavailable, match="at most 2 turns"):
        parse(data, "obj")


def test_a_manifest_claiming_a_huge_index_is_refused_before_reading():
    from pipeline.store.backends.memory import MemoryStore
    from pipeline.store.objects.turn_index import MAX_INDEX_BYTES, StoredIndex, read_turn_index

    store = MemoryStore("huge-index-claim")
    try:
        claim = StoredIndex("turns/c/f/index-0.safetensors", "0" * 64, MAX_INDEX_BYTES + 1)
        with pytest.raises(TurnIndexUnavailable, match="claims"):
            read_turn_index(store, claim, "c", None)
    finally:
        store.drop()
