"""A conversation built in one pass (`PrefillConfig.one_pass`) is stored, read, repaired and
scheduled like one built block by block: its objects read back as built, a lost object is
repaired alone with the very bytes it had, and the Ray driver gives the conversation one task."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from lab.rehearsal import SYNTHETIC_CONFIG, SYNTHETIC_STAGES, write_synthetic_corpus
from pipeline.builder.append import read_stored_cache
from pipeline.builder.conversation import build_conversation, files_of, is_built
from pipeline.builder.driver import run_build
from pipeline.builder.episode import build_episode_caches, episode_scorer
from pipeline.config import BuildConfig, DriverOptions, EpisodeConfig, PrefillConfig
from pipeline.config.hashing import stored_fields
from pipeline.corpus.render import render_conversation
from pipeline.corpus.synthetic import make_conversation
from pipeline.kv import models, prompts
from pipeline.kv.one_pass import one_pass_prefill
from pipeline.store.backends.local import LocalStore
from pipeline.store.catalogue.manifest import read_manifest
from tests.support.model_folders import make_encoder_folder, make_llm_folder


@pytest.fixture(scope="module")
def config(tmp_path_factory) -> BuildConfig:
    root = tmp_path_factory.mktemp("one-pass-models")
    return BuildConfig(model=str(make_llm_folder(root / "llm")),
                       encoder=str(make_encoder_folder(root / "encoder")), budget=32,
                       store_dtype="float32", prefill=PrefillConfig(block=64, one_pass=True),
                       episodes=EpisodeConfig(episodes=2, medoids=1))


def test_one_pass_caches_read_back_as_built_and_a_lost_one_is_repaired_alone(config,
                                                                              tmp_path):
    conv = make_conversation("one-pass-0", target_tokens=600, seed=5)
    store = LocalStore(tmp_path / "store")
    product = build_conversation(conv, config, store, prefill=build_episode_caches)
    records = product.records
    assert [r.episode for r in records] == [0, 1] and len(product.built) == 2
    lm = models.load_llm(config.model)
    for record, built in zip(records, product.built):
        assert max(record.entries_per_layer) <= config.budget
        stored = read_stored_cache(store, record, lm.model)
        assert stored.tokens_seen == built.cache.tokens_seen == record.tokens
        for got, want in zip(stored.layers, built.cache.layers):
            assert torch.equal(got.valid, want.valid)
            assert torch.equal(got.rope_positions[got.valid], want.rope_positions[want.valid])
            assert torch.equal(got.keys[0][got.valid], want.keys[0][want.valid])
    # what the build stored is the pass over the conversation, one scorer per episode
    ids = prompts.context_ids(lm.tokenizer, render_conversation(product.planned.conversation).text)
    scorers = [episode_scorer(lm.tokenizer, product.planned.conversation, r.medoid_text,
                              tuple(r.member_turn_ids), config) for r in records]
    passed = one_pass_prefill(lm.model, ids, scorers, records[0].layer_budgets, config.prefill)
    for (cache, _), built in zip(passed, product.built):
        for got, want in zip(cache.layers, built.cache.layers):
            assert torch.equal(got.valid, want.valid) and torch.equal(got.keys, want.keys)

    store.delete(records[1].object_key)
    files = files_of(config)
    assert not is_built(store, conv.conversation_id, config, files, conv)
    repaired = build_conversation(conv, config, store).records
    assert [r.object_key for r in repaired] == [r.object_key for r in records]
    assert [r.sha256 for r in repaired] == [r.sha256 for r in records]  # the very bytes
    assert is_built(store, conv.conversation_id, config, files, conv)


def test_the_driver_gives_a_one_pass_conversation_one_task(ray_local, tmp_path):
    """Built in one pass, a conversation is a planning task and one episode task that returns
    every episode's record; block by block, one task per episode."""
    corpus = tmp_path / "corpus.jsonl"
    write_synthetic_corpus(corpus, 3)
    options = DriverOptions(progress=False, max_in_flight=4)
    one_pass = dataclasses.replace(
        SYNTHETIC_CONFIG, prefill=dataclasses.replace(SYNTHETIC_CONFIG.prefill, one_pass=True))
    for config, tasks_per_conversation in ((SYNTHETIC_CONFIG, 3), (one_pass, 2)):
        store = LocalStore(tmp_path / f"store-{tasks_per_conversation}")
        summary = run_build(str(corpus), store, config, options, stages=SYNTHETIC_STAGES)
        assert (summary.built, summary.episodes) == (3, 6) and not summary.failed
        assert summary.tasks == 3 * tasks_per_conversation
        assert all(len(read_manifest(store, f"bench-{i:07d}")) == 2 for i in range(3))


def test_one_pass_is_its_own_build(config):
    """One pass is hashed into the configuration (a store built block by block is rebuilt),
    and a block configuration keeps the hash it had before the option existed."""
    block = dataclasses.replace(config, prefill=dataclasses.replace(config.prefill,
                                                                    one_pass=False))
    assert block.hash != config.hash
    assert "one_pass" not in stored_fields(block)["prefill"]
    assert stored_fields(config)["prefill"]["one_pass"] is True
