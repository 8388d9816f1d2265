"""One build of a conversation (`pipeline.builder.conversation.build_conversation`): the Ray
driver splits a plan as it does, the evaluation's cells and the demo's full-history reference
build through it and commit through the product's checked commit, and their figures are those
of the stages run one by one, as the cell and the demo ran them before (tiny offline models)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import replace

import pytest
import torch

from lab import compare
from pipeline.builder import conversation as conversation_module
from pipeline.builder.cluster import cluster_conversation
from pipeline.builder.conversation import BuiltConversation, build_conversation
from pipeline.builder.plan import kept_records, prefilled_episodes, task_groups
from pipeline.builder.tasks import Planned
from pipeline.builder.turns import index_turns
from pipeline.config import BuildConfig, EpisodeConfig, PrefillConfig
from pipeline.corpus.synthetic import make_corpus
from pipeline.eval import cell as cell_module
from pipeline.eval.cell import evaluate_cell, history_ids, prepare
from pipeline.eval.methods import EvalConfig
from pipeline.kv import models
from pipeline.kv.methods.full import Full
from pipeline.kv.prefill import block_prefill
from pipeline.store.backends.memory import MemoryStore
from pipeline.store.catalogue.manifest import read_manifest, write_manifest
from pipeline.store.objects import cache_format
from pipeline.store.objects.turn_index import store_turn_index
from tests.support.model_folders import make_model_folders

TIMING = {"cell_seconds", "build_seconds"}  # wall-clock fields, never the same twice


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> tuple[str, str]:
    return tuple(map(str, make_model_folders(tmp_path_factory.mktemp("one-build-models"))))


def _eval_config(folders: tuple[str, str]) -> EvalConfig:
    llm, encoder = folders
    return EvalConfig(BuildConfig(model=llm, encoder=encoder, prefill=PrefillConfig(block=128),
                                  episodes=EpisodeConfig(episodes=2, medoids=1)),
                      questions_per_conversation=3, generate=True, generate_questions=1,
                      max_new_tokens=2)


def _by_hand(conv, build, store, *, basis, prefill) -> BuiltConversation:
    """The cell's build as it was sequenced before the one build: stage 1 without the store,
    the turn index embedded and stored, each episode's stage 3, the manifest written unchecked."""
    clustered = cluster_conversation(conv, build)
    index = index_turns(clustered.conversation, models.load_encoder(build.encoder), build.encoder,
                        clustered.encoder_fingerprint, tokenizer=models.load_tokenizer(build.model))
    clustered = replace(clustered, turn_index=store_turn_index(index, store))
    built = tuple(b for e in range(clustered.n_episodes)
                  for b in prefill(clustered, (e,), basis.budgets, build, store))
    write_manifest(store, conv.conversation_id, [b.record for b in built])
    return BuiltConversation([b.record for b in built], clustered, built)


def _same(a, b) -> bool:
    """Equal to the bit, NaN equal to NaN, through lists and dicts."""
    if isinstance(a, float) and isinstance(b, float):
        return (math.isnan(a) and math.isnan(b)) or a == b
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return a == b


@pytest.mark.parametrize("method, budget", [("epicache", 32), ("snapkv+topup.enabled=true", 32),
                                            ("full", None)])
def test_a_cells_records_are_those_of_its_stages_run_by_hand(folders, monkeypatch, method,
                                                             budget):
    """The evaluation's figures do not depend on the orchestration: a cell built by the one
    build gives the very records (every field, to the bit, but the wall-clock ones) that the
    stages run one by one gave it, answers through the answer path included."""
    config = _eval_config(folders)
    prep = prepare(make_corpus(1, 250, seed=11)[0], config)
    through_the_build = evaluate_cell(prep, method, budget, config, None)
    monkeypatch.setattr(cell_module, "build_conversation", _by_hand)
    by_hand = evaluate_cell(prep, method, budget, config, None)
    assert len(through_the_build) == len(by_hand) == len(prep.questions) > 0
    for one, other in zip(through_the_build, by_hand):
        assert one.keys() == other.keys()
        assert [k for k in one if k not in TIMING and not _same(one[k], other[k])] == []
    if method == "epicache":
        assert all("prediction" in r for r in through_the_build[:1])  # answered from its store


def test_a_cell_commits_its_manifest_through_the_checked_commit(folders, monkeypatch):
    """An episodic cell's manifest is committed by the product's commit (its objects and turn
    index checked in the store, its model files the build's), naming the caches measured."""
    config = _eval_config(folders)
    prep = prepare(make_corpus(1, 250, seed=11)[0], config)
    commits, checked = [], []
    commit, check = conversation_module.commit_manifest, conversation_module.check_stored

    def spy_commit(store, conversation_id, records, files=None):
        commit(store, conversation_id, records, files)
        commits.append((files, read_manifest(store, conversation_id)))

    monkeypatch.setattr(conversation_module, "commit_manifest", spy_commit)
    monkeypatch.setattr(conversation_module, "check_stored",
                        lambda store, key, size, what="cache object":
                        checked.append(what) or check(store, key, size, what))
    records = evaluate_cell(prep, "epicache", 32, config, None)
    [(files, manifest)] = commits
    assert files is not None and {r.model_fingerprint for r in manifest} == {files.model}
    assert checked.count("turn index") == 1 and checked.count("cache object") == len(manifest)
    assert {e for r in records for e in r["read"]} <= {r.episode for r in manifest}
    assert all(r.source_turns == len(prep.conversation.turns) for r in manifest)


def test_the_driver_splits_a_plan_as_the_one_build_does(folders):
    """The driver's view of stage 1 (`Planned`) names the episodes the one build prefills and
    the records it commits again, whichever way the plan went."""
    llm, encoder = folders
    config = BuildConfig(model=llm, encoder=encoder, budget=32, prefill=PrefillConfig(block=128),
                         episodes=EpisodeConfig(episodes=2, medoids=1))
    store = MemoryStore("one-build-driver")
    try:
        built = build_conversation(make_corpus(1, 250, seed=3)[0], config, store)
        planned = Planned.of(built.planned, config)
        assert prefilled_episodes(built.planned) == (0, 1)
        assert planned.tasks == task_groups(built.planned, config) == ((0,), (1,))
        assert planned.kept == kept_records(built.planned) == ()
        assert [r.episode for r in built.records] == [0, 1] and built.built == ()
        one_pass = dataclasses.replace(config, prefill=PrefillConfig(block=128, one_pass=True))
        assert Planned.of(built.planned, one_pass).tasks == ((0, 1),)  # one task builds both
    finally:
        store.drop()


def test_the_demos_full_reference_is_the_one_builds_full_cache(folders):
    """`jobs.demo`'s full-history cache, built by the one build (the `full` method) and read
    back, holds exactly what prefilling the whole history without eviction and taking it
    through the store's dtype held (how the demo made it before)."""
    llm, encoder = folders
    config = BuildConfig(model=llm, encoder=encoder, budget=32, prefill=PrefillConfig(block=128),
                         episodes=EpisodeConfig(episodes=2, medoids=1), store_dtype="float16")
    conv = make_corpus(1, 250, seed=5)[0]
    lm = models.load_llm(llm)
    full, none = compare.reference_caches(lm, conv, config)
    by_hand, _ = block_prefill(lm.model, history_ids(lm.tokenizer, conv), Full(), None,
                               config.prefill)
    data = cache_format.serialize(by_hand, {}, torch.float16)
    by_hand = cache_format.deserialize(data, None, dtype=lm.model.dtype)[0]
    assert full.tokens_seen == by_hand.tokens_seen > none.tokens_seen
    for ours, theirs in zip(full.layers, by_hand.layers):
        assert torch.equal(ours.valid, theirs.valid)
        assert torch.equal(ours.positions, theirs.positions)
        assert torch.equal(ours.keys, theirs.keys) and torch.equal(ours.values, theirs.values)
