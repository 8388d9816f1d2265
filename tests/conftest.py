"""Shared fixtures: a local Ray and a store built once with the real SmolLM2 and MiniLM."""

from __future__ import annotations

import logging
import os

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="session")
def ray_local():
    """A real local Ray (2 CPUs), stopped after the session."""
    import ray

    from jobs.environment import WORKER_ENV

    ray.init(num_cpus=2, include_dashboard=False, logging_level=logging.WARNING,
             runtime_env={"env_vars": WORKER_ENV})
    yield ray
    ray.shutdown()


# A real S3 server (SeaweedFS on 127.0.0.1, free ports) for the S3 store and cluster tests:
# `s3_server` for the session, `s3_env` to point this process's AWS variables at it.
from s3_server import s3_env, s3_server  # noqa: E402,F401
