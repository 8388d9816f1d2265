"""Stage 1 of a build, whichever way a conversation goes: clustered (a new or changed record),
its new turns planned onto the stored episodes (a grown record: `pipeline.builder.growth`), or
its damaged objects planned for rebuilding (`pipeline.builder.repair`)."""

from __future__ import annotations

import time
from dataclasses import replace

from pipeline.builder.cluster import ClusterResult, cluster_conversation, fit_context, is_episodic
from pipeline.builder.growth import AppendPlan, plan_append
from pipeline.builder.repair import Damage, RepairPlan, plan_repair
from pipeline.builder.turns import write_turn_index
from pipeline.config import BuildConfig, GrowthConfig
from pipeline.corpus.schema import Conversation
from pipeline.kv import models
from pipeline.store.backends.base import Store
from pipeline.store.catalogue.manifest import ManifestRecord

Plan = ClusterResult | AppendPlan | RepairPlan  # stage 1's product, whichever way it went


def prefilled_episodes(planned: Plan) -> tuple[int, ...]:
    """The episodes stage 3 prefills: a repair's damaged ones, every episode otherwise (in the
    tasks `task_groups` makes of them)."""
    if isinstance(planned, RepairPlan):
        return planned.damaged
    return tuple(range(planned.n_episodes))


def task_groups(planned: Plan, config: BuildConfig) -> tuple[tuple[int, ...], ...]:
    """The episodes each stage-3 task prefills: all of a conversation's in one task when they
    are built in one pass (a clustering's or a repair's), else one task per episode (block
    prefill; an append goes on from each stored cache on its own)."""
    episodes = prefilled_episodes(planned)
    if config.prefill.one_pass and not isinstance(planned, AppendPlan) and episodes:
        return (episodes,)
    return tuple((e,) for e in episodes)


def kept_records(planned: Plan) -> tuple[ManifestRecord, ...]:
    """The stored records committed again as they are: a repair's undamaged episodes (none for
    a clustering or an append, whose every episode is prefilled)."""
    return planned.kept() if isinstance(planned, RepairPlan) else ()


def plan_conversation(conv: Conversation, config: BuildConfig,
                      previous: list[ManifestRecord] | None = None,
                      growth: GrowthConfig = GrowthConfig(),
                      store: Store | None = None, damage: Damage | None = None) -> Plan:
    """Stage 1: the clustering of `conv`; or, given the stored version of a conversation that
    grew (`previous`), the plan of appending its new turns when the growth rule allows it; or,
    given the `damage` of a current stored version, the plan of its repair when its manifest
    allows one (a clustering says why it is not appended or repaired, `reclustered`). Given
    the `store`, the conversation's turn index is written there too (extended from
    `previous`'s when it grew; a repair writes it only when it was damaged) and named in the
    result."""
    start = time.perf_counter()
    if damage is not None and previous and store is not None:
        plan = plan_repair(conv, previous, damage, config, store)
        if isinstance(plan, RepairPlan):
            return plan
        planned = replace(cluster_conversation(conv, config), reclustered=plan)
        previous = None  # its turn index may be the damage: embedded again, not extended
    elif not previous:
        planned = cluster_conversation(conv, config)
    else:
        fitted = fit_context(conv, config)
        plan = plan_append(fitted, previous, config, growth, is_episodic(config))
        planned = replace(plan, seconds=time.perf_counter() - start) \
            if isinstance(plan, AppendPlan) else \
            replace(cluster_conversation(fitted, config, fit=False), reclustered=plan)
    if store is None:
        return planned
    index = write_turn_index(planned.conversation, models.load_encoder(config.encoder),
                             config.encoder, planned.encoder_fingerprint, store, previous,
                             models.load_tokenizer(config.model))
    return replace(planned, turn_index=index, seconds=time.perf_counter() - start)
