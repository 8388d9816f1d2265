"""Check a store's manifests against its objects, and list (with --delete remove) what failed
or interrupted builds left in it.

    python -m jobs.gc --store DIR|s3://bucket/prefix [--verify] [--delete] [--min-age-seconds 3600]

Manifests are the only commit point, so a cache object that no manifest names is an orphan:
an episode of a conversation whose build failed or was interrupted, or of a configuration
that was rebuilt since. So are temporary files of a local store and incomplete multipart
uploads in S3. Anything younger than --min-age-seconds is left alone, so running this beside a
build does not take the objects it is about to commit. Calibration profiles are kept. gc never
changes a committed manifest, so the manifest table (`index/`, an index of the manifests) needs
no update; `jobs.manifests --compact` removes the table's own old files.

Every manifest is read: one that cannot be read is a fault (and its conversation's objects are
never orphans, so --delete cannot take them), and so is an object a manifest names that is not
in the store. --verify also reads every named object and checks its size and SHA-256 against
the manifest. Faults are listed and make the exit code 1.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass, field

from pipeline.cli.options import add_store_options
from pipeline.cli.parser import make_parser
from pipeline.store.base import ObjectNotFound, Partial, Store, StoreError, manifest_key
from pipeline.store.cache_format import sha256
from pipeline.store.manifest import ManifestError, list_conversations, read_manifest
from pipeline.store.uri import open_store


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
    named: dict[str, tuple[str, dict]] = {}  # object key -> (manifest key, row)
    corrupt: list[str] = []  # "caches/<id>/" of conversations whose manifest is unreadable
    for cid in list_conversations(store):
        try:
            rows = read_manifest(store, cid) or []
        except ManifestError as e:
            g.faults.append(Fault("corrupt manifest", e.key, e.reason))
            corrupt.append(f"caches/{cid}/")
            continue
        named.update((r["object_key"], (manifest_key(cid), r)) for r in rows)
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
    for key, (mkey, row) in sorted(named.items()):
        if key not in present and not store.exists(key):
            g.faults.append(Fault("missing object", key, f"named by {mkey}"))
        elif verify:
            g.verified += 1
            fault = check_object(store, key, mkey, row)
            if fault is not None:
                g.faults.append(fault)
    for partial in store.list_partial():
        if partial.age_seconds >= min_age_seconds:
            g.partials.append(partial)
        else:
            g.young += 1
    return g


def check_object(store: Store, key: str, manifest: str, row: dict) -> Fault | None:
    """The object's size and SHA-256 against its manifest row; None when both match."""
    try:
        size = store.info(key).size
        if row.get("object_bytes") is None or size != row["object_bytes"]:
            return Fault("wrong size", key, f"{size} bytes, {manifest} records "
                                            f"{row.get('object_bytes')}")
        digest = sha256(store.get(key))
    except ObjectNotFound:  # removed meanwhile
        return Fault("missing object", key, f"named by {manifest}")
    if digest != row.get("sha256"):
        return Fault("checksum failure", key, f"sha256 {digest[:16]}..., {manifest} records "
                                              f"{str(row.get('sha256'))[:16]}...")
    return None


def remove(store: Store, garbage: Garbage) -> None:
    for key, _, _ in garbage.orphans:
        store.delete(key)
    for partial in garbage.partials:
        store.delete_partial(partial)


def build_parser() -> argparse.ArgumentParser:
    p = make_parser("jobs.gc", __doc__)
    add_store_options(p)
    p.add_argument("--s3-region", default=None, help="S3 region (default: the AWS chain)")
    p.add_argument("--verify", action="store_true",
                   help="read every object a manifest names and check its size and SHA-256")
    p.add_argument("--delete", action="store_true", help="remove the orphans and unfinished "
                   "writes listed (never a manifest or an object a manifest names)")
    p.add_argument("--min-age-seconds", type=float, default=3600.0,
                   help="leave anything younger alone (a build may be writing it)")
    return p


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    try:
        store = open_store(a.store, endpoint_url=a.s3_endpoint, region=a.s3_region, create=False)
        g = find_garbage(store, a.min_age_seconds, verify=a.verify)
        for fault in g.faults:
            print(f"{fault.kind:<17} {fault.key}: {fault.detail}")
        for key, size, age in g.orphans:
            print(f"orphan  {key}  {size} bytes  {age / 3600:.1f} h old")
        for partial in g.partials:
            print(f"partial {partial.name}  {partial.age_seconds / 3600:.1f} h old")
        if a.delete:
            remove(store, g)
    except (StoreError, OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    verb = "removed" if a.delete else "found"
    print(f"{verb} {len(g.orphans)} orphan objects ({g.bytes / 2**20:.1f} MiB) and "
          f"{len(g.partials)} unfinished writes; {g.manifests} manifests name {g.referenced} "
          f"objects; {g.young} younger than {a.min_age_seconds:.0f}s left alone; store {store.uri}"
          + ("" if a.delete or not (g.orphans or g.partials) else "; --delete removes them"))
    checked = (f"{g.verified} objects verified (size and SHA-256)" if a.verify
               else "objects not read (--verify checks their sizes and SHA-256)")
    if g.faults:
        counts = ", ".join(f"{n} {kind}{'s' if n > 1 else ''}" for kind in FAULT_KINDS
                           if (n := g.count(kind)))
        kept = (f"; {g.protected} objects of conversations with a corrupt manifest kept"
                if g.protected else "")
        print(f"store has faults: {counts}; {checked}{kept}")
        return 1
    print(f"no faults: every manifest read, every object it names present; {checked}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
