"""Stage 2 of a build: the model's layer profile (measured once, stored), the layer budgets, and
the model files the build runs with (`build_basis`: found once per build)."""

from __future__ import annotations

import hashlib
import json
import time
from typing import NamedTuple

from pipeline.config import BuildConfig, ModelFingerprints
from pipeline.corpus.render import render_conversation
from pipeline.corpus.synthetic import make_conversation
from pipeline.kv import models, prompts
from pipeline.kv.budgets import Allocator, allocator_class
from pipeline.store.backends.base import Store, profile_key


def allocator(config: BuildConfig) -> Allocator:
    """The layer-budget allocator the configuration names, with its parameters (ValueError
    naming the known ones for another name)."""
    return allocator_class(config.allocator).from_config(config)


def calibration_text(config: BuildConfig) -> str:
    """A long, model-independent text: a synthetic multi-topic conversation (no dataset shipped)."""
    conv = make_conversation("calibration", target_tokens=int(config.calibration.tokens * 1.5),
                             seed=config.calibration.seed)
    return render_conversation(conv).text


def measure_profile(lm: models.LoadedModel, config: BuildConfig) -> list[float]:
    """The configured allocator's per-layer profile, measured on the calibration text."""
    cal = config.calibration
    ids = prompts.context_ids(lm.tokenizer, calibration_text(config))[:cal.tokens]
    return allocator(config).measure(lm.model, ids, cal).tolist()


def layer_profile(store: Store, config: BuildConfig) -> list[float]:
    """The model's per-layer profile for the configured allocator (Key similarity for
    "sensitivity", cumulative-attention variance for "variance"): read from the store, or
    measured once on the calibration text and stored."""
    cal = config.calibration
    strategy = allocator(config)
    # measured with other files of the model (a fine-tune in its folder), it is not its profile
    described = cal.as_dict() | {"model_fingerprint": models.llm_fingerprint(config.model)}
    if strategy.name != "sensitivity":  # sensitivity's key predates the other allocators
        described |= {"profile": strategy.name}
    cal_hash = hashlib.sha256(json.dumps(described, sort_keys=True).encode()).hexdigest()[:12]
    key = profile_key(models.model_key(config.model), cal_hash)
    if store.exists(key):
        return json.loads(store.get(key))["similarity"]
    lm = models.load_llm(config.model)
    start = time.perf_counter()
    sims = measure_profile(lm, config)
    # "similarity" holds the profile whatever the allocator (the key name predates D2O)
    store.put(key, json.dumps({"model_id": config.model, "calibration": cal.as_dict(),
                               "allocator": strategy.name, "similarity": sims,
                               "seconds": time.perf_counter() - start}, indent=1).encode())
    return sims


def layer_budgets(store: Store, config: BuildConfig, n_layers: int) -> list[int] | None:
    """Each layer's budget (None: no eviction); uniform, with no profile, where the allocator
    needs none."""
    budget = config.entry_budget
    if budget is None:
        return None
    strategy = allocator(config)
    if not strategy.needs_profile:
        return [budget] * n_layers
    return strategy.allocate(layer_profile(store, config), budget)


class BuildBasis(NamedTuple):
    """What every conversation of a build is built with, found once per build (by the Ray
    driver's budgets task): each layer's budget (None: no eviction) and the fingerprints of the
    model files, which every episode's record must carry (`commit_manifest` checks them)."""
    budgets: list[int] | None
    files: ModelFingerprints


def build_basis(store: Store, config: BuildConfig) -> BuildBasis:
    """Stage 2: the model loaded (here its fingerprint is that of the files loaded), the
    encoder's fingerprint, and the layer budgets (the profile measured into `store` once)."""
    lm = models.load_llm(config.model)
    files = ModelFingerprints(lm.fingerprint, models.encoder_fingerprint(config.encoder))
    return BuildBasis(layer_budgets(store, config, lm.config.num_hidden_layers), files)
