"""Stage 4 of a build, the commit, and the one build of a conversation (`build_conversation`).

A conversation's build is, in this order: the build's basis (stage 2: the layer budgets and the
model files, once per build), the skip check against its stored version (`stored_version`), the
plan (stage 1: clustered, appended to or repaired, its turn index stored), each planned episode
prefilled and stored (stage 3), then the commit (`commit_build`: the manifest written last, once
every object it names is in the store at the size written, with the build's model files).
`build_conversation` runs them in one process (the benchmarks, the tests, the evaluation's cells,
the demo's full-history reference); the Ray driver (`pipeline.builder.driver`) runs the same
stage functions in the same order, stages 1 and 3 as tasks, and commits through `commit_build`.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import NamedTuple

from pipeline.builder.append import prefill_episodes
from pipeline.builder.episode import BuiltEpisode
from pipeline.builder.plan import Plan, kept_records, plan_conversation, task_groups
from pipeline.builder.profile import BuildBasis, build_basis
from pipeline.builder.repair import Damage, find_damage
from pipeline.config import BuildConfig, GrowthConfig, ModelFingerprints
from pipeline.corpus.history import history_change, turns_digest
from pipeline.corpus.schema import Conversation
from pipeline.kv import models
from pipeline.store.backends.base import ObjectNotFound, Store
from pipeline.store.catalogue.manifest import (
    ManifestError,
    ManifestRecord,
    read_manifest,
    write_manifest,
)
from pipeline.store.objects import cache_format

log = logging.getLogger(__name__)


class ModelFilesDifferError(RuntimeError):
    """Episodes of one conversation built with model files other than the build's."""


def built_with(record: ManifestRecord) -> ModelFingerprints:
    """The fingerprints of the files a manifest record was built with (None: before they were
    recorded)."""
    return ModelFingerprints(record.model_fingerprint, record.encoder_fingerprint)


def files_of(config: BuildConfig) -> ModelFingerprints:
    """The fingerprints of the model and encoder files `config` names, as they are now."""
    return ModelFingerprints(models.llm_fingerprint(config.model),
                             models.encoder_fingerprint(config.encoder))


class StoredVersion(NamedTuple):
    """What the store holds of a conversation, against the build about to run."""
    reason: str | None  # why it is built again; None: current, skipped
    records: list[ManifestRecord] | None  # its manifest's (None: none that reads)
    damage: Damage | None = None  # what its objects lack ("damaged": repaired)

    @property
    def planned_from(self) -> list[ManifestRecord] | None:
        """The stored records stage 1 plans from: those of a conversation that grew (appended
        to) or whose objects are damaged (repaired); None: it is clustered afresh."""
        return self.records if self.reason in ("grown", "damaged") else None


def stored_version(store: Store, conversation_id: str, config: BuildConfig,
                   files: ModelFingerprints, conv: Conversation | None = None,
                   verify: bool = False) -> StoredVersion:
    """The conversation's stored build, and why it is built again (None when current): this
    configuration (`BuildConfig.matches`: its hash, or a stored configuration that hashes as it
    under today's rules), these model files, (given the record `conv`) the same turns, and every
    object the manifest names in the store at its recorded size (`find_damage`; with `verify`
    also read and checksummed). "grown" is the one reason an append may answer, "damaged" the
    one a repair may. A manifest without fingerprints predates them; a corrupt manifest is not
    a build (rebuilding replaces it, so it is logged)."""
    try:
        records = read_manifest(store, conversation_id)
    except ManifestError as e:
        log.warning("%s; rebuilding the conversation", e)
        return StoredVersion("corrupt manifest", None)
    if not records:
        return StoredVersion("no manifest", None)
    if not all(config.matches(h, j) for h, j in {(r.config_hash, r.config_json) for r in records}):
        return StoredVersion("configuration changed", records)
    if any(built_with(r) != files for r in records):
        return StoredVersion("model files changed", records)
    first = records[0]
    change = None
    if conv is not None and first.source_turns is not None and first.source_digest is not None:
        change = history_change(conv.turns, first.source_turns, first.source_digest)
        change = None if change == "unchanged" else change
    if change not in (None, "grown"):
        return StoredVersion(change, records)
    damage = find_damage(store, records, verify)
    if damage is None:
        return StoredVersion(change, records)
    # a grown record whose caches are damaged cannot be appended to: it is rebuilt whole
    return StoredVersion("damaged" if change is None else "damaged and grown", records, damage)


def rebuild_reason(store: Store, conversation_id: str, config: BuildConfig,
                   files: ModelFingerprints, conv: Conversation | None = None) -> str | None:
    """Why the conversation is built again (`stored_version`), None when it is current."""
    return stored_version(store, conversation_id, config, files, conv).reason


def is_built(store: Store, conversation_id: str, config: BuildConfig,
             files: ModelFingerprints, conv: Conversation | None = None) -> bool:
    return rebuild_reason(store, conversation_id, config, files, conv) is None


def with_source(records: list[ManifestRecord], conv: Conversation) -> list[ManifestRecord]:
    """The records, marked with the record's turns they were built from."""
    turns, digest = len(conv.turns), turns_digest(conv.turns)
    return [dataclasses.replace(r, source_turns=turns, source_digest=digest) for r in records]


def check_same_files(records: list[ManifestRecord], files: ModelFingerprints) -> None:
    """Every episode was built with the model files the build started with: a node whose copy
    of a model differs (or files replaced mid-build) fails the conversation, never a manifest
    mixing caches of two models."""
    for record in records:
        if built_with(record) != files:
            got = built_with(record)
            raise ModelFilesDifferError(
                f"episode {record.episode} was built by {record.worker} with model files "
                f"{got.model}/{got.encoder} (model/encoder fingerprints), not the "
                f"{files.model}/{files.encoder} this build started with: every node needs the "
                "same model files")


def check_stored(store: Store, key: str, size: int, what: str = "cache object") -> None:
    """The object is in the store with the size written: one HEAD, no download. Its content
    is trusted to the write (a local store renames a complete file into place; S3 checks the
    upload's checksum), the SHA-256 the worker computed of what it wrote goes in the manifest,
    and every reader verifies it (a full re-read is `jobs.gc --verify`)."""
    try:
        stored = store.info(key).size
    except ObjectNotFound:
        raise cache_format.CacheCorruptError(f"{what} {key} is missing from the store") from None
    if stored != size:
        raise cache_format.CacheCorruptError(f"{what} {key} holds {stored} bytes, "
                                             f"{size} were written")


def commit_manifest(store: Store, conversation_id: str, records: list[ManifestRecord],
                    files: ModelFingerprints | None = None) -> None:
    """Write the manifest last, once every object it names is in the store at its size (and,
    given `files`, was built with those model files)."""
    if files is not None:
        check_same_files(records, files)
    for record in records:
        check_stored(store, record.object_key, record.object_bytes)
    for index in {r.turn_index for r in records} - {None}:
        check_stored(store, index.key, index.size, "turn index")
    write_manifest(store, conversation_id, records)


def commit_build(store: Store, source: Conversation, records: list[ManifestRecord],
                 files: ModelFingerprints) -> list[ManifestRecord]:
    """Stage 4: the records marked with the record they were built from (`with_source`: what
    the next build's skip check compares), then committed (`commit_manifest`, checked against
    the build's model files). Returns the records as committed."""
    records = with_source(records, source)
    commit_manifest(store, source.conversation_id, records, files)
    return records


# Stage 3 as a caller runs it, for the episodes of one task (`task_groups`): `prefill_episodes`
# (the records only, as a Ray task returns them; any plan) or
# `pipeline.builder.episode.build_episode_caches` (a clustering's episodes with their caches
# kept in memory as built, `BuiltEpisode`: what the evaluation measures).
EpisodeStage = Callable[[Plan, tuple[int, ...], list[int] | None, BuildConfig, Store],
                        list[ManifestRecord] | list[BuiltEpisode]]


@dataclasses.dataclass(frozen=True)
class BuiltConversation:
    """A conversation's build, committed: its manifest's records (by episode), stage 1's plan
    (the conversation as built, its episodes, its turn index), and the caches of the episodes
    prefilled, as built, where stage 3 kept them (`build_episode_cache`; none otherwise)."""
    records: list[ManifestRecord]
    planned: Plan
    built: tuple[BuiltEpisode, ...] = ()


def build_conversation(conv: Conversation, config: BuildConfig, store: Store,
                       growth: GrowthConfig = GrowthConfig(), verify: bool = False, *,
                       basis: BuildBasis | None = None,
                       prefill: EpisodeStage = prefill_episodes) -> BuiltConversation:
    """The one build of a conversation, every stage in this process (the Ray driver runs the
    same stages as tasks): a conversation that grew since its stored build is appended to when
    `growth` allows, one whose stored objects are damaged has those rebuilt (`verify`: read and
    checksummed to find them), any other is built whole (a current one too: callers skip it,
    `is_built`). `basis` gives the budgets and model files when the caller has them (the
    evaluation allocates its budgets from a profile of its own); `prefill` is stage 3."""
    basis = build_basis(store, config) if basis is None else basis
    version = stored_version(store, conv.conversation_id, config, basis.files, conv, verify)
    planned = plan_conversation(conv, config, version.planned_from, growth, store,
                                version.damage)
    done = [d for group in task_groups(planned, config)
            for d in prefill(planned, group, basis.budgets, config, store)]
    built = tuple(d for d in done if isinstance(d, BuiltEpisode))
    records = [d.record if isinstance(d, BuiltEpisode) else d for d in done]
    records = commit_build(store, conv, records + list(kept_records(planned)), basis.files)
    return BuiltConversation(sorted(records, key=lambda r: r.episode), planned, built)
