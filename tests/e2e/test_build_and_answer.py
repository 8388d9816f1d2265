"""End to end with the real SmolLM2-135M-Instruct and all-MiniLM-L6-v2, on a real local Ray."""

from __future__ import annotations

import shutil
from collections import Counter

import numpy as np
import pytest
import torch
from transformers import DynamicCache

from jobs import demo, gc
from lab import compare
from pipeline.answer.answerer import Answerer
from pipeline.answer.decode import generate_from_cache
from pipeline.builder.driver import run_build
from pipeline.config import BuildConfig, DriverOptions
from pipeline.corpus.reader import read_corpus, write_jsonl
from pipeline.corpus.render import render_conversation
from pipeline.corpus.synthetic import make_corpus
from pipeline.episodes import EpisodeConfig
from pipeline.kv import models, prompts
from pipeline.kv.budgets import CalibrationConfig
from pipeline.kv.methods.epicache import EpiCache
from pipeline.kv.prefill import PrefillConfig, block_prefill
from pipeline.store.backends.uri import open_store
from pipeline.store.catalogue.manifest import read_manifest
from pipeline.store.objects import cache_format, cache_read

pytestmark = pytest.mark.e2e

BUDGET, BLOCK = 128, 128
CONFIG = BuildConfig(
    budget=BUDGET, episodes=EpisodeConfig(medoids=2), prefill=PrefillConfig(block=BLOCK),
    calibration=CalibrationConfig(tokens=1024, window=256, sink=64))


@pytest.fixture(scope="module")
def built(tmp_path_factory, ray_local):
    """Two synthetic conversations (4 topics, ~1,200 tokens: > 4x the budget) built on Ray."""
    root = tmp_path_factory.mktemp("e2e")
    corpus = root / "corpus.jsonl"
    write_jsonl(make_corpus(2, 1200, seed=7), corpus)
    store_uri = str(root / "store")
    summary = run_build(str(corpus), store_uri, CONFIG, DriverOptions(progress=False))
    return corpus, store_uri, summary


def test_build_writes_manifests_and_objects_that_reload(built):
    corpus, store_uri, summary = built
    assert summary.built == 2 and not summary.failed
    # At most one model load per worker over the build (the session's Ray reuses workers, so
    # one that loaded the model for an earlier test loads nothing here); every process that
    # built an episode has its count recorded (an empty record fails here).
    assert summary.loads and all(n <= 1 for n in summary.loads.values()), summary.loads
    builders = set()
    store = open_store(store_uri)
    lm = models.load_llm()
    n_layers = lm.config.num_hidden_layers
    for conv in read_corpus(corpus)[0]:
        rows = read_manifest(store, conv.conversation_id)
        assert [r.episode for r in rows] == list(range(len(rows))) and 1 <= len(rows) <= 4
        for row in rows:
            builders.add((row.node_id, int(row.worker.rsplit(":", 1)[1])))
            assert row.config_hash == CONFIG.hash
            budgets = row.layer_budgets
            assert len(budgets) == n_layers and sum(budgets) == BUDGET * n_layers
            assert min(budgets) >= BUDGET // 4
            # every layer holds exactly its budget and never held more than budget + block
            assert row.entries_per_layer == pytest.approx(budgets)
            assert all(p <= b + BLOCK for p, b in zip(row.peak_entries_per_layer, budgets))
            cache, header = cache_format.deserialize(store.get(row.object_key), row.sha256,
                                                 row.object_key)
            assert header["conversation_id"] == conv.conversation_id
            assert cache.tokens_seen == row.tokens
            assert cache.entries_per_layer() == pytest.approx(budgets)
    assert builders and all(b in summary.loads for b in builders), (builders, summary.loads)


def _episode_topic(conv, row) -> str:
    topic_of = {t.turn_id: t.meta["topic"] for t in conv.turns}
    return Counter(topic_of[t] for t in row.medoid_turn_ids).most_common(1)[0][0]


def test_questions_route_to_the_episode_of_their_topic(built):
    corpus, store_uri, _ = built
    answerer = Answerer(open_store(store_uri))
    encoder = models.load_encoder()
    hits = total = 0
    for conv in read_corpus(corpus)[0]:
        rows = answerer.manifest(conv.conversation_id)
        centroids = np.stack([np.asarray(r.centroid) for r in rows])
        for q in conv.questions:
            emb = encoder.encode([q.question], normalize_embeddings=True)[0]
            episode = int(np.argmax(centroids @ emb))
            hits += _episode_topic(conv, rows[episode]) == q.meta["topic"]
            total += 1
    assert total >= 6
    assert hits > total / 2, f"only {hits} of {total} questions routed to their topic's episode"


def test_answers_route_fetch_once_and_decode(built):
    corpus, store_uri, _ = built
    conv = read_corpus(corpus)[0][0]
    answerer = Answerer(open_store(store_uri))
    q = conv.questions[0].question
    first = answerer.answer(conv.conversation_id, q, max_new_tokens=8)
    again = answerer.answer(conv.conversation_id, q + " ", max_new_tokens=8)
    assert first.answer and set(first.timings_ms) == {"embed", "route", "load", "topup", "decode"}
    assert not first.cache_hit and again.cache_hit and again.episode == first.episode


def test_demo_compares_the_episodic_cache_with_the_full_history(built, capsys):
    """jobs.demo's comparison on a built store: the full cache reads the same tokens as the
    build (no eviction), the episodic cache is smaller, and the summary and next commands print."""
    corpus, store_uri, _ = built
    conv = read_corpus(corpus)[0][0]
    answerer = Answerer(open_store(store_uri))
    rows = answerer.manifest(conv.conversation_id)
    config = BuildConfig.from_json(rows[0].config_json)
    full, none = compare.reference_caches(models.load_llm(), conv, config)
    assert full.tokens_seen == rows[0].tokens > none.tokens_seen
    assert full.entries_per_layer() == pytest.approx([rows[0].tokens] * len(full.layers))
    records = compare.compare(answerer, conv, 2, max_new_tokens=4)
    assert len(records) == 2
    for r in records:
        assert 0 <= r["episode"] < len(rows) and r["bytes"]["episodic"] < r["bytes"]["full"]
        assert all(np.isfinite(v) for v in r["nll"].values())
        assert all(1 <= r[c]["tokens"] <= 4 and r[c]["seconds"] > 0 for c in compare.CACHES)
    demo.print_summary(compare.figures(records), models.DEFAULT_LLM, "cpu")
    out = capsys.readouterr().out
    assert "summary: retention" in out and "ms/token" in out and "small sample" in out


def test_a_deleted_episode_and_turn_index_are_repaired_alone(built, ray_local, tmp_path, capsys):
    """The next plain build repairs exactly what was deleted from a copy of the store: one
    episode's cache block-prefilled again from its manifest record, the turn index embedded
    again; the other episodes keep their objects, and the repaired store verifies and answers."""
    corpus, store_uri, _ = built
    shutil.copytree(store_uri, tmp_path / "store")
    store = open_store(str(tmp_path / "store"))
    cid = read_corpus(corpus)[0][0].conversation_id
    rows = read_manifest(store, cid)
    store.delete(rows[1].object_key)
    store.delete(rows[0].turn_index.key)
    summary = run_build(str(corpus), store.uri, CONFIG, DriverOptions(progress=False))
    assert (summary.built, summary.skipped, summary.episodes) == (0, 1, 1)
    assert (summary.repaired_conversations, summary.repaired_episodes,
            summary.repaired_indexes) == (1, 1, 1)
    after = read_manifest(store, cid)
    assert [r.object_key for r in after if r.episode != 1] == \
        [r.object_key for r in rows if r.episode != 1]
    assert after[1].tokens == rows[1].tokens and after[1].medoid_text == rows[1].medoid_text
    assert after[1].member_turn_ids == rows[1].member_turn_ids
    assert after[1].entries_per_layer == rows[1].entries_per_layer  # the same budgets kept
    assert after[0].turn_index == rows[0].turn_index  # the same turns, embedded alike
    assert gc.main(["--store", store.uri, "--verify"]) == 0
    assert "no faults" in capsys.readouterr().out
    assert cache_read.read_cache(store, after[1].ref).cache.tokens_seen == rows[1].tokens
    answered = Answerer(store).answer(cid, "What did they talk about?", max_new_tokens=4)
    assert answered.episode in {r.episode for r in after}


def test_identical_rerun_does_no_work_and_changed_config_rebuilds(built, ray_local):
    corpus, store_uri, _ = built
    store = open_store(store_uri)
    before = {k: store.get(k) for k in store.list("manifests/")}
    again = run_build(str(corpus), store_uri, CONFIG, DriverOptions(progress=False))
    assert (again.built, again.skipped, again.episodes) == (0, 2, 0)
    assert {k: store.get(k) for k in store.list("manifests/")} == before
    # A changed configuration (here: StreamingLLM, one cache per conversation) rebuilds.
    changed = BuildConfig(**{**CONFIG.__dict__, "scorer": "streamingllm"})
    rebuilt = run_build(str(corpus), store_uri, changed, DriverOptions(progress=False))
    assert (rebuilt.built, rebuilt.skipped, rebuilt.episodes) == (2, 0, 2)
    for cid in [k.removeprefix("manifests/").removesuffix(".parquet") for k in before]:
        assert [r.config_hash for r in read_manifest(store, cid)] == [changed.hash]


@pytest.mark.parametrize("selection", ["headwise"])
def test_budget_covering_everything_equals_the_full_cache(selection):
    """Block prefill with a patch and a budget above the length = full prefill, and greedy
    generation from it is token-for-token the full cache's."""
    lm = models.load_llm()
    conv = make_corpus(1, 500, seed=3)[0]
    ids = prompts.context_ids(lm.tokenizer, render_conversation(conv).text)
    patch = prompts.patch_ids(lm.tokenizer, "Bob said, \"I love hiking in the mountains.\"")
    n_layers = lm.config.num_hidden_layers
    cache, stats = block_prefill(lm.model, ids, EpiCache(patch=patch), [4096] * n_layers,
                                 PrefillConfig(block=128, selection=selection))
    full = DynamicCache()
    with torch.inference_mode():
        lm.model.base_model(input_ids=ids[None], past_key_values=full, use_cache=True)
    for ours, ref in zip(cache.layers, full.layers):
        assert ours.valid.all() and ours.keys.shape == ref.keys.shape
        torch.testing.assert_close(ours.keys, ref.keys, atol=2e-4, rtol=1e-4)
        torch.testing.assert_close(ours.values, ref.values, atol=2e-4, rtol=1e-4)
    question = prompts.question_ids(lm.tokenizer, conv.questions[0].question)
    from_episodic = generate_from_cache(lm, cache, question, max_new_tokens=16)
    with torch.inference_mode():
        out = lm.model.generate(torch.cat([ids, question])[None], past_key_values=full,
                                max_new_tokens=16, do_sample=False, temperature=None, top_p=None,
                                top_k=None, pad_token_id=lm.tokenizer.eos_token_id)
    assert from_episodic.tolist() == out[0, ids.shape[0] + question.shape[0]:].tolist()
