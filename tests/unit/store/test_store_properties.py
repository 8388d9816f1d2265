"""Property-based: the manifest reader, given random bytes, cut or bit-flipped manifests and
Parquet files whose columns hold the wrong types, raises only `ManifestError`, and what it does
return is well typed; the cache reader, given cut or bit-flipped objects, raises only
`CacheCorruptError` (and with the checksum, always raises)."""

from __future__ import annotations

import io

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lab.rehearsal import SYNTHETIC_CONFIG, synthetic_cache
from pipeline.store.catalogue.manifest import MANIFEST_SCHEMA, ManifestError, parse_manifest
from pipeline.store.objects import cache_format
from pipeline.store.objects.cache_format import CacheCorruptError
from tests.support.stores import put_conversation

FAST = settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
KEY, URI = "manifests/c.parquet", "file:///store"


class _Memory:
    """Just enough of a store for `put_conversation`."""
    uri = URI

    def __init__(self):
        self.objects = {}

    def put(self, key, data):
        self.objects[key] = data

    def get(self, key):
        return self.objects[key]


def _good_manifest() -> bytes:
    store = _Memory()
    put_conversation(store, "c")
    return store.get(KEY)


GOOD = _good_manifest()
CACHE = synthetic_cache("c", 0, 4, SYNTHETIC_CONFIG)


def _flipped(data: bytes, bits: list[int]) -> bytes:
    out = bytearray(data)
    for bit in bits:
        out[bit // 8 % len(out)] ^= 1 << (bit % 8)
    return bytes(out)


def _parquet(table: pa.Table) -> bytes:
    sink = io.BytesIO()
    pq.write_table(table, sink)
    return sink.getvalue()


def _read_manifest_bytes(data: bytes) -> None:
    """Raises `ManifestError`, or returns records whose fields hold their declared types."""
    try:
        records = parse_manifest(data, KEY, URI)
    except ManifestError as e:
        assert str(e).startswith(f"manifest {KEY!r} in store {URI} is corrupt: ")
        return
    for r in records:
        assert isinstance(r.conversation_id, str) and isinstance(r.episode, int)
        assert isinstance(r.object_key, str) and isinstance(r.sha256, str)
        assert r.object_bytes is None or isinstance(r.object_bytes, int)


@FAST
@given(st.binary(max_size=2048))
def test_random_bytes_are_a_manifest_error(data):
    _read_manifest_bytes(data)


@FAST
@given(st.integers(0, len(GOOD) - 1), st.lists(st.integers(0, 8 * len(GOOD) - 1), max_size=4))
def test_cut_or_flipped_manifests_are_a_manifest_error(cut, bits):
    _read_manifest_bytes(GOOD[:cut])
    _read_manifest_bytes(_flipped(GOOD, bits))


COLUMN_VALUES = st.sampled_from([
    pa.array(["x", "y"]), pa.array([1, 2], pa.int64()), pa.array([None, None], pa.string()),
    pa.array([1.5, -2.0]), pa.array([True, False]), pa.array([[1], []], pa.list_(pa.int32())),
    pa.array([2**40, -1], pa.int64()), pa.array([None, 3], pa.int32())])


@FAST
@given(st.lists(st.tuples(st.sampled_from(MANIFEST_SCHEMA.names), COLUMN_VALUES), min_size=1,
                max_size=4))
def test_columns_of_the_wrong_type_are_a_manifest_error(changes):
    """A Parquet file with the manifest's columns, some replaced by a column of another type
    (or of nulls): read as a manifest only where every value still has its field's type."""
    table = pq.read_table(pa.BufferReader(GOOD))
    for name, values in changes:
        table = table.set_column(table.column_names.index(name), name, values)
    _read_manifest_bytes(_parquet(table))


@FAST
@given(st.integers(0, len(CACHE) - 1), st.lists(st.integers(0, 8 * len(CACHE) - 1), min_size=1,
                                                 max_size=4))
def test_cut_or_flipped_caches_are_a_cache_corrupt_error(cut, bits):
    """Without a checksum a flip in the tensors' bytes parses (other numbers); anything else is
    `CacheCorruptError`. With the checksum every change is refused."""
    digest = cache_format.sha256(CACHE)
    for data in (CACHE[:cut], _flipped(CACHE, bits)):
        try:
            cache_format.parse(data, "c/0")
        except CacheCorruptError:
            pass
        if data != CACHE:
            with pytest.raises(CacheCorruptError):
                with cache_format.verifying(data, digest, "c/0"):  # as the read path parses
                    cache_format.parse(data, "c/0")
