"""TODO docstring."""

from __future__ import annotations

import argparse

from pipeline.corpus.records import DEFAULT_LIMITS, CorpusLimits


def add_corpus_options(p: argparse.ArgumentParser) -> None:
    """The corpus options `jobs.build` and `jobs.evaluate` share."""
    p.add_argument("--on-bad-record", default="fail", choices=["fail", "skip"],
                   help="a malformed record (or question) stops the run, or is skipped (a "
                        "question: dropped, its conversation kept) and listed in skipped.jsonl")
    p.add_argument("--max-record-bytes", type=int, default=DEFAULT_LIMITS.max_record_bytes,
                   help="largest JSONL line (or .json file) accepted, in bytes")
    p.add_argument("--max-turn-chars", type=int, default=DEFAULT_LIMITS.max_turn_chars,
                   help="longest turn text (or caption) accepted, in characters")


def limits_from_args(a: argparse.Namespace) -> CorpusLimits:
    return CorpusLimits(max_record_bytes=a.max_record_bytes, max_turn_chars=a.max_turn_chars)


def add_store_options(p: argparse.ArgumentParser) -> None:
    """`--store` and `--s3-endpoint` of the commands that read an existing store (jobs.serve
    reads the endpoint from the environment at start instead, for its replicas)."""
    p.add_argument("--store", required=True, help="store folder, or s3://bucket/prefix")
    p.add_argument("--s3-endpoint", default=None,
                   help="S3-compatible endpoint URL (default: $EPICACHE_S3_ENDPOINT, else AWS)")
