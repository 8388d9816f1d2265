"""Build episodic caches for every conversation of a corpus, on Ray.

    python -m jobs.build --corpus PATH --store DIR [--budget 1024 --block 512 --episodes 4 ...]

Stages per conversation: a clustering task (CPU), then one block-prefill task per episode,
then the manifest commit (the driver writes it once every episode is stored). The layer
sensitivity profile is measured once per model (or read from the store). The driver keeps a
bounded number of tasks in flight with `ray.wait`, so the corpus is streamed, never held.
Conversations whose manifest already carries this configuration's hash are skipped.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from dataclasses import dataclass, field

import ray
from tqdm import tqdm

from pipeline import builder, models
from pipeline.calibrate import CalibrationConfig
from pipeline.config import BuildConfig
from pipeline.corpus import Conversation, CorpusError, ReadStats, iter_corpus
from pipeline.episodes import EpisodeConfig
from pipeline.prefill import PrefillConfig
from pipeline.scorers import SCORERS
from pipeline.store import StoreError, open_store

log = logging.getLogger("jobs.build")

_WORKER_ENV = {"TOKENIZERS_PARALLELISM": "false", "TRANSFORMERS_VERBOSITY": "error",
               "HF_HUB_DISABLE_PROGRESS_BARS": "1", "HF_HUB_OFFLINE": "1",
               "PYTHONWARNINGS": "ignore"}


@ray.remote
def cluster_task(conv: Conversation, config: BuildConfig) -> builder.ClusterResult:
    return builder.cluster_conversation(conv, config)


@ray.remote
def budgets_task(store_uri: str, config: BuildConfig) -> list[int] | None:
    lm = models.load_llm(config.model)
    return builder.layer_budgets(open_store(store_uri), config, lm.config.num_hidden_layers)


@ray.remote
def episode_task(clustered: builder.ClusterResult, episode: int, budgets: list[int] | None,
                 config: BuildConfig, store_uri: str) -> dict:
    row = builder.build_episode(clustered, episode, budgets, config, open_store(store_uri))
    node = ray.get_runtime_context().get_node_id()
    row["worker"] = f"{row['worker']}@{node[:12]}"
    row["_model_loads"] = (os.getpid(), models.load_count())
    return row


@dataclass
class Progress:
    """What the driver tracks for one conversation in flight."""
    episodes: int = 0
    rows: list[dict] = field(default_factory=list)
    error: str | None = None


@dataclass
class Summary:
    built: int = 0
    skipped: int = 0
    failed: dict[str, str] = field(default_factory=dict)
    episodes: int = 0
    tokens: int = 0
    bytes: int = 0
    loads: dict[int, int] = field(default_factory=dict)  # worker pid -> model loads
    bad_records: int = 0

    def line(self, seconds: float, store: str) -> str:
        return (f"built {self.built} conversations ({self.episodes} episode caches, "
                f"{self.tokens:,} tokens, {self.bytes / 2**20:.1f} MiB) in {seconds:.1f}s; "
                f"skipped {self.skipped} up to date; failed {len(self.failed)}; "
                f"bad records skipped {self.bad_records}; model loads {sum(self.loads.values())} "
                f"in {len(self.loads)} workers; store {store}")


def run_build(corpus: str, store_uri: str, config: BuildConfig, *, force: bool = False,
              on_bad_record: str = "fail", max_in_flight: int = 16, num_cpus: float = 1,
              num_gpus: float = 0, max_retries: int = 2, progress: bool = True) -> Summary:
    """Drive the whole build; returns the summary (the caller decides the exit code)."""
    store = open_store(store_uri)
    start = time.perf_counter()
    resources = {"num_cpus": num_cpus, "num_gpus": num_gpus, "max_retries": max_retries}
    budgets_ref = budgets_task.options(**resources).remote(store.uri, config)
    budgets = ray.get(budgets_ref)
    log.info("layer budgets: %s", budgets)

    summary, stats = Summary(), ReadStats()
    conversations = iter_corpus(corpus, on_bad_record, stats)
    in_flight: dict[ray.ObjectRef, tuple[str, str]] = {}  # ref -> (kind, conversation id)
    state: dict[str, Progress] = {}
    bar = tqdm(unit="episode", disable=not progress, dynamic_ncols=True, desc="build")

    def admit() -> bool:
        for conv in conversations:
            if not force and builder.is_built(store, conv.conversation_id, config):
                summary.skipped += 1
                continue
            state[conv.conversation_id] = Progress()
            in_flight[cluster_task.options(num_cpus=1, max_retries=max_retries)
                      .remote(conv, config)] = ("cluster", conv.conversation_id)
            return True
        return False

    def finish(cid: str) -> None:
        p = state.pop(cid)
        if p.error is None:
            try:
                builder.commit_manifest(store, cid, p.rows)
                summary.built += 1
                return
            except Exception as e:  # a commit that fails marks the conversation failed
                p.error = f"manifest commit: {e}"
        summary.failed[cid] = p.error
        log.error("conversation %s failed: %s", cid, p.error)

    more = True
    while True:
        while more and len(in_flight) < max_in_flight:
            more = admit()
        if not in_flight:
            break
        [ref], _ = ray.wait(list(in_flight), num_returns=1)
        kind, cid = in_flight.pop(ref)
        p = state[cid]
        try:
            result = ray.get(ref)
        except Exception as e:  # Ray retried already; the conversation is marked failed
            p.error = p.error or f"{kind}: {type(e).__name__}: {str(e).splitlines()[-1][:300]}"
            result = None
        if kind == "cluster" and result is not None:
            p.episodes = len(result.episodes.episodes)
            for e in range(p.episodes):  # the cluster result goes by reference, not by copy
                in_flight[episode_task.options(**resources).remote(
                    ref, e, budgets, config, store.uri)] = ("episode", cid)
            continue
        if kind == "episode" and result is not None:
            pid, loads = result.pop("_model_loads")
            summary.loads[pid] = max(loads, summary.loads.get(pid, 0))
            p.rows.append(result)
            summary.episodes += 1
            summary.tokens += result["tokens"]
            summary.bytes += result["object_bytes"]
            bar.update(1)
            bar.set_postfix(conversations=summary.built + summary.skipped,
                            tok_s=f"{summary.tokens / (time.perf_counter() - start):.0f}")
            log.info("episode %s/%d built by %s in %.1fs", cid, result["episode"],
                     result["worker"], result["build_seconds"])
        if not any(k == cid for _, k in in_flight.values()):
            finish(cid)
    bar.close()
    summary.bad_records = len(stats.skipped)
    return summary


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m jobs.build", description=__doc__.split("\n\n")[0])
    p.add_argument("--corpus", required=True, help="JSONL file, LoCoMo .json, or a folder of them")
    p.add_argument("--store", required=True, help="store folder (or file:// URI)")
    p.add_argument("--model", default=models.DEFAULT_LLM, help="LLM: packaged name or local HF folder")
    p.add_argument("--encoder", default=models.DEFAULT_ENCODER, help="sentence encoder")
    p.add_argument("--scorer", default="epicache", choices=sorted(SCORERS))
    p.add_argument("--budget", type=int, default=1024, help="mean entries per layer and KV head")
    p.add_argument("--full", action="store_true", help="no eviction: store the full cache")
    p.add_argument("--block", type=int, default=512, help="block-prefill block size (tokens)")
    p.add_argument("--selection", default="headwise", choices=["headwise", "perhead"])
    p.add_argument("--alpha", type=float, default=1.0, help="layer allocation sharpness (0: uniform)")
    p.add_argument("--episodes", type=int, default=4)
    p.add_argument("--medoids", type=int, default=4)
    p.add_argument("--window", type=int, default=4, help="utterances per clustering window")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-context-tokens", type=int, default=None,
                   help="cut each conversation at a session boundary to fit this many tokens")
    p.add_argument("--store-dtype", default="float16", choices=["float16", "bfloat16", "float32"])
    p.add_argument("--calibration-tokens", type=int, default=4096)
    p.add_argument("--calibration-window", type=int, default=1024)
    p.add_argument("--on-bad-record", default="fail", choices=["fail", "skip"])
    p.add_argument("--force", action="store_true", help="rebuild conversations already built")
    p.add_argument("--max-in-flight", type=int, default=16, help="tasks in flight at most")
    p.add_argument("--cpus-per-task", type=float, default=1)
    p.add_argument("--gpus-per-task", type=float, default=None,
                   help="default: 1 when the cluster has GPUs, else 0")
    p.add_argument("--max-retries", type=int, default=2, help="Ray retries per task")
    p.add_argument("--no-progress", action="store_true")
    return p.parse_args(argv)


def config_from_args(a: argparse.Namespace) -> BuildConfig:
    return BuildConfig(
        model=a.model, encoder=a.encoder, scorer=a.scorer,
        budget=None if a.full else a.budget, alpha=a.alpha, store_dtype=a.store_dtype,
        max_context_tokens=a.max_context_tokens,
        episodes=EpisodeConfig(window=a.window, episodes=a.episodes, medoids=a.medoids, seed=a.seed),
        prefill=PrefillConfig(block=a.block, selection=a.selection),
        calibration=CalibrationConfig(tokens=a.calibration_tokens, window=a.calibration_window,
                                      sink=min(128, a.calibration_window // 4)))


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        config = config_from_args(a)
        open_store(a.store)
    except (ValueError, StoreError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if not ray.is_initialized():  # a cluster job (RAY_ADDRESS) joins it; otherwise a local Ray
        ray.init(logging_level=logging.WARNING, runtime_env={"env_vars": _WORKER_ENV},
                 **({} if os.environ.get("RAY_ADDRESS") else {"include_dashboard": False}))
    gpus = a.gpus_per_task if a.gpus_per_task is not None else \
        (1 if ray.cluster_resources().get("GPU", 0) > 0 else 0)
    start = time.perf_counter()
    try:
        summary = run_build(a.corpus, a.store, config, force=a.force, on_bad_record=a.on_bad_record,
                            max_in_flight=a.max_in_flight, num_cpus=a.cpus_per_task,
                            num_gpus=gpus, max_retries=a.max_retries, progress=not a.no_progress)
    except (CorpusError, StoreError, models.ModelNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(summary.line(time.perf_counter() - start, a.store))
    for cid, err in summary.failed.items():
        print(f"failed {cid}: {err}", file=sys.stderr)
    return 1 if summary.failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
