"""Build episodic caches for every conversation of a corpus, on Ray.

    python -m jobs.build --corpus PATH|s3://... --store DIR|s3://bucket/prefix [--budget 1024 ...]
    ray job submit --working-dir . -- python -m jobs.build --corpus s3://... --store s3://...

Stages per conversation: a clustering task (CPU), then one block-prefill task per episode
(GPU when the cluster has one), then the manifest commit (the driver writes it once every
episode is stored): the manifest is the only commit point. The layer sensitivity profile is
measured once per model (or read from the store). The driver keeps at most `--max-in-flight`
tasks submitted (`ray.wait`) and streams the corpus, so its memory does not grow with the
corpus. Conversations whose manifest already carries this configuration's hash are skipped.
Committed rows are also appended, in batches, to the store's manifest table
(`pipeline.store.table`), which the driver keeps equal to the manifests.
Alone it starts a local Ray; under `ray job submit` (RAY_ADDRESS set) it joins the cluster.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import sys
import tempfile
import time
from dataclasses import replace
from typing import IO

import ray

from pipeline.build.config import BuildConfig
from pipeline.build.driver import BuildError, log, run_build
from pipeline.build.sources import corpus_objects
from pipeline.cli.options import add_corpus_options, limits_from_args
from pipeline.cli.parser import make_parser
from pipeline.corpus.reader import SKIP_REPORT, CorpusStream, ReadStats
from pipeline.corpus.schema import CorpusError
from pipeline.episodes import EpisodeConfig
from pipeline.kv import models
from pipeline.kv.budgets import CalibrationConfig
from pipeline.kv.merging import MergeConfig
from pipeline.kv.positions import POSITION_MODES
from pipeline.kv.prefill import PrefillConfig
from pipeline.kv.scorers import SCORERS, ScoringConfig
from pipeline.kv.tristate import TriStateConfig
from pipeline.ray_runtime import init_ray
from pipeline.store.base import Store, StoreError
from pipeline.store.s3 import S3_ENDPOINT_ENV
from pipeline.store.uri import open_store


def build_parser() -> argparse.ArgumentParser:
    p = make_parser("jobs.build", __doc__)
    p.add_argument("--corpus", required=True,
                   help="JSONL file, LoCoMo .json, or a folder of them; local or s3://bucket/key")
    p.add_argument("--store", required=True, help="store folder (or file://), or s3://bucket/prefix")
    p.add_argument("--s3-endpoint", default=None,
                   help=f"S3-compatible endpoint URL (default: ${S3_ENDPOINT_ENV}, else AWS)")
    p.add_argument("--s3-region", default=None, help="S3 region (default: the AWS chain)")
    p.add_argument("--model", default=models.DEFAULT_LLM,
                   help="LLM: packaged name or local HF folder")
    p.add_argument("--encoder", default=models.DEFAULT_ENCODER, help="sentence encoder")
    p.add_argument("--scorer", default="epicache", choices=sorted(set(SCORERS) - {"question"}),
                   metavar="SCORER",
                   help="how entries are scored for eviction, one of %(choices)s (the README's "
                        "'Scorers'); epicache builds one cache per episode, the others one per "
                        "conversation")
    p.add_argument("--budget", type=int, default=1024,
                   help="mean entries kept per layer and KV head (--tristate: the bytes of that "
                        "many Original entries)")
    p.add_argument("--full", action="store_true", help="no eviction: store the full cache")
    p.add_argument("--block", type=int, default=512, help="block-prefill block size (tokens)")
    p.add_argument("--selection", default="headwise", choices=["headwise", "perhead"],
                   help="top-k across a layer's heads (AdaKV) or per head")
    p.add_argument("--alpha", type=float, default=BuildConfig.alpha,
                   help="sensitivity-aware layer allocation sharpness (0: uniform budgets)")
    scoring = ScoringConfig()
    p.add_argument("--paper", action="store_true",
                   help="EpiCache scored as the paper describes it (max patch attention, token by "
                        "token, whole patch); add --alpha 1 for its layer budgets")
    p.add_argument("--focus", type=float, default=scoring.focus,
                   help="weight the episode's own turns' scores by 1 + FOCUS (0: off)")
    p.add_argument("--patch-tokens", type=int, default=scoring.patch_tokens or 0,
                   help="cap on the patched prompt's tokens (0: the whole medoid text)")
    p.add_argument("--episodes", type=int, default=4,
                   help="episodes (K-Means clusters) per conversation")
    p.add_argument("--medoids", type=int, default=4, help="medoid windows in an episode's patch")
    p.add_argument("--window", type=int, default=4, help="utterances per clustering window")
    p.add_argument("--seed", type=int, default=0, help="K-Means seed")
    p.add_argument("--max-context-tokens", type=int, default=None,
                   help="cut each conversation at a session boundary to fit this many tokens "
                        "(default: whole)")
    p.add_argument("--positions", default="original", choices=list(POSITION_MODES),
                   help="original: entries keep their token positions, so a conversation must "
                        "fit the model's positions; compact: kept entries are re-rotated to "
                        "positions 0, 1, 2, ... after every eviction, for histories of any length")
    p.add_argument("--store-dtype", default="float16", choices=["float16", "bfloat16", "float32"],
                   help="dtype of the stored keys and values")
    p.add_argument("--calibration-tokens", type=int, default=4096,
                   help="calibration text length (layer profiles, with --alpha > 0 or "
                        "--allocator variance)")
    p.add_argument("--calibration-window", type=int, default=1024,
                   help="calibration: the simulated budget (sink + recent tokens)")
    add_corpus_options(p)
    t = TriStateConfig()
    p.add_argument("--tristate", action="store_true",
                   help="ARKV tri-state compression: --budget M = the bytes of M Original tokens "
                        "per layer and KV head; entries Original, Quantized (int8) or Evicted")
    p.add_argument("--fp8", action="store_true", help="tri-state: fp8 e4m3 codes instead of int8")
    p.add_argument("--tri-window", type=int, default=t.window, help="tri-state protected window")
    p.add_argument("--tri-gamma", type=float, default=t.gamma, help="heavy-hitter gamma")
    p.add_argument("--tri-original-scale", type=float, default=t.original_scale,
                   help="scales the OQ ratio (share of a layer's bytes spent on Original entries)")
    p.add_argument("--tri-slack", type=float, default=t.slack, help="tri-state slack factor")
    p.add_argument("--dapq", action="store_true",
                   help="DapQ: patch queries at the decode positions (after the conversation)")
    p.add_argument("--merge", action="store_true", help="D2O: merge evicted entries into kept ones")
    p.add_argument("--merge-beta", type=float, default=MergeConfig().beta, help="D2O EMA beta")
    p.add_argument("--allocator", default="sensitivity", choices=["sensitivity", "variance"],
                   help="layer budgets: EpiCache sensitivity or D2O attention variance")
    p.add_argument("--variance-temperature", type=float, default=1.0,
                   help="D2O inverse-variance softmax temperature (--allocator variance)")
    p.add_argument("--force", action="store_true", help="rebuild conversations already built")
    p.add_argument("--max-in-flight", type=int, default=16, help="tasks submitted at most")
    p.add_argument("--cpus-per-task", type=float, default=1, help="Ray CPUs per task")
    p.add_argument("--gpus-per-task", type=float, default=None,
                   help="Ray GPUs per task (default: 1 when the cluster has GPUs now, else 0; "
                        "give 1 on an autoscaling cluster whose GPU workers start at zero)")
    p.add_argument("--max-retries", type=int, default=2, help="Ray retries per task on worker death")
    p.add_argument("--ray-address", default=None,
                   help="Ray cluster to join (default: $RAY_ADDRESS, set by `ray job submit`; "
                        "else a local Ray is started)")
    p.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"],
                   help="the driver's log level")
    p.add_argument("--no-progress", action="store_true",
                   help="no progress bar (e.g. in a job's log)")
    return p


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def config_from_args(a: argparse.Namespace) -> BuildConfig:
    return BuildConfig(
        model=a.model, encoder=a.encoder, scorer=a.scorer,
        budget=None if a.full else a.budget, alpha=a.alpha, store_dtype=a.store_dtype,
        allocator=a.allocator, variance_temperature=a.variance_temperature,
        max_context_tokens=a.max_context_tokens,
        episodes=EpisodeConfig(window=a.window, episodes=a.episodes, medoids=a.medoids, seed=a.seed),
        scoring=ScoringConfig.paper() if a.paper else replace(
            ScoringConfig(), focus=a.focus, patch_tokens=a.patch_tokens or None),
        prefill=PrefillConfig(
            block=a.block, selection=a.selection, decode_positions=a.dapq, positions=a.positions,
            tristate=TriStateConfig(enabled=a.tristate or a.fp8, fp8=a.fp8, window=a.tri_window,
                                    gamma=a.tri_gamma, original_scale=a.tri_original_scale,
                                    slack=a.tri_slack) if (a.tristate or a.fp8) else TriStateConfig(),
            merge=MergeConfig(enabled=True, beta=a.merge_beta) if a.merge else MergeConfig()),
        calibration=CalibrationConfig(tokens=a.calibration_tokens, window=a.calibration_window,
                                      sink=min(128, a.calibration_window // 4)))


def skip_report_key() -> str:
    """A folder of its own per run (`reports/<UTC time>-<pid>/skipped.jsonl`): a re-run never
    overwrites an earlier report, and manifests/ holds manifests only."""
    return f"reports/{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}-{os.getpid()}/{SKIP_REPORT}"


def put_skip_report(store: Store, report: IO[str], key: str | None = None) -> str | None:
    """Upload the run's skip report (spooled as the corpus is read) to the store under `key`
    (default: a new `skip_report_key()`); None when nothing was skipped."""
    if report.tell() == 0:
        return None
    report.seek(0)
    key = key or skip_report_key()
    store.put(key, report.read().encode("utf-8"))
    report.seek(0, os.SEEK_END)
    return key


def print_skips(stats: ReadStats, shown: int, out: IO[str]) -> int:
    """Print the skips held in `stats` from the `shown`-th on, and how many more are only in
    the report; returns how many are printed so far (the next call's `shown`)."""
    for s in stats.skipped[shown:]:
        print(s.line(), file=out)
    shown = max(shown, len(stats.skipped))
    if stats.total_skipped > shown:
        print(f"... and {stats.total_skipped - shown:,} more (all in {SKIP_REPORT})", file=out)
    return shown


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    log.setLevel(a.log_level)
    start = time.perf_counter()
    try:
        config = config_from_args(a)
        limits = limits_from_args(a)
        if a.max_in_flight < 1 or a.max_retries < 0:
            raise ValueError("--max-in-flight must be at least 1 and --max-retries at least 0")
        with tempfile.TemporaryFile("w+", encoding="utf-8") as report:
            def to_report(skip) -> None:
                report.write(json.dumps(skip.as_dict()) + "\n")

            stats = ReadStats(keep=20, sink=to_report)
            corpus = CorpusStream(corpus_objects(a.corpus, a.s3_endpoint), a.on_bad_record,
                                  stats, limits, where=a.corpus)
            # The corpus is read up to its first conversation (its first object is checked
            # whole) before the store is opened (a local one would be created) and before Ray
            # and the model start: a bad or empty corpus fails in seconds and writes nothing.
            # Later objects are checked each before its own conversations are scheduled.
            corpus.prime()
            shown = print_skips(stats, 0, sys.stderr)
            store = open_store(a.store, endpoint_url=a.s3_endpoint, region=a.s3_region)
            key = skip_report_key()
            if put_skip_report(store, report, key) is not None:
                print(f"skip report: {store.uri}/{key}", file=sys.stderr)
            init_ray(a.ray_address)
            gpus = a.gpus_per_task if a.gpus_per_task is not None else \
                (1 if ray.cluster_resources().get("GPU", 0) > 0 else 0)
            reported = stats.total_skipped
            try:
                summary = run_build(corpus, store, config, force=a.force,
                                    max_in_flight=a.max_in_flight, num_cpus=a.cpus_per_task,
                                    num_gpus=gpus, max_retries=a.max_retries,
                                    progress=not a.no_progress)
            finally:  # skips met in later objects: the report is rewritten whole
                if stats.total_skipped > reported:
                    print_skips(stats, shown, sys.stderr)
                    put_skip_report(store, report, key)
                    print(f"skip report: {store.uri}/{key}", file=sys.stderr)
    except (ValueError, CorpusError, StoreError, models.ModelNotFoundError, BuildError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        with contextlib.suppress(Exception):  # stop the tasks (and a local Ray) before the line
            ray.shutdown()
        print("interrupted: committed conversations are kept; run the same command again to "
              "build the rest", file=sys.stderr)
        return 130
    print(summary.line(time.perf_counter() - start, store.uri))
    for cid, err in summary.failed.items():
        print(f"failed {cid}: {err}", file=sys.stderr)
    return 1 if summary.failed else 0


if __name__ == "__main__":
    # Run through the importable module, so Ray ships the tasks by reference, not by value.
    from jobs.build import main as _main

    raise SystemExit(_main())
