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

    from jobs.build import _WORKER_ENV

    ray.init(num_cpus=2, include_dashboard=False, logging_level=logging.WARNING,
             runtime_env={"env_vars": _WORKER_ENV})
    yield ray
    ray.shutdown()
