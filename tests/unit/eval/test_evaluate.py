"""The baselines' scorers, the quality metrics, and the evaluation harness end to end."""

from __future__ import annotations

import json
import math

import pyarrow.parquet as pq
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from jobs import evaluate as evaluate_job
from pipeline.config import BuildConfig
from pipeline.corpus.reader import write_jsonl
from pipeline.corpus.synthetic import make_corpus
from pipeline.eval.methods import DEFAULT_METHODS, EvalConfig, parse_method
from pipeline.eval.metrics import (
    continuation_nll,
    evidence_probe,
    f1_score,
    normalize_answer,
    question_text,
    retention,
)
from pipeline.eval.runner import Cell, collect_cells
from pipeline.kv import models, prompts
from pipeline.kv.methods.base import BlockContext, LayerState
from pipeline.kv.methods.full import Full
from pipeline.kv.methods.infinipot import InfiniPot
from pipeline.kv.methods.keydiff import KeyDiff
from pipeline.kv.methods.kvzip import KVzip
from pipeline.kv.methods.snapkv import SnapKV
from pipeline.kv.prefill import PrefillConfig, block_prefill
from tests.support.methods import bound_method


def _encode(text: str) -> torch.Tensor:
    return torch.tensor([ord(c) % 100 for c in text])


def test_patch_choices_of_the_baselines():
    block = BlockContext(block_ids=torch.arange(200), tokens_seen=512)
    assert SnapKV().patch_ids(block).tolist() == list(range(136, 200))
    kvzip = bound_method("kvzip", _encode)
    assert kvzip.patch_ids(block).tolist() == _encode(KVzip.INSTRUCTION).tolist() + list(range(200))
    infinipot = bound_method("infinipot", _encode)
    assert infinipot.patch_ids(block).tolist() == _encode(InfiniPot.INSTRUCTION).tolist()
    assert bound_method("question", _encode, "Where?").patch_ids(block).tolist() == \
        _encode("Where?").tolist()
    assert bound_method("keydiff", _encode).patch_ids(block) is None
    with pytest.raises(ValueError, match="unknown method"):
        bound_method("h2o", _encode)
    with pytest.raises(ValueError, match="needs a patch text"):
        bound_method("epicache", _encode)


def test_keydiff_anchors_on_the_mean_of_every_key_being_compressed():
    """KeyDiff as its paper and kvpress define it, by hand on 2-d keys: the anchor is the
    mean of all valid keys (kept and new), the score minus the cosine to it."""
    keys = torch.tensor([[[1.0, 0.0], [0.0, 1.0], [1.0, 1.0], [5.0, 5.0]]])
    valid = torch.tensor([[True, True, True, False]])  # the padded slot is not in the anchor
    state = LayerState(0, keys, keys, valid, torch.arange(4)[None], None, block_start=2)
    scores = KeyDiff().score(state)
    # anchor = mean of (1,0), (0,1), (1,1) = (2/3, 2/3): direction (1,1)/sqrt(2)
    expected = torch.tensor([[-1 / 2 ** 0.5, -1 / 2 ** 0.5, -1.0, -1.0]])
    torch.testing.assert_close(scores, expected)
    assert KeyDiff.name == "keydiff" and "keydiff" in DEFAULT_METHODS


def test_random_scores_are_reproducible_per_layer_and_block_and_not_a_default_method():
    positions = torch.arange(10).expand(2, -1)
    valid = torch.ones(2, 10, dtype=torch.bool)
    keys = torch.zeros(2, 10, 8)

    def scores(layer_idx: int, block_start: int, seed: int = 0) -> torch.Tensor:
        state = LayerState(layer_idx, keys, keys, valid, positions, None, block_start=block_start)
        return bound_method("random", _encode, seed=seed).score(state)

    first = scores(1, 512)
    assert first.shape == (2, 10) and ((first >= 0) & (first < 1)).all()
    assert torch.equal(first, scores(1, 512))
    for other in (scores(2, 512), scores(1, 1024), scores(1, 512, seed=1)):
        assert not torch.equal(first, other)
    assert parse_method("random").preset.scorer == "random"
    assert "random" not in DEFAULT_METHODS  # a diagnostic floor, run only when asked for


def test_f1_and_normalisation_follow_locomo():
    assert normalize_answer("The Cat, and a Dog!") == "cat dog"
    assert f1_score("a cat", "The cat") == 1.0
    assert f1_score("blue sky", "sky") == pytest.approx(2 / 3)
    assert f1_score("", "x") == 0.0
    assert retention(4.0, 2.0, 1.0) == pytest.approx(2 / 3)
    assert math.isnan(retention(1.0, 1.0, 1.0))


def test_evidence_probe_takes_at_most_four_words_and_a_third():
    from pipeline.corpus.schema import Turn
    prefix, rest = evidence_probe(Turn("D1:1", "Ann", "one two three four five six seven eight "
                                       "nine ten eleven twelve thirteen", 1, ""))
    assert prefix == '\nAnn said, "one two three four' and rest.startswith(" five")
    prefix, _ = evidence_probe(Turn("D1:2", "Bo", "alpha beta gamma delta eps zeta", 1, ""))
    assert prefix == '\nBo said, "alpha beta'


@pytest.fixture(scope="module")
def tiny_llm_dir(tmp_path_factory):
    """A tiny random Llama with the real SmolLM2 tokenizer, saved as a model folder."""
    tokenizer = models.load_tokenizer()
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=4096,
        tie_word_embeddings=True))
    path = tmp_path_factory.mktemp("tiny-llm")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


@pytest.mark.e2e
def test_continuation_nll_equals_a_full_forward(tiny_llm_dir):
    lm = models.load_llm(tiny_llm_dir)
    ids = prompts.encode(lm.tokenizer, "Alice said hello to Bob and Bob said hello back to Alice.")
    cache, _ = block_prefill(lm.model, ids[:8], Full(), None, PrefillConfig(block=4))
    nll = continuation_nll(lm.model, cache, ids[8:10], ids[10:])
    with torch.inference_mode():
        logits = lm.model(input_ids=ids[None]).logits[0].float()
    expected = -torch.log_softmax(logits[9:-1], -1).gather(1, ids[10:, None]).mean()
    assert nll == pytest.approx(float(expected), rel=1e-4)
    assert cache.tokens_seen == 8  # the probe left the cache as it was


@pytest.mark.e2e
def test_a_top_up_is_read_as_the_answer_path_reads_it(tiny_llm_dir):
    """The evaluation reads a question's top-up after the cache, then each probe (packed with
    the other questions'): the same NLLs as one forward over the top-up's ids followed by each
    probe's, as the answer path's prompt (`prompts.question_ids(..., topup)`) holds them; a
    question without one in the same pack reads the cache alone; the cache is left as it was."""
    from pipeline.answer.topup import TopUp
    from pipeline.eval.cell import measure_all, probe_pairs

    lm = models.load_llm(tiny_llm_dir)
    conv = make_corpus(1, 300, seed=5)[0]
    q = next(q for q in conv.questions if q.evidence)
    config = EvalConfig(BuildConfig(model=tiny_llm_dir))
    ids = prompts.encode(lm.tokenizer, "Alice said hello to Bob and Bob said hello back.")
    cache, _ = block_prefill(lm.model, ids, Full(), None, PrefillConfig(block=4))
    text = '\n\nDATE: today\nCONVERSATION:\nBob said, "I adopted a cat named Miso."'
    topup = TopUp(text, ("D9:9",), len(prompts.topup_ids(lm.tokenizer, text)), "used")
    got, plain = measure_all(lm, conv, [q, q], cache, config, [topup, TopUp()])
    pairs, turns = probe_pairs(lm, conv, q, config)
    n_recall = len(turns)
    head = prompts.topup_ids(lm.tokenizer, text)
    want = [continuation_nll(lm.model, cache, torch.cat([head, p]), t) for p, t in pairs]
    alone = [continuation_nll(lm.model, cache, p, t) for p, t in pairs]
    assert got["evidence_nlls"] == pytest.approx(want[:n_recall], rel=1e-4)
    assert got["evidence_nll"] == pytest.approx(sum(want[:n_recall]) / n_recall, rel=1e-4)
    assert got["answer_nll"] == pytest.approx(want[n_recall], rel=1e-4)
    assert plain["evidence_nlls"] == pytest.approx(alone[:n_recall], rel=1e-4)
    assert got["evidence_probed"] == list(turns) == [t for t in q.evidence if t in turns]
    assert got["topup_turn_ids"] == ["D9:9"] and plain["topup_turn_ids"] == []
    assert torch.equal(prompts.question_ids(lm.tokenizer, question_text(q), text)[:len(head)], head)
    assert got["topup_tokens"] == len(head) and cache.tokens_seen == len(ids)


def _run_evaluate(corpus, out, model, methods, budgets):
    return evaluate_job.main([
        "--corpus", str(corpus), "--out", str(out), "--model", model, "--methods", methods,
        "--budgets", budgets, "--block", "64", "--medoids", "1",
        "--questions-per-conversation", "2", "--max-new-tokens", "4",
        "--calibration-tokens", "256", "--calibration-window", "64"])


def _check_outputs(out, methods):
    for name in ("results.parquet", "summary.json", "table.md", "retention.png"):
        assert (out / name).stat().st_size > 0, name
    records = pq.read_table(out / "results.parquet").to_pylist()
    assert {r["method"] for r in records} == set(methods) | {"none"}
    ref = {(r["conversation_id"], r["question_index"], r["method"]): r["evidence_nll"]
           for r in records if r["method"] in ("full", "none")}
    for r in records:
        key = (r["conversation_id"], r["question_index"])
        if ref[key + ("full",)] >= ref[key + ("none",)]:  # no signal: retention is undefined
            assert math.isnan(r["retention"])
        elif r["method"] in ("full", "none"):
            assert r["retention"] == pytest.approx(1.0 if r["method"] == "full" else 0.0)
    summary = json.loads((out / "summary.json").read_text())
    assert {row["method"] for row in summary["rows"]} == set(methods) | {"none"}
    return records


@pytest.mark.e2e
def test_harness_end_to_end_on_a_tiny_model(tmp_path, tiny_llm_dir, ray_local):
    corpus = tmp_path / "corpus.jsonl"
    write_jsonl(make_corpus(2, 500, seed=11), corpus)
    methods = ["full", "streamingllm", "snapkv", "infinipot", "kvzip", "keydiff", "epicache",
               "question"]
    assert _run_evaluate(corpus, tmp_path / "out", tiny_llm_dir, ",".join(methods), "32,64") == 0
    records = _check_outputs(tmp_path / "out", methods)
    assert {r["budget"] for r in records if r["method"] == "keydiff"} == {32, 64}
    assert all(r["kept_entries"] == r["budget"] for r in records if r["budget"])


@pytest.mark.e2e
def test_a_cell_measures_the_caches_the_product_build_makes(tiny_llm_dir, monkeypatch):
    """The evaluation builds through `pipeline.builder` (one build per episode, each stored in
    an in-memory store dropped with the cell), and the cache it measures is the one the build
    stored: written to the store, read back, it has the same entries."""
    from pipeline.builder import episode as build_stage
    from pipeline.eval import cell as cell_module
    from pipeline.eval.cell import evaluate_cell, prepare
    from pipeline.store.objects import cache_format

    built, stores = [], []

    def spy(clustered, episodes, budgets, config, store, patch_text=None):
        done = build_stage.build_episode_caches(clustered, episodes, budgets, config, store,
                                                patch_text)
        built.extend((config, d, store.get(d.record.object_key)) for d in done)
        stores.append(store)
        return done

    monkeypatch.setattr(cell_module, "build_episode_caches", spy)
    config = EvalConfig(BuildConfig(model=tiny_llm_dir, prefill=PrefillConfig(block=64)),
                        questions_per_conversation=2)
    prep = prepare(make_corpus(1, 500, seed=11)[0], config)
    records = evaluate_cell(prep, "epicache", 32, config, None)
    assert len(records) == len(prep.questions) and built
    assert {done.record.episode for _, done, _ in built} == set(range(len(built)))
    for build, done, data in built:
        assert build == config.build_config("epicache", 32) and done.record.scorer == "epicache"
        stored, _ = cache_format.deserialize(data, done.record.sha256, done.record.object_key)
        assert stored.tokens_seen == done.cache.tokens_seen
        for kept, read in zip(done.cache.layers, stored.layers):
            for head in range(kept.valid.shape[0]):
                assert sorted(kept.positions[head][kept.valid[head]].tolist()) == \
                    sorted(read.positions[head][read.valid[head]].tolist())
    with pytest.raises(Exception, match="not in this process"):
        stores[0].list()  # dropped with the cell: nothing kept


@pytest.mark.e2e
def test_a_cell_measures_each_read_on_the_same_caches(tiny_llm_dir):
    """An episodic cell measures each of its methods' reads (route, top-up) on the read its
    route picks; a top-up is read before the probes, so a read with one differs from the plain
    read only where a question was topped up, and its decode-time entries count its tokens; the
    top-up that skips the held turns reads none of its episodes'."""
    from pipeline.eval.cell import evaluate_cell, prepare
    from pipeline.eval.reads import select_read

    config = EvalConfig(BuildConfig(model=tiny_llm_dir, prefill=PrefillConfig(block=64)),
                        questions_per_conversation=4)
    prep = prepare(make_corpus(1, 600, seed=11)[0], config)
    topup = config.topup_of("epicache")
    skipping = "epicache+topup.skip_held=true"
    records = evaluate_cell(prep, "epicache", 32, config, None,
                            (config.read_of("epicache-episode"), config.read_of(skipping)))
    topped = [select_read(r, "epicache", config) for r in records]
    plain = [select_read(r, "epicache-episode", config) for r in records]
    skipped = [select_read(r, skipping, config) for r in records]
    for t, p, k in zip(topped, plain, skipped):
        assert t["read"] == p["read"] == k["read"] and t["episodes_read"] == len(t["read"])
        assert 0 <= t["topup_tokens"] <= topup.max_tokens and p["topup_tokens"] == 0
        assert t["decode_entries"] == pytest.approx(t["kept_entries"] + t["topup_tokens"])
        held = {turn for e in k["read"] for turn in _members(prep, config, e)}
        assert not set(k["topup_turn_ids"]) & held
        if t["topup_tokens"] == 0:  # no top-up: the very same probes
            assert t["evidence_nlls"] == pytest.approx(p["evidence_nlls"])
    assert all(t["topup_tokens"] > 0 for t in topped)


def _members(prep, config, episode: int) -> tuple[str, ...]:
    from pipeline.builder.cluster import cluster_conversation

    return cluster_conversation(prep.conversation,
                                config.build_config("epicache", 32)).members[episode]


@pytest.mark.e2e
def test_the_fair_rows_read_their_top_ups_with_nothing_excluded(tiny_llm_dir):
    """`rag` (no history) and a topped-up baseline read the question's nearest turns whatever
    their cache holds: the same top-up for both, and for the full history; the plain rows of
    the same cells read none."""
    from pipeline.eval.cell import evaluate_cell, prepare
    from pipeline.eval.reads import select_read

    config = EvalConfig(BuildConfig(model=tiny_llm_dir, prefill=PrefillConfig(block=64)),
                        questions_per_conversation=4)
    prep = prepare(make_corpus(1, 600, seed=11)[0], config)
    rag = evaluate_cell(prep, "none", None, config, None, (config.read_of("rag"),))
    snap = evaluate_cell(prep, "snapkv+topup.enabled=true", 32, config, None,
                         (config.read_of("snapkv"),))
    for r, s in zip(rag, snap):
        none, topped = r, select_read(r, "rag", config)
        assert none["topup_tokens"] == 0 and none["decode_entries"] == none["kept_entries"]
        assert topped["topup_turn_ids"] == s["topup_turn_ids"] and s["topup_tokens"] > 0
        assert s["kept_entries"] == 32 and s["decode_entries"] == 32 + s["topup_tokens"]
        assert select_read(s, "snapkv", config)["topup_tokens"] == 0
    with pytest.raises(ValueError, match="cannot take scoring.focus"):
        parse_method("snapkv+scoring.focus=0.5")


@pytest.mark.e2e
def test_a_rerun_computes_only_the_cells_it_does_not_have(tmp_path, tiny_llm_dir, ray_local):
    corpus = tmp_path / "corpus.jsonl"
    write_jsonl(make_corpus(1, 400, seed=13), corpus)
    out = tmp_path / "out"
    assert _run_evaluate(corpus, out, tiny_llm_dir, "streamingllm,keydiff", "32") == 0
    first = pq.read_table(out / "results.parquet").to_pylist()
    kept = sorted(out.glob("cells/*/*/*.parquet"))
    method_of = lambda p: pq.read_table(p).column("method")[0].as_py()  # noqa: E731
    assert sorted(method_of(p) for p in kept) == ["full", "keydiff", "none", "streamingllm"]
    mtimes = {p: p.stat().st_mtime_ns for p in kept}
    [keydiff] = [p for p in kept if method_of(p) == "keydiff"]
    keydiff.unlink()  # as if the run had stopped before this cell finished
    assert _run_evaluate(corpus, out, tiny_llm_dir, "streamingllm,keydiff,epicache", "32") == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["cells_reused"] == 3
    assert all(p.stat().st_mtime_ns == t for p, t in mtimes.items() if p != keydiff)
    assert keydiff.exists()
    assert "epicache" in {method_of(p) for p in keydiff.parent.glob("*.parquet")}
    second = pq.read_table(out / "results.parquet").to_pylist()
    key = lambda r: (r["method"], r["question_index"])  # noqa: E731
    again = {key(r): r for r in second}
    for r in first:  # the recomputed cell is deterministic, the reused ones are read back
        assert again[key(r)]["evidence_nll"] == pytest.approx(r["evidence_nll"])
        assert again[key(r)]["retention"] == pytest.approx(r["retention"], nan_ok=True)
    # another configuration never reuses them
    assert evaluate_job.main(["--corpus", str(corpus), "--out", str(out), "--model", tiny_llm_dir,
                              "--methods", "keydiff", "--budgets", "32", "--block", "32",
                              "--questions-per-conversation", "2", "--max-new-tokens", "4"]) == 0
    assert json.loads((out / "summary.json").read_text())["cells_reused"] == 0


@pytest.mark.e2e
def test_harness_end_to_end_with_smollm2(tmp_path, ray_local):
    corpus = tmp_path / "corpus.jsonl"
    write_jsonl(make_corpus(2, 600, seed=12), corpus)
    methods = ["full", "streamingllm", "epicache"]
    assert _run_evaluate(corpus, tmp_path / "out", models.DEFAULT_LLM, ",".join(methods), "96") == 0
    records = _check_outputs(tmp_path / "out", methods)
    # with the real model, the full cache recalls the evidence far better than no history
    full = [r["evidence_nll"] for r in records if r["method"] == "full"]
    none = [r["evidence_nll"] for r in records if r["method"] == "none"]
    assert sum(full) < sum(none)


def test_a_failed_cell_is_reported_and_the_others_kept(tmp_path, ray_local):
    """`collect_cells` over real Ray tasks: the failing cell is listed with its error, the
    finished one is kept under its key and returned."""
    import ray

    from pipeline.eval.methods import Read
    from pipeline.store.backends.local import LocalStore

    plain = Read().prefix

    @ray.remote(max_retries=0)
    def cell(fail: bool) -> list[dict]:
        if fail:
            raise RuntimeError("out of memory in layer 3")
        return [{"method": "keydiff", "budget": 32, f"{plain}evidence_nll": 1.5}]

    kept = LocalStore(tmp_path)
    pending = {cell.remote(False): Cell("c1", 32, "cells/c1/x/ok.parquet", ["keydiff"]),
               cell.remote(True): Cell("c1", 32, "cells/c1/x/bad.parquet", ["snapkv"])}
    records, failed = collect_cells(pending, kept, EvalConfig())
    assert records == [{"method": "keydiff", "budget": 32, "cache_budget": 32,
                        "evidence_nll": 1.5}]  # the read's fields under their plain names
    assert failed == [{"conversation_id": "c1", "method": "snapkv", "budget": 32,
                       "error": "RuntimeError: out of memory in layer 3"}]
    assert kept.exists("cells/c1/x/ok.parquet") and not kept.exists("cells/c1/x/bad.parquet")


@pytest.mark.e2e
def test_the_fair_rows_run_at_the_defaults_decode_time_entries(tmp_path, tiny_llm_dir):
    """`jobs.evaluate --methods rag,full+topup.enabled=true,snapkv+topup.enabled=true,snapkv`
    with `--equal-entries epicache`: the topped-up rows read top-ups, every row with a budget
    runs at the default's mean decode-time entries (a topped-up one's cache budget less its
    top-up), reported at the default's budget, but for another method built per episode (a
    candidate default), which holds the default's budget per episode; the summary carries the
    headline with its intervals; an override a method cannot take is refused before any work
    (exit 2)."""
    corpus = tmp_path / "corpus.jsonl"
    write_jsonl(make_corpus(1, 500, seed=11), corpus)
    out = tmp_path / "out"
    methods = ("epicache,rag,full+topup.enabled=true,snapkv+topup.enabled=true,snapkv,"
               "epicache+scoring.sink=2")
    args = ["--corpus", str(corpus), "--out", str(out), "--model", tiny_llm_dir,
            "--budgets", "32", "--block", "64", "--medoids", "1",
            "--questions-per-conversation", "4", "--in-process", "--equal-entries", "epicache"]
    assert evaluate_job.main(args + ["--methods", methods]) == 0
    records = pq.read_table(out / "results.parquet").to_pylist()
    rows = {}
    for r in records:
        rows.setdefault(r["method"], []).append(r)
    for name in ("rag", "full+topup.enabled=true", "snapkv+topup.enabled=true"):
        assert sum(r["topup_tokens"] > 0 for r in rows[name]) >= len(rows[name]) / 2, name
    assert all(r["topup_tokens"] == 0 for r in rows["snapkv"])
    target = sum(r["decode_entries"] for r in rows["epicache"]) / len(rows["epicache"])
    own_rag = [r for r in rows["rag"] if r["budget"] is None]
    topup = sum(r["topup_tokens"] for r in own_rag) / len(own_rag)
    # rag also at the default's entries: reported at its budget, as many nearest turns as fit
    # the entries less its no-history prompt (here a little less than its own top-up)
    sized = [r for r in rows["rag"] if r["budget"] == 32]
    assert len(sized) == len(own_rag)
    assert all(r["topup_tokens"] <= round(target - r["kept_entries"]) for r in sized)
    assert sum(r["decode_entries"] for r in sized) / len(sized) > 0.8 * target
    assert {r["budget"] for r in rows["snapkv"] + rows["snapkv+topup.enabled=true"]} == {32}
    assert {r["cache_budget"] for r in rows["snapkv"]} == {round(target)}
    assert {r["cache_budget"] for r in rows["snapkv+topup.enabled=true"]} == {round(target - topup)}
    assert {(r["budget"], r["cache_budget"]) for r in rows["epicache+scoring.sink=2"]} == {(32, 32)}
    for r in records:
        for field in ("evidence_nll", "answer_nll", "topup_tokens", "topup_recall",
                      "kept_entries", "decode_entries", "evidence_nlls", "topup_turn_ids"):
            assert field in r, (r["method"], field)
    card = json.loads((out / "summary.json").read_text())["scorecard"]["all"]
    snap = next(r for r in card["rows"] if r["method"] == "snapkv+topup.enabled=true")
    for measure in ("answer", "copy_free", "evidence", "over_retrieval"):
        assert {"value", "lo", "hi"} <= set(snap[measure]), measure
    assert set(snap["default_minus_row"]) == {"answer", "copy_free"}
    assert "Scorecard (all" in (out / "table.md").read_text()
    assert (out / "scorecard-all.png").stat().st_size > 0
    assert evaluate_job.main(args + ["--methods", "snapkv+scoring.focus=0.5"]) == 2
    assert evaluate_job.main(args + ["--methods", "snapkv", "--set", "scoring.focus=2"]) == 2


@pytest.mark.e2e
def test_the_scorecard_writes_its_page_with_both_groups_and_generated_answers(tmp_path,
                                                                              tiny_llm_dir):
    """`jobs.scorecard` on two conversations, one tuned on: the page has a table per group with
    the headline measures, the plots beside it, the signal and the F1 of the answers generated
    (the default's through the product's answer path, the full history's from its cache); a
    --tuning id the corpus lacks is refused before any work; without --tuning, only LoCoMo's
    tuning conversations are, so a corpus without them is all untouched."""
    from jobs import scorecard as scorecard_job

    corpus = tmp_path / "corpus.jsonl"
    convs = make_corpus(2, 500, seed=11)
    write_jsonl(convs, corpus)
    page = tmp_path / "docs" / "scorecard.md"
    args = ["--corpus", str(corpus), "--out", str(tmp_path / "out"), "--model", tiny_llm_dir,
            "--budgets", "32", "--block", "64", "--medoids", "1", "--page", str(page),
            "--questions-per-conversation", "2", "--f1-questions", "1", "--max-new-tokens", "3",
            "--methods", "full,epicache,snapkv+topup.enabled=true,rag,full+topup.enabled=true",
            "--in-process", "--max-context-tokens", "4000"]
    assert scorecard_job.main(args + ["--tuning", "nobody"]) == 2 and not page.exists()
    assert scorecard_job.main(args + ["--tuning", convs[0].conversation_id]) == 0
    text = page.read_text()
    assert f"## Tuning: {convs[0].conversation_id}" in text
    assert f"## Untouched: {convs[1].conversation_id}" in text
    assert "copy-free evidence" in text and "python -m jobs.scorecard" in text
    for group in ("tuning", "untouched"):
        assert (page.parent / f"scorecard-{group}.png").stat().st_size > 0
    data = json.loads(page.with_suffix(".json").read_text())  # the page's data beside it
    assert set(data["scorecard"]) == {"tuning", "untouched"} and data["command"] in text
    records = pq.read_table(tmp_path / "out" / "results.parquet").to_pylist()
    answered = {(r["conversation_id"], r["method"], r["question_index"]) for r in records
                if r.get("prediction") is not None}
    assert answered == {(c.conversation_id, m, 0) for c in convs for m in ("epicache", "full")}
    assert text.count("| epicache | 32 | 1 |") == 2  # one answer a conversation, in each group
    # without --tuning, the LoCoMo tuning set among those evaluated: here none, all untouched
    assert scorecard_job.main(args) == 0
    assert "## Tuning" not in page.read_text() and "## Untouched" in page.read_text()


@pytest.mark.e2e
def test_the_oracle_window_reference_is_the_full_cache_of_each_questions_window(tiny_llm_dir):
    """With `reference_window`, the `full` cell measures each question on the full cache of its
    window alone: the same NLLs as the full cell of a conversation that is that window; a
    window holding the whole conversation gives the plain full reference."""
    from pipeline.eval.cell import Prepared, evaluate_cell, prepare

    conv = make_corpus(1, 1500, seed=7)[0]
    plain = EvalConfig(BuildConfig(model=tiny_llm_dir, prefill=PrefillConfig(block=64)),
                       questions_per_conversation=4)
    whole = evaluate_cell(prepare(conv, plain), "full", None, plain, None)
    everything = EvalConfig(plain.build, questions_per_conversation=4, reference_window=100_000)
    assert [r["answer_nll"] for r in evaluate_cell(prepare(conv, everything), "full", None,
                                                   everything, None)] == \
        pytest.approx([r["answer_nll"] for r in whole], abs=1e-5)
    windowed = EvalConfig(plain.build, reference_window=500)
    prep = prepare(conv, windowed)
    assert len(prep.windows.windows) > 1 and prep.questions
    records = evaluate_cell(prep, "full", None, windowed, None)
    for q, w, record in zip(prep.questions, prep.windows.of_question, records):
        window = prep.windows.windows[w]
        alone = evaluate_cell(Prepared(window, (q,), 0, 0), "full", None, plain, None)[0]
        assert record["answer_nll"] == pytest.approx(alone["answer_nll"], abs=1e-5)
        assert record["kept_entries"] < whole[0]["kept_entries"]


@pytest.mark.e2e
def test_the_full_length_scorecard_reads_whole_conversations_against_their_windows(
        tmp_path, tiny_llm_dir):
    """`jobs.scorecard --full-length`: nothing cut, the reference each question's window (the
    page says so, the summary lists the windows), and answer retention by the evidence's
    third, session and route hit."""
    from jobs import scorecard as scorecard_job

    corpus = tmp_path / "corpus.jsonl"
    conv = make_corpus(1, 1500, seed=7)[0]
    write_jsonl([conv], corpus)
    page = tmp_path / "docs" / "scorecard-full.md"
    assert scorecard_job.main([
        "--full-length", "--corpus", str(corpus), "--out", str(tmp_path / "out"), "--model",
        tiny_llm_dir, "--budgets", "32", "--block", "64", "--medoids", "1", "--page", str(page),
        "--methods", "full,epicache,rag", "--reference-window", "500", "--in-process",
        "--tuning", conv.conversation_id]) == 0
    text = page.read_text()
    assert "oracle window" in text and "cut at a session boundary" not in text
    for title in ("third of the conversation", "(first) session", "route read an episode"):
        assert f"Answer retention by the evidence's {title}" in text or title in text
    data = json.loads(page.with_suffix(".json").read_text())
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    [described] = summary["conversations"]
    assert described["tokens"] > 500 and len(described["windows"]) > 1
    assert data["config"]["reference_window"] == 500
