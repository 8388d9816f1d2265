"""A built conversation whose store lost or damaged some of its objects: those rebuilt alone.

A build's skip check does not trust a manifest: it confirms that every object the manifest
names is in the store at its recorded size (one batched size lookup, no download; with
`--verify` each is also read and checksummed:
`pipeline.store.catalogue.garbage.conversation_faults`). What fails is repaired: each damaged
episode's cache is prefilled again (all of them in one pass when the build runs in one pass) from
what its manifest record keeps (the patch text, the
episode's turns, the turns the caches hold), and a damaged turn index is embedded again. The other
episodes keep their objects and records, the repaired caches go under keys of their own content
(nothing served is overwritten: a deterministic rebuild writes the very key that was damaged, with
the right bytes), and the commit replaces the manifest.

A repaired episode is the episode as a build of its whole history makes it: an episode that was
appended to comes back as a build of all its turns (docs/building.md). A manifest that
lacks what a repair goes on from (written before appends or before the record's turns were
recorded), or a record whose turns no longer render to the tokens the caches held, is
re-clustered and rebuilt whole instead.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

from pipeline.builder.episode import (
    cache_fields,
    episode_scorer,
    index_fields,
    prefill_and_store,
)
from pipeline.builder.growth import Recluster
from pipeline.builder.turns import write_turn_index
from pipeline.config import BuildConfig
from pipeline.corpus.render import render_conversation
from pipeline.corpus.schema import Conversation
from pipeline.kv import models, prompts
from pipeline.store.backends.base import Store
from pipeline.store.catalogue.garbage import Fault, conversation_faults
from pipeline.store.catalogue.manifest import ManifestRecord
from pipeline.store.objects.turn_index import StoredIndex


@dataclass(frozen=True)
class Damage:
    """What a built conversation's store does not hold as its manifest says: the episodes whose
    cache object is missing or fails its check, and whether its turn index does."""
    episodes: tuple[int, ...]
    turn_index: bool
    faults: tuple[Fault, ...]  # one per damaged object, for the log

    def describe(self) -> str:
        return "; ".join(f"{f.kind} {f.key}" for f in self.faults)


def find_damage(store: Store, records: list[ManifestRecord], verify: bool = False
                ) -> Damage | None:
    """The damage of a built conversation's objects (`conversation_faults`), None when the
    store holds them all as recorded."""
    faults = conversation_faults(store, records, verify)
    if not faults:
        return None
    keys = {f.key for f in faults}
    index = records[0].turn_index
    return Damage(tuple(sorted(r.episode for r in records if r.object_key in keys)),
                  index is not None and index.key in keys, tuple(faults))


@dataclass(frozen=True)
class RepairPlan:
    """Stage 1 of a repair: the conversation as its caches hold it, its stored records, and
    which episodes are rebuilt (the turn index, stored again when it was damaged, is named)."""
    conversation: Conversation  # the record cut to the turns the caches hold
    previous: tuple[ManifestRecord, ...]  # the stored version, by episode
    damaged: tuple[int, ...]
    turn_index: StoredIndex | None
    seconds: float = 0.0

    @property
    def n_episodes(self) -> int:
        return len(self.previous)

    def kept(self) -> tuple[ManifestRecord, ...]:
        """The records of the episodes that are not rebuilt, naming the turn index."""
        return tuple(dataclasses.replace(r, **index_fields(self.turn_index))
                     for r in self.previous if r.episode not in self.damaged)


_REPAIR_STATE = ("cache_turns", "member_turn_ids", "source_digest")


def plan_repair(conv: Conversation, previous: list[ManifestRecord], damage: Damage,
                config: BuildConfig, store: Store) -> RepairPlan | Recluster:
    """The repair of `damage` in the stored version `previous` of `conv` (a record whose turns
    are the ones built: the skip check found it current), or why it is rebuilt whole."""
    start = time.perf_counter()
    previous = sorted(previous, key=lambda r: r.episode)
    first = previous[0]
    if any(getattr(r, name) is None for r in previous for name in _REPAIR_STATE):
        return Recluster("damaged", f"{damage.describe()}; its manifest predates repairs")
    held = dataclasses.replace(conv, turns=conv.turns[:first.cache_turns])
    tokenizer = models.load_tokenizer(config.model)
    if len(prompts.context_ids(tokenizer, render_conversation(held).text)) != first.tokens:
        return Recluster("damaged", f"{damage.describe()}; its turns no longer render to the "
                                    f"{first.tokens} tokens its caches held")
    index = first.turn_index
    if damage.turn_index:
        index = write_turn_index(held, models.load_encoder(config.encoder), config.encoder,
                                 models.encoder_fingerprint(config.encoder), store,
                                 tokenizer=tokenizer)
    return RepairPlan(held, tuple(previous), damage.episodes, index,
                      time.perf_counter() - start)


def repair_episodes(plan: RepairPlan, episodes: tuple[int, ...], budgets: list[int] | None,
                    config: BuildConfig, store: Store) -> list[ManifestRecord]:
    """The damaged episodes' caches prefilled again from their records (in one pass when the
    build says so), stored, and the records brought up to date (their clustering and append
    state kept)."""
    before = {e: dataclasses.replace(plan.previous[e], **index_fields(plan.turn_index))
              for e in episodes}
    tokenizer = models.load_llm(config.model).tokenizer
    scorers = {e: episode_scorer(tokenizer, plan.conversation, record.medoid_text,
                                 tuple(record.member_turn_ids), config)
               for e, record in before.items()}
    encoder = before[episodes[0]].encoder_fingerprint
    built = prefill_and_store(plan.conversation, scorers, budgets, config, store, encoder)
    return [dataclasses.replace(
        before[e], layer_budgets=budgets, model_fingerprint=built[e].files.model,
        **cache_fields(built[e].stored, built[e].cache, built[e].stats, config))
        for e in episodes]
