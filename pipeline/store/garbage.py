"""Garbage and faults of a store: what no manifest names, and what a manifest names wrongly.

Manifests are the only commit point, so a cache object that no manifest names is an orphan (an
episode of a failed or interrupted build, or of a configuration rebuilt since), and so are the
temporary files of a local store and incomplete multipart uploads in S3. A manifest that cannot
be read, or that names an object that is missing (or, verified, of another size or SHA-256),
is a fault; the objects of a conversation whose manifest is unreadable are never orphans.
"""

from __future__ import annotations

import hashlib
import time
from collections import Counter
from dataclasses import dataclass, field

from pipeline.store.base import ObjectNotFound, Partial, Store, manifest_key
from pipeline.store.manifest import ManifestError, ManifestRecord, list_conversations, read_manifest


@dataclass(frozen=True)
class Fault:
    """Something a manifest promises that the store does not hold."""
    kind: str  # one of FAULT_KINDS
    key: str  # the manifest (corrupt manifest) or the object
    detail: str


FAULT_KINDS = ("corrupt manifest", "missing object", "wrong size", "checksum failure")


@dataclass
class Garbage:
    """What `find_garbage` found: garbage to collect, and faults of the committed objects."""
    orphans: list[tuple[str, int, float]] = field(default_factory=list)  # (key, bytes, age s)
    partials: list[Partial] = field(default_factory=list)
    young: int = 0  # orphans or partials too recent to touch
    manifests: int = 0  # readable manifests
    referenced: int = 0
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
    """Every cache object no manifest names, and every unfinished write, older than the age;
    every manifest that cannot be read and every object a manifest names that is missing (with
    `verify`, or whose size or SHA-256 differs from what the manifest records)."""
    g = Garbage()
    named: dict[str, tuple[str, ManifestRecord]] = {}  # object key -> (manifest key, record)
    corrupt: list[str] = []  # "caches/<id>/" of conversations whose manifest is unreadable
    for cid in list_conversations(store):
        try:
            records = read_manifest(store, cid) or []
        except ManifestError as e:
            g.faults.append(Fault("corrupt manifest", e.key, e.reason))
            corrupt.append(f"caches/{cid}/")
            continue
        named.update((r.object_key, (manifest_key(cid), r)) for r in records)
        g.models.update({(r.model_id, r.model_fingerprint, r.encoder_id, r.encoder_fingerprint)
                         for r in records})
        g.manifests += 1
    g.referenced = len(named)
    now = time.time()
    stored = store.list("caches/")
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
    for key, (mkey, record) in sorted(named.items()):
        if key not in present and not store.exists(key):
            g.faults.append(Fault("missing object", key, f"named by {mkey}"))
        elif verify:
            g.verified += 1
            fault = check_object(store, key, mkey, record)
            if fault is not None:
                g.faults.append(fault)
    for partial in store.list_partial():
        if partial.age_seconds >= min_age_seconds:
            g.partials.append(partial)
        else:
            g.young += 1
    return g


def check_object(store: Store, key: str, manifest: str, record: ManifestRecord) -> Fault | None:
    """The object's size and SHA-256 against its manifest record; None when both match."""
    try:
        size = store.info(key).size
        if record.object_bytes is None or size != record.object_bytes:
            return Fault("wrong size", key, f"{size} bytes, {manifest} records "
                                            f"{record.object_bytes}")
        digest = hashlib.sha256(store.get(key)).hexdigest()  # as the manifest records it
    except ObjectNotFound:  # removed meanwhile
        return Fault("missing object", key, f"named by {manifest}")
    if digest != record.sha256:
        return Fault("checksum failure", key, f"sha256 {digest[:16]}..., {manifest} records "
                                              f"{str(record.sha256)[:16]}...")
    return None


def remove(store: Store, garbage: Garbage) -> None:
    for key, _, _ in garbage.orphans:
        store.delete(key)
    for partial in garbage.partials:
        store.delete_partial(partial)
