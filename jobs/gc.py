"""Check a store's manifests against its objects, and list (with --delete remove) what failed
or interrupted builds left in it.

    python -m jobs.gc --store DIR|s3://bucket/prefix [--verify] [--delete] [--min-age-seconds 3600]

Manifests are the only commit point, so a cache object or a conversation's turn index
(`turns/`) that no manifest names is an orphan: an episode or index of a conversation whose
build failed or was interrupted, of a configuration that was rebuilt since, or the version an
append replaced. So are temporary files of a local store and incomplete multipart
uploads in S3. Anything younger than --min-age-seconds is left alone, so running this beside a
build does not take the objects it is about to commit. Calibration profiles are kept. gc never
changes a committed manifest, so the manifest table (`index/`, an index of the manifests) needs
no update; `jobs.manifests --compact` removes the table's own old files.

Every manifest is read: one that cannot be read is a fault (and its conversation's objects are
never orphans, so --delete cannot take them), and so is an object a manifest names that is not
in the store. --verify also reads every named object and checks its size and SHA-256 against
the manifest, and parses each turn index as a reader would (its conversation and encoder files
the manifest's: else a "corrupt index"). Faults are listed and make the exit code 1.

The models the manifests were built with are listed with the fingerprints of their files, and
conversations built before fingerprints (not served until rebuilt) are counted.
"""

from __future__ import annotations

import argparse
import sys

from pipeline.cli.numbers import non_negative
from pipeline.cli.parser import add_store_options, make_parser, store_options
from pipeline.store.backends.base import StoreError
from pipeline.store.backends.uri import open_store
from pipeline.store.catalogue.garbage import FAULT_KINDS, find_garbage, remove


def build_parser() -> argparse.ArgumentParser:
    p = make_parser("jobs.gc", __doc__)
    add_store_options(p)
    p.add_argument("--verify", action="store_true",
                   help="read every object a manifest names and check its size and SHA-256 "
                        "(and parse each turn index)")
    p.add_argument("--delete", action="store_true", help="remove the orphans and unfinished "
                   "writes listed (never a manifest or an object a manifest names)")
    p.add_argument("--min-age-seconds", type=non_negative, default=3600.0,
                   help="leave anything younger alone (a build may be writing it)")
    return p


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    try:
        store = open_store(a.store, store_options(a), create=False)
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
    for (model, model_fp, encoder, encoder_fp), n in sorted(g.models.items(), key=str):
        if model_fp is None or encoder_fp is None:
            print(f"needs rebuild: {n} conversation(s) of model {model!r} have no model "
                  "fingerprint (built before caches were bound to their model's files): not "
                  "served until rebuilt (python -m jobs.build --force ...)")
        else:
            print(f"models: {model!r} files {model_fp}, encoder {encoder!r} files {encoder_fp}: "
                  f"{n} conversation(s)")
    verb = "removed" if a.delete else "found"
    print(f"{verb} {len(g.orphans)} orphan objects ({g.bytes / 2**20:.1f} MiB) and "
          f"{len(g.partials)} unfinished writes; {g.manifests} manifests name {g.referenced} "
          f"objects ({g.indexes} turn indexes); {g.young} younger than "
          f"{a.min_age_seconds:.0f}s left alone; store {store.uri}"
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
