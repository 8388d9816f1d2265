"""The options several commands share, added to a parser in one place and read back in one.

Defaults are read from the configuration dataclasses, never typed twice.
"""

from __future__ import annotations

import argparse

from pipeline.corpus.records import DEFAULT_LIMITS, CorpusLimits
from pipeline.kv import models


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


# -- the benchmarks' options ---------------------------------------------------------------------

def add_threads_option(p: argparse.ArgumentParser) -> None:
    """`--threads`: pinning torch's threads gives steadier timings on a busy machine."""
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")


def add_model_options(p: argparse.ArgumentParser) -> None:
    """`--model` and `--threads`, as every benchmark that loads the model takes them."""
    p.add_argument("--model", default=models.DEFAULT_LLM,
                   help="LLM: packaged name or local HF folder")
    add_threads_option(p)


def add_prefill_options(p: argparse.ArgumentParser, lengths: str) -> None:
    """The options of one episode's block prefill at growing lengths (bench_memory,
    bench_build_speed), `lengths` being the default lengths."""
    p.add_argument("--lengths", default=lengths, help="comma-separated conversation lengths (tokens)")
    p.add_argument("--budget", type=int, default=1024,
                   help="mean entries kept per layer and KV head")
    p.add_argument("--block", type=int, default=512, help="block-prefill block size (tokens)")
    p.add_argument("--layers", type=int, default=None,
                   help="run the first N decoder layers only (default: all)")
