"""A cell's top-up read once (`topup.read_once`, tiny offline models): each question whose
routed cache holds entries of its top-up's turns is measured alone over a view without them,
its entries counted as read; the others share the cache's packed pass, as the default read."""

from __future__ import annotations

import pytest

from pipeline.config import BuildConfig, EpisodeConfig, PrefillConfig
from pipeline.corpus.synthetic import make_corpus
from pipeline.eval import cell as cell_module
from pipeline.eval.cell import evaluate_cell, prepare
from pipeline.eval.methods import EvalConfig
from pipeline.eval.reads import select_read
from pipeline.kv import models
from pipeline.kv.layout import token_layout
from tests.support.model_folders import make_model_folders

ONCE = "epicache+topup.read_once=true"


@pytest.fixture(scope="module")
def config(tmp_path_factory) -> EvalConfig:
    llm, encoder = map(str, make_model_folders(tmp_path_factory.mktemp("read-once-cell")))
    return EvalConfig(BuildConfig(model=llm, encoder=encoder, prefill=PrefillConfig(block=64),
                                  episodes=EpisodeConfig(episodes=2, medoids=1)),
                      questions_per_conversation=8)


def test_a_top_up_read_once_is_measured_over_the_routed_cache_less_its_turns(config, monkeypatch):
    prep = prepare(make_corpus(1, 400, seed=5)[0], config)
    calls, measure_all = [], cell_module.measure_all

    def spy(lm, conv, questions, cache, config, topups, generate=None):
        calls.append((cache, topups))
        return measure_all(lm, conv, questions, cache, config, topups, generate)

    monkeypatch.setattr(cell_module, "measure_all", spy)
    records = evaluate_cell(prep, "epicache", 160, config, None, reads=(config.read_of(ONCE),))
    pairs = [(select_read(r, "epicache", config), select_read(r, ONCE, config)) for r in records]
    hid = 0
    for default, once in pairs:
        assert (once["read"], once["topup_turn_ids"]) == (default["read"],
                                                          default["topup_turn_ids"])
        assert once["decode_entries"] == once["kept_entries"] + once["topup_tokens"]
        if once["kept_entries"] == default["kept_entries"]:  # its cache held none of them
            assert once["answer_nll"] == pytest.approx(default["answer_nll"], abs=1e-4)
        else:
            hid += 1
            assert once["kept_entries"] < default["kept_entries"]
    assert hid > 0
    layout = token_layout(models.load_tokenizer(config.build.model), prep.conversation)
    alone = [(cache, topup) for cache, topups in calls for topup in topups
             if len(topups) == 1 and topup.hidden_spans]
    assert len(alone) == hid
    for cache, topup in alone:  # each view holds no entry of its top-up's turns
        hidden = layout.turn_mask(topup.turn_ids)
        assert topup.hidden_spans == tuple(layout.span_of(t) for t in topup.turn_ids)
        assert not any((layer.valid & hidden[layer.positions]).any() for layer in cache.layers)
