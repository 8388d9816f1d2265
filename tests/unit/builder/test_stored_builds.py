"""Stores built before the build's hash covered only what its method reads are still current:
the skip check (`stored_version`) finds them complete, so nothing is rebuilt, and the answer
path reads them (manifest, model check, route, verified cache read). They are made here as
those builds made them: the hash and JSON of `tests/support/legacy_hash.py`, objects under the
configuration hash bound to the model files."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from lab.rehearsal import SYNTHETIC_FILES, synthetic_cache
from pipeline.answer.lookup import check_models, load_manifest, route_records
from pipeline.builder.conversation import stored_version
from pipeline.config import BuildConfig, EpisodeConfig, RoutingConfig, ScoringConfig
from pipeline.store.backends.base import cache_key
from pipeline.store.backends.local import LocalStore
from pipeline.store.catalogue.manifest import ManifestRecord, write_manifest
from pipeline.store.objects import cache_format
from pipeline.store.objects.cache_read import read_cache
from tests.support.legacy_hash import legacy_hash, legacy_json

SYNTHETIC = BuildConfig(model="synthetic", encoder="synthetic", budget=16)


def legacy_store(store: LocalStore, cid: str, config: BuildConfig, episodes: int = 2) -> None:
    """Conversation `cid` committed as a build before capability hashes committed it: each
    episode's object under the legacy hash bound to the files, then the manifest carrying the
    legacy hash and configuration JSON."""
    old = legacy_hash(config)
    rows = []
    for e in range(episodes):
        data = synthetic_cache(cid, e, 8, config)
        key = cache_key(cid, SYNTHETIC_FILES.bound_hash(old), e, cache_format.sha256(data))
        store.put(key, data)
        rows.append(ManifestRecord.from_row({
            "conversation_id": cid, "episode": e, "object_key": key, "object_bytes": len(data),
            "sha256": cache_format.sha256(data), "centroid": [1.0, 0.0] if e == 0 else [0.0, 1.0],
            "tokens": 8, "config_hash": old, "config_json": legacy_json(config),
            "model_id": config.model, "encoder_id": config.encoder, "scorer": config.scorer,
            "model_fingerprint": SYNTHETIC_FILES.model,
            "encoder_fingerprint": SYNTHETIC_FILES.encoder}))
    write_manifest(store, cid, rows)


def _with(scorer: str, **changes) -> BuildConfig:
    return dataclasses.replace(SYNTHETIC, scorer=scorer, **changes)


# (built then with, built now with): each stored build is the build asked for now
CURRENT = {
    "the default": (_with("epicache"), _with("epicache")),
    "a baseline": (_with("snapkv"), _with("snapkv")),
    "the full cache": (_with("full", budget=None), _with("full", budget=None)),
    # the old command line took options a baseline never read; the hash covered them
    "a baseline given options it never read": (
        _with("streamingllm", scoring=ScoringConfig(focus=3.0),
              episodes=EpisodeConfig(episodes=3, window=6)), _with("streamingllm")),
}


@pytest.mark.parametrize("case", list(CURRENT))
def test_a_store_built_before_is_current_and_answers(case, tmp_path):
    built, now = CURRENT[case]
    store = LocalStore(tmp_path / "store")
    legacy_store(store, "conv-1", built)
    version = stored_version(store, "conv-1", now, SYNTHETIC_FILES)
    assert version.reason is None and version.damage is None, version.reason  # skipped
    records = load_manifest(store, "conv-1")  # the answer path, as jobs.answer and Serve take it
    check_models(records, now.model, now.encoder, model_fingerprint=SYNTHETIC_FILES.model,
                 encoder_fingerprint=SYNTHETIC_FILES.encoder)
    read, _ = route_records(np.array([0.1, 1.0]), records, RoutingConfig("centroid", 0.0))
    assert [r.episode for r in read] == [1]
    assert read_cache(store, read[0].ref).cache is not None


@pytest.mark.parametrize("built, now", [
    (_with("epicache", scoring=ScoringConfig(focus=3.0)), _with("epicache")),  # it reads scoring
    (_with("snapkv", budget=32), _with("snapkv")),
    (_with("snapkv"), _with("keydiff")),
])
def test_a_store_built_otherwise_is_rebuilt(built, now, tmp_path):
    store = LocalStore(tmp_path / "store")
    legacy_store(store, "conv-1", built)
    assert stored_version(store, "conv-1", now, SYNTHETIC_FILES).reason == "configuration changed"
