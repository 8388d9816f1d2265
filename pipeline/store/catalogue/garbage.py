"""Garbage and faults of a store: what no manifest names, and what a manifest names wrongly.

Manifests are the only commit point, so a cache object or turn index that no manifest names is
an orphan (an episode or index of a failed or interrupted build, of a configuration rebuilt
since, or the version an append replaced), and so are the temporary files of a local store and
incomplete multipart uploads in S3. A manifest that cannot be read, or that names an object
that is missing (or, verified, of another size or SHA-256, or a turn index a reader would
refuse), is a fault; the objects of a conversation whose manifest is unreadable are never
orphans.
"""

from __future__ import annotations

import hashlib
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from pipeline.store.backends.base import ObjectNotFound, Partial, Store, manifest_key
from pipeline.store.catalogue.manifest import (
    ManifestError,
    ManifestRecord,
    list_conversations,
    read_manifest,
)
from pipeline.store.objects.turn_index import TurnIndexUnavailable, checked_turn_index

# Where the objects manifests name live (a conversation's under "<prefix><id>/"): caches and
# turn indexes. Anything else (profiles, the manifest table, reports) is never an orphan.
OBJECT_PREFIXES = ("caches/", "turns/")


@dataclass(frozen=True)
class Fault:
    """Something a manifest promises that the store does not hold."""
    kind: str  # one of FAULT_KINDS
    key: str  # the manifest (corrupt manifest) or the object
    detail: str


# "corrupt index": a turn index of the recorded size and SHA-256 that a reader still refuses
# (it does not parse, or it is another conversation's or encoder's)
FAULT_KINDS = ("corrupt manifest", "missing object", "wrong size", "checksum failure",
               "corrupt index")

# How `--verify` checks a named object: (store, key, manifest key, record) -> its fault or None
Check = Callable[[Store, str, str, ManifestRecord], Fault | None]


@dataclass
class Garbage:
    """What `find_garbage` found: garbage to collect, and faults of the committed objects."""
    orphans: list[tuple[str, int, float]] = field(default_factory=list)  # (key, bytes, age s)
    partials: list[Partial] = field(default_factory=list)
    young: int = 0  # orphans or partials too recent to touch
    manifests: int = 0  # readable manifests
    referenced: int = 0
    indexes: int = 0  # turn indexes among the referenced objects
    faults: list[Fault] = field(default_factory=list)
    protected: int = 0  # unnamed objects kept because their conversation's manifest is corrupt
    verified: int = 0  # objects whose size and SHA-256 were checked (--verify)
    # conversations per (model_id, model fingerprint, encoder_id, encoder fingerprint) they
    # were built with; None fingerprints: built before them (they need a rebuild)
    models: Counter = field(default_factory=Counter)

    @property
    def bytes(self) -> int:
        return sum(size for _, size, _ in self.orphans)

    def count(self, kind: str) -> int:
        return sum(f.kind == kind for f in self.faults)


def find_garbage(store: Store, min_age_seconds: float = 3600.0, verify: bool = False) -> Garbage:
    """Every cache object and turn index no manifest names, and every unfinished write, older
    than the age; every manifest that cannot be read and every object a manifest names that is
    missing (with `verify`, or whose size or SHA-256 differs from what the manifest records, or,
    a turn index, that a reader would refuse)."""
    g = Garbage()
    named: dict[str, tuple[str, ManifestRecord, Check]] = {}  # key -> (manifest, record, check)
    corrupt: list[str] = []  # "<prefix><id>/" of conversations whose manifest is unreadable
    for cid in list_conversations(store):
        try:
            records = read_manifest(store, cid) or []
        except ManifestError as e:
            g.faults.append(Fault("corrupt manifest", e.key, e.reason))
            corrupt.extend(f"{prefix}{cid}/" for prefix in OBJECT_PREFIXES)
            continue
        named |= {key: (manifest_key(cid), r, check) for key, (r, check, _) in
                  _named(records).items()}
        g.models.update({(r.model_id, r.model_fingerprint, r.encoder_id, r.encoder_fingerprint)
                         for r in records})
        g.manifests += 1
    g.referenced = len(named)
    g.indexes = sum(check is check_turn_index for _, _, check in named.values())
    now = time.time()
    stored = [key for prefix in OBJECT_PREFIXES for key in store.list(prefix)]
    for key in stored:
        if key in named:
            continue
        if any(key.startswith(prefix) for prefix in corrupt):
            g.protected += 1
            continue
        try:
            info = store.info(key)
        except ObjectNotFound:  # removed meanwhile
            continue
        if now - info.modified >= min_age_seconds:
            g.orphans.append((key, info.size, now - info.modified))
        else:
            g.young += 1
    present = set(stored)
    for key, (mkey, record, check) in sorted(named.items()):
        if key not in present and not store.exists(key):
            g.faults.append(Fault("missing object", key, f"named by {mkey}"))
        elif verify:
            g.verified += 1
            fault = check(store, key, mkey, record)
            if fault is not None:
                g.faults.append(fault)
    for partial in store.list_partial():
        if partial.age_seconds >= min_age_seconds:
            g.partials.append(partial)
        else:
            g.young += 1
    return g


def _named(records: list[ManifestRecord]) -> dict[str, tuple[ManifestRecord, Check, int | None]]:
    """The objects a conversation's manifest names: key -> (a record naming it, how
    `--verify` checks it, the size recorded)."""
    named: dict[str, tuple[ManifestRecord, Check, int | None]] = {}
    for r in records:
        named[r.object_key] = (r, check_object, r.object_bytes)
        if r.turn_index is not None:  # the same on every row
            named[r.turn_index.key] = (r, check_turn_index, r.turn_index.size)
    return named


def conversation_faults(store: Store, records: list[ManifestRecord],
                        verify: bool = False) -> list[Fault]:
    """What one built conversation's manifest names that the store does not hold as recorded:
    an object missing or of another size (the sizes looked up in one batch, `Store.sizes`, no
    object read), and with `verify` one whose bytes fail their SHA-256 or, a turn index, that
    a reader would refuse. A build's skip check: what it finds is repaired."""
    mkey = manifest_key(records[0].conversation_id)
    named = _named(records)
    sizes = store.sizes(named)
    faults = []
    for key, (record, check, recorded) in named.items():
        size = sizes.get(key)
        if size is None:
            faults.append(Fault("missing object", key, f"named by {mkey}"))
        elif size != recorded:
            faults.append(Fault("wrong size", key, f"{size} bytes, {mkey} records {recorded}"))
        elif verify and (fault := check(store, key, mkey, record)) is not None:
            faults.append(fault)
    return faults


def check_object(store: Store, key: str, manifest: str, record: ManifestRecord) -> Fault | None:
    """A cache object's size and SHA-256 against its manifest record; None when both match."""
    got = _read_checked(store, key, manifest, record.object_bytes, record.sha256)
    return got if isinstance(got, Fault) else None


def check_turn_index(store: Store, key: str, manifest: str,
                     record: ManifestRecord) -> Fault | None:
    """A turn index's size and SHA-256 against its manifest record, then the rest of what a
    reader checks (it parses, and is the conversation's, embedded by the episodes' encoder
    files); None when it would be served."""
    got = _read_checked(store, key, manifest, record.turn_index_bytes, record.turn_index_sha256)
    if isinstance(got, Fault):
        return got
    try:
        checked_turn_index(got, record.turn_index, record.conversation_id,
                           record.encoder_fingerprint)
    except TurnIndexUnavailable as e:
        return Fault("corrupt index", key, str(e))
    return None


def _read_checked(store: Store, key: str, manifest: str, size: int | None,
                  sha256: str | None) -> bytes | Fault:
    """The object's bytes when their size and SHA-256 are what the manifest records, else the
    fault (the size is asked first: an object of the wrong size is not downloaded)."""
    try:
        stored = store.info(key).size
        if size is None or stored != size:
            return Fault("wrong size", key, f"{stored} bytes, {manifest} records {size}")
        data = store.get(key)
    except ObjectNotFound:  # removed meanwhile
        return Fault("missing object", key, f"named by {manifest}")
    digest = hashlib.sha256(data).hexdigest()  # as the manifest records it
    if digest != sha256:
        return Fault("checksum failure", key, f"sha256 {digest[:16]}..., {manifest} records "
                                              f"{str(sha256)[:16]}...")
    return data


def remove(store: Store, garbage: Garbage) -> None:
    for key, _, _ in garbage.orphans:
        store.delete(key)
    for partial in garbage.partials:
        store.delete_partial(partial)
