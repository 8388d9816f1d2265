"""Where the jobs start Ray, and the environment its workers get: quiet, offline model libraries.

The variables go to the workers through Ray's runtime environment, set where Ray starts, so a
worker has them before it imports anything; the driver's own environment is left as the user
set it (importing a job module changes nothing). Under `ray job submit` they are merged with
the job's own runtime environment (working dir, variables).
"""

from __future__ import annotations

import logging
import os

import ray

WORKER_ENV: dict[str, str] = {
    "TOKENIZERS_PARALLELISM": "false",  # workers are forked after tokenizers may have run
    "TRANSFORMERS_VERBOSITY": "error",
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",
    # transformers' GGUF loading draws its "Converting and de-quantizing GGUF tensors" bar with
    # plain tqdm (not its own switchable one): tqdm >= 4.66 reads TQDM_* defaults from the
    # environment when imported, so no bar is drawn in a worker (the driver's are untouched).
    "TQDM_DISABLE": "1",
    "HF_HUB_OFFLINE": "1",  # models come from local packages: never reach for the hub
}


def init_ray(address: str | None = None, metrics_port: int | None = None) -> None:
    """Join the cluster named by `address` / $RAY_ADDRESS, else start a local Ray, exporting
    its metrics (Prometheus text, `pipeline.telemetry`'s beside Ray's) on `metrics_port` when
    given (a joined cluster's port is the one its `ray start` named)."""
    if ray.is_initialized():
        return
    address = address or os.environ.get("RAY_ADDRESS") or None
    local = {} if address else {"include_dashboard": False}
    if metrics_port is not None and not address:
        local["_metrics_export_port"] = metrics_port
    ray.init(address=address or "local", logging_level=logging.WARNING,
             runtime_env={"env_vars": WORKER_ENV}, **local)
