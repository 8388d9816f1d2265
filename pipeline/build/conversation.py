"""Stage 4 of a build, the commit, and the whole build of one conversation in one process.

The manifest is the commit point: it is written last, once every object it names is in the store
at the size written. The Ray job (`pipeline.build.driver`) fans the same stages out as tasks.
"""

from __future__ import annotations

import logging

from pipeline.build.cluster import cluster_conversation
from pipeline.build.config import BuildConfig
from pipeline.build.episode import build_episode
from pipeline.build.profile import layer_budgets
from pipeline.corpus.schema import Conversation
from pipeline.kv import models
from pipeline.store import cache_format
from pipeline.store.base import ObjectNotFound, Store
from pipeline.store.manifest import ManifestError, ManifestRecord, read_manifest, write_manifest

log = logging.getLogger(__name__)


def is_built(store: Store, conversation_id: str, config: BuildConfig) -> bool:
    """Whether the conversation's manifest carries this configuration; a corrupt manifest is
    not a build (rebuilding replaces it), so it is logged and the conversation rebuilt."""
    try:
        records = read_manifest(store, conversation_id)
    except ManifestError as e:
        log.warning("%s; rebuilding the conversation", e)
        return False
    return bool(records) and all(r.config_hash == config.hash for r in records)


def check_stored(store: Store, key: str, size: int) -> None:
    """The object is in the store with the size written: one HEAD, no download. Its content
    is trusted to the write (a local store renames a complete file into place; S3 checks the
    upload's checksum), the SHA-256 the worker computed of what it wrote goes in the manifest,
    and every reader verifies it (a full re-read is `jobs.gc --verify`)."""
    try:
        stored = store.info(key).size
    except ObjectNotFound:
        raise cache_format.CacheCorruptError(f"cache object {key} is missing from the store") from None
    if stored != size:
        raise cache_format.CacheCorruptError(f"cache object {key} holds {stored} bytes, "
                                         f"{size} were written")


def commit_manifest(store: Store, conversation_id: str, records: list[ManifestRecord]) -> None:
    """Write the manifest last, once every object it names is in the store at its size."""
    for record in records:
        check_stored(store, record.object_key, record.object_bytes)
    write_manifest(store, conversation_id, records)


def build_conversation(conv: Conversation, config: BuildConfig, store: Store) -> list[ManifestRecord]:
    """The whole build of one conversation in this process (the Ray job fans the same steps out)."""
    clustered = cluster_conversation(conv, config)
    lm = models.load_llm(config.model)
    budgets = layer_budgets(store, config, lm.config.num_hidden_layers)
    records = [build_episode(clustered, e, budgets, config, store)
            for e in range(len(clustered.episodes.episodes))]
    commit_manifest(store, conv.conversation_id, records)
    return records
