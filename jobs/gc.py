"""List (and with --delete remove) what failed or interrupted builds left in a store.

    python -m jobs.gc --store DIR|s3://bucket/prefix [--delete] [--min-age-seconds 3600]

Manifests are the only commit point, so a cache object that no manifest names is an orphan:
an episode of a conversation whose build failed or was interrupted, or of a configuration
that was rebuilt since. So are temporary files of a local store and incomplete multipart
uploads in S3. Anything younger than --min-age-seconds is left alone, so running this beside a
build does not take the objects it is about to commit. Calibration profiles are kept.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass, field

from pipeline.manifest import list_conversations, read_manifest
from pipeline.store import ObjectNotFound, Partial, Store, StoreError, open_store


@dataclass
class Garbage:
    orphans: list[tuple[str, int, float]] = field(default_factory=list)  # (key, bytes, age s)
    partials: list[Partial] = field(default_factory=list)
    young: int = 0  # orphans or partials too recent to touch
    manifests: int = 0
    referenced: int = 0

    @property
    def bytes(self) -> int:
        return sum(size for _, size, _ in self.orphans)


def find_garbage(store: Store, min_age_seconds: float = 3600.0) -> Garbage:
    """Every cache object no manifest names, and every unfinished write, older than the age."""
    g = Garbage()
    referenced: set[str] = set()
    for cid in list_conversations(store):
        rows = read_manifest(store, cid) or []
        referenced.update(r["object_key"] for r in rows)
        g.manifests += 1
    g.referenced = len(referenced)
    now = time.time()
    for key in store.list("caches/"):
        if key in referenced:
            continue
        try:
            info = store.info(key)
        except ObjectNotFound:  # removed meanwhile
            continue
        if now - info.modified >= min_age_seconds:
            g.orphans.append((key, info.size, now - info.modified))
        else:
            g.young += 1
    for partial in store.list_partial():
        if partial.age_seconds >= min_age_seconds:
            g.partials.append(partial)
        else:
            g.young += 1
    return g


def remove(store: Store, garbage: Garbage) -> None:
    for key, _, _ in garbage.orphans:
        store.delete(key)
    for partial in garbage.partials:
        store.delete_partial(partial)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m jobs.gc", description=__doc__.split("\n\n")[0])
    p.add_argument("--store", required=True, help="store folder, or s3://bucket/prefix")
    p.add_argument("--s3-endpoint", default=None, help="S3-compatible endpoint URL")
    p.add_argument("--s3-region", default=None)
    p.add_argument("--delete", action="store_true", help="remove what is listed")
    p.add_argument("--min-age-seconds", type=float, default=3600.0,
                   help="leave anything younger alone (a build may be writing it)")
    a = p.parse_args(argv)
    try:
        store = open_store(a.store, endpoint_url=a.s3_endpoint, region=a.s3_region)
        g = find_garbage(store, a.min_age_seconds)
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
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
