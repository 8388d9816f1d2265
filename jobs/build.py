"""Build episodic caches for every conversation of a corpus, on Ray.

    python -m jobs.build --corpus PATH|s3://... --store DIR|s3://bucket/prefix [--budget 1024 ...]
    ray job submit --working-dir . -- python -m jobs.build --corpus s3://... --store s3://...

Stages per conversation: a clustering task (CPU), then one block-prefill task per episode
(GPU when the cluster has one), then the manifest commit (the driver writes it once every
episode is stored): the manifest is the only commit point. The layer sensitivity profile is
measured once per model (or read from the store). The driver keeps at most `--max-in-flight`
tasks submitted (`ray.wait`) and streams the corpus, so its memory does not grow with the
corpus. Conversations whose manifest already carries this configuration's hash are skipped,
once every object it names is confirmed in the store at its recorded size (--verify: read and
checksummed too); a missing or damaged object is rebuilt alone ("repaired N" in the summary).
Committed rows are also appended, in batches, to the store's manifest table
(`pipeline.store.catalogue.table`), which the driver keeps equal to the manifests.
Alone it starts a local Ray; under `ray job submit` (RAY_ADDRESS set) it joins the cluster.
The arguments and the corpus's first object are checked before Ray, torch and the models load:
bad input fails in well under a second. An option the chosen method does not read (`--focus`
or `--episodes` with a baseline's `--scorer`, `--budget` with `--scorer full`) is refused (exit
2), never ignored: the configuration hash covers only what the method reads.
"""

from __future__ import annotations

import argparse
import sys
import time

from pipeline.builder.job import BuildError, BuildJob, configure_logging, open_job, print_outcome
from pipeline.cli.options import (
    BUILD_OPTIONS,
    add_corpus_options,
    add_driver_options,
    add_options,
    build_config_from_args,
    driver_options_from_args,
    limits_from_args,
)
from pipeline.cli.parser import add_store_options, make_parser, parse_noting_given, store_options
from pipeline.config import BuildConfig
from pipeline.corpus.schema import CorpusError
from pipeline.kv.errors import ModelNotFoundError
from pipeline.store.backends.base import StoreError


def build_parser() -> argparse.ArgumentParser:
    p = make_parser("jobs.build", __doc__)
    p.add_argument("--corpus", required=True,
                   help="JSONL file, LoCoMo .json, or a folder of them; local or s3://bucket/key")
    add_store_options(p, "store folder (or file://), or s3://bucket/prefix")
    add_options(p, BUILD_OPTIONS, BuildConfig())
    add_corpus_options(p)
    add_driver_options(p)
    p.add_argument("--ray-address", default=None,
                   help="Ray cluster to join (default: $RAY_ADDRESS, set by `ray job submit`; "
                        "else a local Ray is started)")
    p.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"],
                   help="the driver's log level")
    return p


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The arguments, noting which options were given: `config_from_args` refuses one the
    chosen method does not read, even at its default value."""
    return parse_noting_given(build_parser(), argv)


def config_from_args(a: argparse.Namespace) -> BuildConfig:
    """The build configuration; ValueError naming an option the method does not read."""
    return build_config_from_args(a)


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    configure_logging(a.log_level)
    start = time.perf_counter()
    try:
        config, options = config_from_args(a), driver_options_from_args(a)
        job = BuildJob(a.corpus, a.store, a.on_bad_record, limits_from_args(a), store_options(a),
                       a.ray_address)
        with open_job(job) as opened:
            # Ray, torch and the models load here, once the corpus and the store are known good
            from pipeline.builder.driver import run_job
            summary = run_job(opened, config, options)
    except (ValueError, CorpusError, StoreError, ModelNotFoundError, BuildError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # run_job has stopped the tasks (and a local Ray)
        print("interrupted: committed conversations are kept; run the same command again to "
              "build the rest", file=sys.stderr)
        return 130
    print_outcome(summary, time.perf_counter() - start, opened.store)
    return 1 if summary.failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
