"""A top-up read once (`TopUpConfig.read_once`) end to end with tiny random model folders: the
build stores each turn's token span in the turn index, the library's `Answerer` and the Serve
decoder read the routed cache without the entries of the top-up's turns (the stored cache
unchanged), and a question's answer is the one decoded over that view by hand."""

from __future__ import annotations

import asyncio
import dataclasses
import gc

import pytest
import torch

from pipeline.answer.answerer import Answerer
from pipeline.answer.decode import question_prompt, teacher_forced_nll
from pipeline.answer.topup import read_view
from pipeline.builder.conversation import build_conversation
from pipeline.config import BuildConfig, EpisodeConfig, PrefillConfig, TopUpConfig
from pipeline.corpus.synthetic import make_corpus
from pipeline.kv import models
from pipeline.kv.layout import token_layout, token_mask
from pipeline.store.backends.local import LocalStore
from pipeline.store.catalogue.manifest import read_manifest
from pipeline.store.objects.turn_index import read_turn_index
from tests.support.model_folders import make_model_folders

ONCE = TopUpConfig(read_once=True)
QUESTION = "What did they say about the weekend trip?"


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """A conversation built into a local store by the product's build: (store, conversation)."""
    root = tmp_path_factory.mktemp("read-once")
    llm, encoder = map(str, make_model_folders(root))
    config = BuildConfig(model=llm, encoder=encoder, budget=160, prefill=PrefillConfig(block=64),
                         episodes=EpisodeConfig(episodes=2, medoids=1))
    store = LocalStore(root / "store")
    product = build_conversation(make_corpus(1, 400, seed=5)[0], config, store)
    return store, product.planned.conversation


def test_the_turn_index_holds_each_turns_span_in_the_caches_ids(built):
    store, conv = built
    record = read_manifest(store, conv.conversation_id)[0]
    index = read_turn_index(store, record.turn_index, conv.conversation_id,
                            record.encoder_fingerprint)
    layout = token_layout(models.load_tokenizer(record.model_id), conv)
    assert [t.turn_id for t in index.turns] == list(layout.turn_ids)
    assert [t.span for t in index.turns] == list(layout.turn_spans)
    assert layout.turn_spans[-1][1] <= record.tokens


def test_the_answer_path_reads_the_cache_without_the_top_ups_turns(built):
    """The `Answerer` with `read_once` scores and answers over the routed cache less the entries
    of its top-up's turns, exactly as decoded over that view by hand; the resident cache is left
    whole (the default read over it is unchanged)."""
    store, conv = built
    once, plain = Answerer(store, topup=ONCE), Answerer(store)
    plan = once.planner.plan(conv.conversation_id, QUESTION)
    layout = token_layout(models.load_tokenizer(plan.records[0].model_id), conv)
    assert plan.topup.status == "used" and plan.topup.hidden_spans == tuple(
        layout.span_of(t) for t in plan.topup.turn_ids)
    cache, _ = once.load_caches(plan.read)
    view = read_view(cache, plan.topup.hidden_spans)
    hidden = token_mask(plan.topup.hidden_spans, cache.tokens_seen)
    assert sum(view.entries_per_layer()) < sum(cache.entries_per_layer())
    assert not any((layer.valid & hidden[layer.positions]).any() for layer in view.layers)
    lm = models.load_llm(plan.records[0].model_id)
    answer = "They went hiking."
    by_hand = teacher_forced_nll(lm, view, question_prompt(lm, view, QUESTION, 8, once.limits,
                                                           plan.topup.text), answer)
    assert once.answer_nll(conv.conversation_id, QUESTION, answer) == pytest.approx(by_hand)
    whole = plain.answer_nll(conv.conversation_id, QUESTION, answer)
    assert whole != pytest.approx(by_hand)
    assert once.answer_nll(conv.conversation_id, QUESTION, answer) == pytest.approx(by_hand)
    assert plain.answer_nll(conv.conversation_id, QUESTION, answer) == pytest.approx(whole)
    assert once.answer(conv.conversation_id, QUESTION, 6).topup["hidden_spans"] == [
        list(s) for s in plan.topup.hidden_spans]


def test_the_serve_decoder_hides_the_spans_the_router_sends(built):
    """The Serve decoder given the router's spans decodes over the view `read_view` makes (its
    batcher is handed no entry of the hidden tokens), and answers as the library does with
    `read_once`; without spans, over the whole cache, as the library's default read."""
    from pipeline.serve.decoder import Decoder
    from pipeline.serve.settings import ServeSettings

    store, conv = built
    plan = Answerer(store, topup=ONCE).planner.plan(conv.conversation_id, QUESTION)
    gc.freeze, real = (lambda: None), gc.freeze  # a replica's process, not pytest's
    try:
        decoder = Decoder.func_or_class(ServeSettings(store=str(store.root), cache_bytes=10**8),
                                        plan.records[0].model_id)
    finally:
        gc.freeze = real
    handed, submit = [], decoder.batcher.submit
    decoder.batcher.submit = lambda cache, *args: handed.append(cache) or submit(cache, *args)
    refs = tuple(r.ref for r in plan.read)
    served = [asyncio.run(decoder.answer(refs, QUESTION, 8, 0.0, plan.topup.text, "", hidden))
              ["answer"] for hidden in (plan.topup.hidden_spans, ())]
    library = [Answerer(store, topup=t).answer(conv.conversation_id, QUESTION, 8).answer
               for t in (ONCE, dataclasses.replace(ONCE, read_once=False))]
    assert served == library
    whole = handed[1]
    view = read_view(whole, plan.topup.hidden_spans)
    assert sum(handed[0].entries_per_layer()) == sum(view.entries_per_layer()) < \
        sum(whole.entries_per_layer())
    assert all(torch.equal(a.valid, b.valid) for a, b in zip(handed[0].layers, view.layers))
