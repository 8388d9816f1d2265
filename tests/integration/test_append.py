"""Conversations that grow: the new turns appended to the stored caches (issue 26).

Tiny random model folders (a byte-level Llama and a one-layer sentence encoder), so each test
runs the real build code in seconds. Appending with the clustering held fixed gives the caches a
build of the whole history gives with the same episodes; a grown, an edited and an unchanged
record each take their path through the Ray job; a crash between the new objects and the
manifest leaves the old version readable and the re-run completes the append; the S3 store
(SeaweedFS) appends as a folder does.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from pipeline.builder import conversation as conversation_module
from pipeline.builder import plan as plan_module
from pipeline.builder.append import read_stored_cache
from pipeline.builder.cluster import ClusterResult, cluster_conversation
from pipeline.builder.conversation import build_conversation
from pipeline.builder.driver import run_build
from pipeline.builder.episode import build_episodes
from pipeline.builder.growth import AppendPlan, Recluster
from pipeline.builder.plan import plan_conversation
from pipeline.builder.profile import layer_budgets
from pipeline.builder.turns import index_turns, indexed_turns
from pipeline.config import (
    BuildConfig,
    CodeConfig,
    DriverOptions,
    EpisodeConfig,
    GrowthConfig,
    MergeConfig,
    PrefillConfig,
    TriStateConfig,
)
from pipeline.corpus.reader import write_jsonl
from pipeline.corpus.render import render_conversation
from pipeline.corpus.schema import Conversation
from pipeline.corpus.synthetic import make_conversation
from pipeline.kv import models, prompts
from pipeline.store.backends.local import LocalStore
from pipeline.store.catalogue.garbage import find_garbage
from pipeline.store.catalogue.manifest import read_manifest
from pipeline.store.objects.turn_index import read_turn_index
from tests.support.model_folders import make_model_folders
from tests.support.stores import store  # noqa: F401  (a folder, or a prefix in SeaweedFS)

BLOCK = 16
APPEND_ALWAYS = GrowthConfig(max_growth=100.0, far_similarity=-1.0)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    return make_model_folders(tmp_path_factory.mktemp("append-models"))


def small_config(folders, **overrides) -> BuildConfig:
    llm, encoder = folders
    settings = dict(budget=32, store_dtype="float32", prefill=PrefillConfig(block=BLOCK),
                    episodes=EpisodeConfig(episodes=2, medoids=1)) | overrides
    return BuildConfig(model=str(llm), encoder=str(encoder), **settings)


def aligned_history(config: BuildConfig, seed: int = 3) -> tuple[Conversation, Conversation]:
    """(its first sessions, the whole conversation): the first's tokens a whole number of blocks
    (its last turn padded), so a build of the whole history cuts its blocks at the append point."""
    whole = make_conversation("grow-0", target_tokens=700, seed=seed)
    sessions = sorted({t.session for t in whole.turns})
    cut = sum(1 for t in whole.turns if t.session in sessions[:len(sessions) // 2 + 1])
    tokenizer = models.load_tokenizer(config.model)
    count = lambda c: len(prompts.context_ids(tokenizer, render_conversation(c).text))  # noqa: E731
    turns = list(whole.turns)
    first = dataclasses.replace(whole, turns=tuple(turns[:cut]))
    pad = -count(first) % BLOCK
    turns[cut - 1] = dataclasses.replace(turns[cut - 1], text=turns[cut - 1].text + "." * pad)
    first = dataclasses.replace(whole, turns=tuple(turns[:cut]))
    assert count(first) % BLOCK == 0
    return first, dataclasses.replace(whole, turns=tuple(turns))


def layers_of(cache) -> list[tuple[torch.Tensor, ...]]:
    return [(layer.keys[0][layer.valid], layer.values[0][layer.valid], layer.positions[layer.valid])
            for layer in cache.layers]


# Cache kinds whose append equals the whole-history build (docs/building.md lists why the others
# differ: tri-state's final cut, D2O's threshold, DapQ's patch positions).
EXACT_KINDS = {
    "epicache": {},
    "compact positions": {"prefill": PrefillConfig(block=BLOCK, positions="compact",
                                                   compact_recent=0)},
    "compact, the recent tokens at their spacing": {
        "prefill": PrefillConfig(block=BLOCK, positions="compact", compact_recent=2 * BLOCK)},
    "full cache": {"scorer": "full", "budget": None},
    "streamingllm": {"scorer": "streamingllm"},
    "snapkv": {"scorer": "snapkv"},
}


@pytest.mark.parametrize("kind", ["epicache"])
def test_appending_with_clustering_held_fixed_equals_building_the_whole_history(folders, store,
                                                                                kind):
    config = small_config(folders, **EXACT_KINDS[kind])
    first, whole = aligned_history(config)
    built = build_conversation(first, config, store).records
    appended = build_conversation(whole, config, store, APPEND_ALWAYS).records
    assert len(appended) == len(built) >= (2 if config.scorer == "epicache" else 1)
    assert all(a.appends == 1 and a.cache_turns == len(whole.turns) for a in appended)
    # every window, old and new, is in its episode's window embeddings (the window router's)
    assert [len(a.window_embeddings) for a in appended] == [a.n_windows for a in appended]
    assert [len(b.window_embeddings) for b in built] == [b.n_windows for b in built]
    assert sum(a.n_windows for a in appended) > sum(b.n_windows for b in built)
    assert {a.object_key for a in appended}.isdisjoint(b.object_key for b in built)
    assert [a.tokens for a in appended] == [len(prompts.context_ids(
        models.load_tokenizer(config.model), render_conversation(whole).text))] * len(built)
    # The whole history, built with the episodes and members the append used.
    episodes = cluster_conversation(first, config).episodes
    fixed = ClusterResult(whole, episodes, 0.0, built[0].encoder_fingerprint,
                          tuple(tuple(a.member_turn_ids) for a in appended))
    budgets = layer_budgets(store, config, 2)
    lm = models.load_llm(config.model)
    members = [t for r in appended for t in r.member_turn_ids]
    assert sorted(members) == sorted(t.turn_id for t in whole.turns)  # each new turn placed once
    for e, record in enumerate(appended):
        assert set(built[e].member_turn_ids) <= set(record.member_turn_ids)
        [reference] = build_episodes(fixed, (e,), budgets, config, store)
        got, want = (layers_of(read_stored_cache(store, r, lm.model)) for r in (record, reference))
        for (k1, v1, p1), (k2, v2, p2) in zip(got, want):
            assert torch.equal(p1, p2)
            torch.testing.assert_close(k1, k2, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(v1, v2, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", [k for k in EXACT_KINDS if k != "epicache"])
def test_every_exact_kind_appends_as_it_builds(folders, tmp_path, kind):
    test_appending_with_clustering_held_fixed_equals_building_the_whole_history(
        folders, LocalStore(tmp_path / "store"), kind)


@pytest.mark.parametrize("kind", ["tri-state", "merging", "dapq", "one pass", "low-bit code"])
def test_the_other_kinds_append_within_their_budget(folders, tmp_path, kind):
    """Tri-state (its Quantized entries stay quantized), D2O merging, DapQ, caches built in one
    pass and caches stored in low-bit codes go on from the stored cache: every token seen once,
    within the budget, readable."""
    overrides = {
        # tri-state: a budget over its 32-token window of Original entries leaves room to quantize
        "tri-state": {"prefill": PrefillConfig(block=BLOCK, tristate=TriStateConfig(enabled=True)),
                      "budget": 96},
        "merging": {"prefill": PrefillConfig(block=BLOCK, merge=MergeConfig(enabled=True))},
        "dapq": {"prefill": PrefillConfig(block=BLOCK, decode_positions=True)},
        "one pass": {"prefill": PrefillConfig(block=BLOCK, one_pass=True)},
        # read back as floats, appended to, coded again; the budget in bytes: more entries
        "low-bit code": {"code": CodeConfig(bits=4, group=8, bytes_budget=True)}}[kind]
    config = small_config(folders, **overrides)
    store = LocalStore(tmp_path / "store")
    first, whole = aligned_history(config)
    built = build_conversation(first, config, store).records
    appended = build_conversation(whole, config, store, APPEND_ALWAYS).records
    lm = models.load_llm(config.model)
    for before, after in zip(built, appended):
        assert after.appends == 1 and after.tokens > before.tokens
        # the default positions ("auto") fall back to original where they cannot compact
        assert (after.positions_note is None) == (kind != "dapq")
        cache = read_stored_cache(store, after, lm.model)
        assert cache.tokens_seen == after.tokens
        for layer in cache.layers:  # each head holds each token once at most
            for head in range(layer.valid.shape[0]):
                kept = layer.positions[head][layer.valid[head]]
                assert kept.unique().numel() == kept.numel() and int(kept.max()) < after.tokens
        if kind == "tri-state":
            assert before.quantized_entries > 0 and after.quantized_entries > 0
            assert after.original_bytes + after.quantized_bytes <= \
                sum(after.layer_byte_budgets)
        else:
            assert max(after.entries_per_layer) <= config.entry_budget
        if kind == "low-bit code":
            assert config.entry_budget > config.budget
            assert max(after.entries_per_layer) > config.budget
        if kind == "merging":
            assert after.merged_entries > before.merged_entries > 0  # counted over both


def test_an_append_extends_the_turn_index_and_leaves_the_old_one_to_gc(folders, tmp_path,
                                                                       monkeypatch):
    """The grown conversation's manifest names a new index object: the old turns with the
    embeddings they had (only the new turns are embedded), then the new ones, as a build of
    the whole history embeds them; the old object is gc's once the new manifest is committed."""
    config = small_config(folders)
    first, whole = aligned_history(config)
    store = LocalStore(tmp_path / "store")
    built = build_conversation(first, config, store).records
    embedded: list[str] = []
    write = plan_module.write_turn_index

    class Recording:
        def __init__(self, encoder):
            self.encoder = encoder

        def encode(self, lines, **kwargs):
            embedded.extend(lines)
            return self.encoder.encode(lines, **kwargs)

    monkeypatch.setattr(plan_module, "write_turn_index",
                        lambda conv, encoder, *a, **k: write(conv, Recording(encoder), *a, **k))
    appended = build_conversation(whole, config, store, APPEND_ALWAYS).records
    assert [a.appends for a in appended] == [1] * len(built)
    [old] = {r.turn_index for r in built}
    [new] = {r.turn_index for r in appended}  # the same on every row
    assert new.key != old.key and new.key.startswith(f"turns/{whole.conversation_id}/")
    fingerprint = appended[0].encoder_fingerprint
    before, after = (read_turn_index(store, i, whole.conversation_id, fingerprint)
                     for i in (old, new))
    n = len(first.turns)
    assert len(whole.turns) > n
    tokenizer = models.load_tokenizer(config.model)
    assert before.turns == indexed_turns(first, tokenizer)
    assert after.turns == indexed_turns(whole, tokenizer)
    # the old turns keep their token spans: the append goes on from the tokens the caches hold
    assert [t.span for t in after.turns[:n]] == [t.span for t in before.turns]
    assert after.turns[n].span[0] >= built[0].tokens
    np.testing.assert_array_equal(after.embeddings[:n], before.embeddings)
    assert embedded == [t.line for t in after.turns[n:]]
    fresh = index_turns(whole, models.load_encoder(config.encoder), config.encoder, fingerprint)
    np.testing.assert_allclose(after.embeddings.astype(np.float32),
                               fresh.embeddings.astype(np.float32), atol=2e-3)
    orphans = {key for key, _, _ in find_garbage(store, min_age_seconds=0).orphans}
    assert old.key in orphans and new.key not in orphans
    assert {r.object_key for r in built} <= orphans


def test_the_growth_rule_reclusters_when_the_episodes_no_longer_fit(folders, tmp_path):
    config = small_config(folders)
    first, whole = aligned_history(config)
    built = build_conversation(first, config, LocalStore(tmp_path / "store")).records
    plan = plan_conversation(whole, config, built, APPEND_ALWAYS)
    assert isinstance(plan, AppendPlan) and plan.new_tokens > 0
    assert sum(plan.n_windows) > sum(r.n_windows for r in built)

    def why(growth=APPEND_ALWAYS, conv=whole, previous=built) -> str:
        planned = plan_conversation(conv, config, previous, growth)
        assert isinstance(planned, ClusterResult) and isinstance(planned.reclustered, Recluster)
        return planned.reclustered.reason

    assert why(GrowthConfig(append=False)) == "appending off"
    growth = len(whole.turns) / len(first.turns)
    assert why(dataclasses.replace(APPEND_ALWAYS, max_growth=growth * 0.99)) == \
        "grown past max-growth"
    assert why(dataclasses.replace(APPEND_ALWAYS, far_similarity=1.0, far_share=0.0)) == \
        "far windows"
    old = [dataclasses.replace(r, member_turn_ids=None) for r in built]
    assert why(previous=old) == "built before appends"
    tokens = [dataclasses.replace(r, tokens=r.tokens + 1) for r in built]
    assert why(previous=tokens) == "tokens changed"
    few = [dataclasses.replace(r, episodes_requested=4) for r in built]
    assert why(previous=few) == "more episodes"


def _corpus(path, conversations):
    write_jsonl(conversations, path)
    return path


def test_grown_edited_and_unchanged_records_each_take_their_path(ray_local, folders, tmp_path):
    """Through the Ray job: the grown record is appended to (new objects, the old ones left for
    gc), the edited one rebuilt, the unchanged one skipped; a re-run skips all three."""
    config = small_config(folders)
    day = [make_conversation(f"day-{i}", target_tokens=500, seed=i) for i in range(3)]
    first = [dataclasses.replace(c, turns=c.turns[:len(c.turns) * 2 // 3]) for c in day]
    store_dir = tmp_path / "store"
    options = DriverOptions(progress=False, growth=APPEND_ALWAYS)
    summary = run_build(str(_corpus(tmp_path / "day1.jsonl", first)), str(store_dir), config,
                        options)
    assert (summary.built, summary.appended, summary.skipped) == (3, 0, 0), summary.line()
    local = LocalStore(store_dir)
    before = {c.conversation_id: read_manifest(local, c.conversation_id) for c in first}
    edited_turn = dataclasses.replace(first[1].turns[0], text="something else entirely")
    second = [day[0],  # grown: the rest of its sessions
              dataclasses.replace(first[1], turns=(edited_turn, *first[1].turns[1:])),
              first[2]]
    again = run_build(str(_corpus(tmp_path / "day2.jsonl", second)), str(store_dir), config,
                      options)
    assert (again.built, again.appended, again.skipped) == (1, 1, 1), again.line()
    assert dict(again.rebuilt) == {"edited": 1}
    assert "built 1 conversations, appended to 1 (" in again.line()
    grown = read_manifest(local, "day-0")
    assert [r.appends for r in grown] == [1] * len(grown)
    assert grown[0].source_turns == len(day[0].turns) == grown[0].cache_turns
    assert grown[0].clustered_turns == len(first[0].turns)
    old_keys = {r.object_key for r in before["day-0"]}
    assert old_keys.isdisjoint(r.object_key for r in grown)
    garbage = find_garbage(local, min_age_seconds=0)
    assert old_keys <= {key for key, _, _ in garbage.orphans}
    assert read_manifest(local, "day-2") == before["day-2"]
    third = run_build(str(tmp_path / "day2.jsonl"), str(store_dir), config, options)
    assert (third.built, third.appended, third.skipped) == (0, 0, 3), third.line()


def test_a_crash_between_the_objects_and_the_manifest_keeps_the_old_version(
        folders, store, monkeypatch):
    config = small_config(folders)
    first, whole = aligned_history(config, seed=5)
    built = build_conversation(first, config, store).records
    lm = models.load_llm(config.model)

    def crash(*args, **kwargs):
        raise OSError("the node died before the manifest was written")

    monkeypatch.setattr(conversation_module, "write_manifest", crash)
    with pytest.raises(OSError, match="node died"):
        build_conversation(whole, config, store, APPEND_ALWAYS)
    monkeypatch.undo()
    keys = lambda records: [r.object_key for r in records]  # noqa: E731
    assert keys(read_manifest(store, first.conversation_id)) == keys(built)  # the old version
    for record in built:
        assert read_stored_cache(store, record, lm.model).tokens_seen == record.tokens
    # the re-run completes
    appended = build_conversation(whole, config, store, APPEND_ALWAYS).records
    assert [r.appends for r in appended] == [1] * len(built)
    assert keys(read_manifest(store, first.conversation_id)) == keys(appended)


def test_a_record_grown_past_the_cut_keeps_its_caches_and_notes_the_new_turns(folders, tmp_path):
    config = small_config(folders)
    first, whole = aligned_history(config)
    tokenizer = models.load_tokenizer(config.model)
    cut = len(prompts.context_ids(tokenizer, render_conversation(first).text))
    config = dataclasses.replace(config, max_context_tokens=cut)  # the new sessions do not fit
    store = LocalStore(tmp_path / "store")
    built = build_conversation(first, config, store).records
    again = build_conversation(whole, config, store, APPEND_ALWAYS).records
    assert [r.object_key for r in again] == [r.object_key for r in built]  # nothing written
    assert {(r.source_turns, r.cache_turns, r.appends) for r in again} == \
        {(len(whole.turns), len(first.turns), 0)}
    assert conversation_module.rebuild_reason(store, whole.conversation_id, config,
                                              conversation_module.files_of(config), whole) is None
