"""Continuous batching (`pipeline.answer.packed`, `pipeline.answer.batcher`) on tiny random models:
a greedy answer decoded inside a batch of other conversations (different cache lengths per layer and
per head), or joining a batch mid-way, is token for token the answer decoded alone by `generate()`;
the resident cache is never written; the caps hold; a bad request fails alone."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from transformers import TextIteratorStreamer

from pipeline.answer.batcher import DecodeBatcher
from pipeline.answer.decode import (
    AnswerPieces,
    decode_answer,
    generate_from_cache,
    question_prompt,
)
from pipeline.answer.packed import DecodeRow, packed_step
from pipeline.config.limits import DEFAULT_LIMITS
from pipeline.kv.cache import EpisodicCache
from pipeline.kv.methods.epicache import EpiCache
from pipeline.kv.prefill import PrefillConfig, block_prefill
from tests.support.tiny_models import StandIn, one_torch_thread, random_ids, tiny_model  # noqa: F401


def _caches(model, specs=((61, 12, "headwise"), (90, 20, "perhead"), (40, 9, "headwise"))):
    """Episodic caches of different lengths per layer and per head (AdaKV-style eviction)."""
    out = []
    for i, (n, budget, selection) in enumerate(specs):
        cache, _ = block_prefill(model, random_ids(n, seed=7 + i),
                                 EpiCache(patch=random_ids(6, seed=8)),
                                 [budget, budget + 3, budget - 2],
                                 PrefillConfig(block=8, selection=selection))
        out.append(cache)
    heads = out[1].layers[0].valid.sum(dim=1)
    assert heads.min() != heads.max() or out[0].layers[0].valid.sum(1).unique().numel() > 1
    return out


def _state(cache: EpisodicCache) -> list[tuple]:
    return [(layer.keys.clone(), layer.valid.clone(), layer.tokens_seen, layer.next_position)
            for layer in cache.layers]


def _same_state(a: list[tuple], b: list[tuple]) -> bool:
    return all(torch.equal(x[0], y[0]) and torch.equal(x[1], y[1]) and x[2:] == y[2:]
               for x, y in zip(a, b))


def _packed_greedy(model, caches, questions, n_new):
    rows = [DecodeRow(c, len(q) + n_new) for c, q in zip(caches, questions)]
    logits = packed_step(model, rows, list(questions))
    out = [[] for _ in rows]
    for step in range(n_new):
        tokens = logits.argmax(-1)
        for got, t in zip(out, tokens.tolist()):
            got.append(t)
        if step < n_new - 1:
            logits = packed_step(model, rows, [t[None] for t in tokens])
    return out


@pytest.mark.parametrize("family", ["llama", "qwen2", "llama-mha", "mistral-sliding"])
def test_packed_greedy_decode_equals_generate_alone(family):
    model = tiny_model("mistral", sliding_window=24) if family == "mistral-sliding" else \
        tiny_model(family)
    caches = _caches(model)
    question = random_ids(5, seed=20)
    questions = [question, random_ids(7, seed=21), question]  # the same question twice
    before = [_state(c) for c in caches]
    alone = [generate_from_cache(StandIn(model), c, q, max_new_tokens=12).tolist()
             for c, q in zip(caches, questions)]
    assert alone[0] != alone[2]  # the same question about different conversations differs
    assert _packed_greedy(model, caches, questions, 12) == alone
    assert _packed_greedy(model, caches[::-1], questions[::-1], 12) == alone[::-1]
    assert _packed_greedy(model, caches[1:2], questions[1:2], 12) == alone[1:2]
    assert all(_same_state(b, _state(c)) for b, c in zip(before, caches))  # never written


def test_two_rows_over_one_shared_cache_do_not_see_each_other():
    model = tiny_model("llama")
    cache = _caches(model)[0]
    q1, q2 = random_ids(5, seed=30), random_ids(9, seed=31)
    alone = [generate_from_cache(StandIn(model), cache, q, max_new_tokens=10).tolist()
             for q in (q1, q2)]
    assert _packed_greedy(model, [cache, cache], [q1, q2], 10) == alone


def test_a_row_right_aligns_each_heads_entries_in_their_order():
    """Holes anywhere, a head with no entry, a layer with none: each head's entries end up
    against the new tokens' slots, in order, with their positions; nothing else is valid."""
    from types import SimpleNamespace

    from pipeline.answer.packed import _RowLayer

    keys, values = torch.randn(1, 3, 6, 4), torch.randn(1, 3, 6, 4)
    valid = torch.zeros(3, 6, dtype=torch.bool)
    valid[0, [1, 4]] = True
    valid[1, [0, 2, 3, 5]] = True  # head 2: no entry
    positions = torch.arange(18).view(3, 6)
    layer = SimpleNamespace(is_initialized=True, keys=keys, values=values, valid=valid,
                            rope_positions=positions)
    row = _RowLayer(layer, extra=2)
    assert row.slots == 4 and row.first_entries == [2, 0, 4] and row.keys.shape[2] == 6
    for h, picked in enumerate(([1, 4], [0, 2, 3, 5], [])):
        first = row.first_entries[h]
        assert torch.equal(row.keys[0, h, first:4], keys[0, h, picked])
        assert torch.equal(row.values[0, h, first:4], values[0, h, picked])
        assert torch.equal(row.rope_positions[h, first:4], positions[h, picked])
        assert row.valid[h, :4].tolist() == [False] * first + [True] * (4 - first)
    empty = _RowLayer(SimpleNamespace(**{**vars(layer), "valid": torch.zeros(3, 6, dtype=bool)}),
                      extra=2)
    assert empty.slots == 0 and empty.first_entries == [0, 0, 0]


@pytest.fixture(scope="module")
def lm_and_caches():
    model = tiny_model("llama")
    return StandIn(model), _caches(model)


QUESTIONS = ("Where did they go hiking?", "What is the pet called?", "Who cooked?")


class PauseAfter:
    """A streamer that holds the thread putting its `n`th answer token (the prefill thread
    puts the prompt and the first one, the decode thread the rest) until `go` is set."""

    def __init__(self, n: int):
        self.n, self.puts = n, 0
        self.reached, self.go = threading.Event(), threading.Event()

    def put(self, value) -> None:
        self.puts += 1
        if self.puts == self.n + 1:  # the first put is the prompt
            self.reached.set()
            self.go.wait(60)

    def end(self) -> None:
        pass


def test_batcher_answers_equal_decode_answer_also_when_joining_midway(lm_and_caches):
    lm, caches = lm_and_caches
    before = [_state(c) for c in caches]
    alone = [decode_answer(lm, c, q, 24) for c, q in zip(caches, QUESTIONS)]
    # the usage a client is billed: every token prefilled after the cache (equal below: batched)
    assert [a.prompt_tokens for a in alone] == [
        len(question_prompt(lm, c, q, 24, DEFAULT_LIMITS)) for c, q in zip(caches, QUESTIONS)]
    batcher = DecodeBatcher(lm, max_batch=8)
    try:
        pause = PauseAfter(6)
        first = batcher.submit(caches[0], QUESTIONS[0], 24, streamer=pause)
        assert pause.reached.wait(60)
        later = [batcher.submit(c, q, 24) for c, q in zip(caches[1:], QUESTIONS[1:])]
        pause.go.set()  # the others join a batch already 6 tokens into its answer
        got = [job.future.result(timeout=60) for job in (first, *later)]
        stats = batcher.stats()
    finally:
        batcher.close()
    assert got == alone
    assert stats["peak_batch"] == 3 and stats["completed"] == 3 and stats["failed"] == 0
    assert stats["prefixes"] == 3
    assert all(_same_state(b, _state(c)) for b, c in zip(before, caches))
    assert all(j.queue_ms >= 0 and j.decode_ms > 0 for j in (first, *later))


def test_a_new_cache_gets_its_instruction_entries_at_submit_not_inside_the_batch(lm_and_caches):
    """The batch's thread is held inside a step; a request over another cache is still
    submitted with the instruction's entries made (on the submitting thread)."""
    lm, caches = lm_and_caches
    batcher = DecodeBatcher(lm)
    try:
        pause = PauseAfter(2)
        first = batcher.submit(caches[0], QUESTIONS[0], 8, streamer=pause)
        assert pause.reached.wait(60)  # the decode thread waits inside a step's output
        second = batcher.submit(caches[1], QUESTIONS[1], 8)
        assert second.prefix is not None and batcher.stats()["prefixes"] == 2
        pause.go.set()
        assert second.future.result(timeout=60) == decode_answer(lm, caches[1], QUESTIONS[1], 8)
        assert first.future.result(timeout=60) == decode_answer(lm, caches[0], QUESTIONS[0], 8)
    finally:
        batcher.close()


def test_a_joining_request_is_prefilled_beside_the_batch_then_joins_it(lm_and_caches):
    """The decode thread is held inside a step; a new request is admitted and prefilled (its
    first token chosen) meanwhile, waits outside the batch, then joins it and answers as alone."""
    lm, caches = lm_and_caches
    batcher = DecodeBatcher(lm)
    try:
        pause = PauseAfter(3)  # the 4th put: a token of the decode thread's
        first = batcher.submit(caches[0], QUESTIONS[0], 8, streamer=pause)
        assert pause.reached.wait(60)
        second = batcher.submit(caches[1], QUESTIONS[1], 8)
        deadline = time.monotonic() + 60
        while not second.ids and time.monotonic() < deadline:
            time.sleep(0.005)
        held = batcher.stats()
        assert len(second.ids) == 1 and held["prefilling"] == 1 and held["batch"] == 1
        pause.go.set()
        assert second.future.result(timeout=60) == decode_answer(lm, caches[1], QUESTIONS[1], 8)
        assert first.future.result(timeout=60) == decode_answer(lm, caches[0], QUESTIONS[0], 8)
        stats = batcher.stats()
    finally:
        batcher.close()
    assert stats["prefills"] == 2 and stats["mean_prefill_rows"] == 1.0
    assert stats["peak_batch"] == 2 and stats["completed"] == 2


def test_batcher_streams_pieces_that_join_to_the_answer(lm_and_caches):
    lm, caches = lm_and_caches
    batcher = DecodeBatcher(lm)
    try:
        streamers = [TextIteratorStreamer(lm.tokenizer, skip_prompt=True, skip_special_tokens=True)
                     for _ in QUESTIONS]
        jobs = [batcher.submit(c, q, 16, streamer=s)
                for c, q, s in zip(caches, QUESTIONS, streamers)]
        joined = []
        for s in streamers:
            pieces = AnswerPieces()
            joined.append("".join(pieces.feed(text) for text in s))
        answers = [j.future.result(timeout=60) for j in jobs]
    finally:
        batcher.close()
    assert [a.text for a in answers] == joined
    assert all(a.tokens == 16 and a.finish_reason == "length" for a in answers)


def test_batcher_caps_the_batch_and_the_tokens_in_flight(lm_and_caches):
    lm, caches = lm_and_caches
    one = DecodeRow.slots_needed(caches[1], 40 + 8)  # an upper bound of any job here
    batcher = DecodeBatcher(lm, max_batch=2, max_batch_tokens=10 * one)
    try:
        pause = PauseAfter(2)  # the first held in a step until the others wait (not a race)
        jobs = [batcher.submit(caches[0], QUESTIONS[0], 8, streamer=pause)]
        assert pause.reached.wait(60)
        jobs += [batcher.submit(caches[i % 3], QUESTIONS[i % 3], 8) for i in range(1, 6)]
        pause.go.set()
        results = [j.future.result(timeout=120) for j in jobs]
        assert batcher.stats()["peak_batch"] == 2
    finally:
        batcher.close()
    small = DecodeBatcher(lm, max_batch=8, max_batch_tokens=1)  # every job is over the cap
    try:
        again = [small.submit(caches[i % 3], QUESTIONS[i % 3], 8) for i in range(3)]
        assert [j.future.result(timeout=120) for j in again] == results[:3]  # each alone
        stats = small.stats()
        assert stats["peak_batch"] == 1 and stats["mean_batch"] == 1.0
    finally:
        small.close()


def test_a_failing_request_fails_alone_and_sampling_uses_its_own_generator(lm_and_caches):
    lm, caches = lm_and_caches
    broken = EpisodicCache(2)  # two layers for a three-layer model: its forward fails
    broken.layers = caches[0].layers[:2]
    alone = decode_answer(lm, caches[1], QUESTIONS[1], 12)
    batcher = DecodeBatcher(lm)
    try:
        with batcher._wake:  # queue all before the scheduler sees any: they share a step
            jobs = [batcher._queue.append(j) or j for j in (
                _job(batcher, broken, QUESTIONS[0], 12),
                _job(batcher, caches[1], QUESTIONS[1], 12),
                _job(batcher, caches[2], QUESTIONS[2], 12, temperature=0.8))]
            batcher._wake.notify_all()
        with pytest.raises(Exception):
            jobs[0].future.result(timeout=60)
        assert jobs[1].future.result(timeout=60) == alone
        sampled = jobs[2].future.result(timeout=60)
        assert 1 <= sampled.tokens <= 12 and jobs[2].generator is not None
        assert batcher.stats()["failed"] == 1
    finally:
        batcher.close()


TOPUPS = ("\n\nSession 2, 3 May 2023\nAnna: We hiked up to the lake on Sunday.",
          "\n\nSession 5, 9 June 2023\nBen: The kitten is called Miso.\nAnna: Miso, how sweet!")


def test_requests_with_and_without_topups_batch_together_and_answer_as_alone(lm_and_caches):
    """A question-time top-up (`pipeline.answer.topup`) comes before the instruction, so its
    prompt is prefilled whole, beside requests that reuse the instruction's entries, over the
    same cache too: one prefill and one batch, each answer as `decode_answer` gives it alone."""
    lm, caches = lm_and_caches
    asks = [(caches[1], ""), (caches[1], TOPUPS[0]), (caches[1], TOPUPS[1]), (caches[2], "")]
    before = [_state(c) for c in caches]
    alone = [decode_answer(lm, c, QUESTIONS[1], 16, topup=t) for c, t in asks]
    # the top-up is read: the same question over the same cache answers otherwise
    assert len({a.text for a in alone[:3]}) == 3
    batcher = DecodeBatcher(lm, max_batch=8)
    try:
        with batcher._wake:  # all queued before the prefill thread admits any: one batch
            jobs = [batcher.submit(c, QUESTIONS[1], 16, topup=t) for c, t in asks]
        got = [j.future.result(timeout=60) for j in jobs]
        stats = batcher.stats()
    finally:
        batcher.close()
    assert got == alone
    assert [j.prefix is not None for j in jobs] == [True, False, False, True]
    assert stats["prefills"] == 1 and stats["mean_prefill_rows"] == 4.0
    assert stats["peak_batch"] == 4 and stats["completed"] == 4 and stats["failed"] == 0
    assert all(_same_state(b, _state(c)) for b, c in zip(before, caches))


LIVE = ("\n\nuser: My parrot is called Zephyrino.\nassistant: What a name!\n\n",
        "\n\nsystem: Answer in one word.\n\n")


def test_a_live_tail_is_read_after_the_top_up_and_batches_as_alone(lm_and_caches):
    """The live tail (`prompts.live_text`: the session's messages, which no cache holds) is
    read after the top-up and before the question: its prompt is prefilled whole, beside the
    others, and each answer is `decode_answer`'s alone, with the same top-up and tail."""
    lm, caches = lm_and_caches
    asks = [(caches[1], "", ""), (caches[1], "", LIVE[0]), (caches[1], TOPUPS[0], LIVE[0]),
            (caches[1], TOPUPS[0], LIVE[1]), (caches[2], "", "")]
    before = [_state(c) for c in caches]
    alone = [decode_answer(lm, c, QUESTIONS[1], 16, topup=t, live=live) for c, t, live in asks]
    # the live tail is read: the same question over the same cache answers otherwise
    assert alone[1].text != alone[0].text and len({a.text for a in alone[:4]}) >= 3
    batcher = DecodeBatcher(lm, max_batch=8)
    try:
        with batcher._wake:  # all queued before the prefill thread admits any: one batch
            jobs = [batcher.submit(c, QUESTIONS[1], 16, topup=t, live=live)
                    for c, t, live in asks]
        got = [j.future.result(timeout=60) for j in jobs]
    finally:
        batcher.close()
    assert got == alone
    assert [j.prefix is not None for j in jobs] == [True, False, False, False, True]
    assert all(_same_state(b, _state(c)) for b, c in zip(before, caches))


def test_teacher_forced_nll_is_that_of_one_forward_over_the_prompt_and_the_answer(lm_and_caches):
    """`teacher_forced_nll` steps the answer through the batcher's rows; the same prompt and
    answer in one plain forward over the cache (the evaluation's `continuation_nll`) give the
    same NLL, and the cache is left as it was."""
    from pipeline.answer.decode import question_prompt, teacher_forced_nll
    from pipeline.eval.metrics import continuation_nll
    from pipeline.kv import prompts

    lm, caches = lm_and_caches
    before = _state(caches[0])
    prompt = question_prompt(lm, caches[0], QUESTIONS[1], 8, topup=TOPUPS[1], live=LIVE[0])
    nll = teacher_forced_nll(lm, caches[0], prompt, "Zephyrino")
    reference = continuation_nll(lm.model, caches[0], prompt,
                                 prompts.encode(lm.tokenizer, "Zephyrino"))
    assert nll == pytest.approx(reference, abs=1e-4)
    assert _same_state(before, _state(caches[0]))
    with pytest.raises(ValueError):
        teacher_forced_nll(lm, caches[0], prompt, "  ")


def _job(batcher, cache, question, n, temperature=0.0):
    """A job as `submit` makes it (its prompt tokenised), queued by the caller."""
    from pipeline.answer.batcher import DecodeJob
    from pipeline.kv import prompts

    return DecodeJob(cache, question, n, temperature,
                     next_ids=prompts.question_ids(batcher.lm.tokenizer, question))


@pytest.mark.e2e
def test_smollm2_batched_greedy_answers_equal_decode_answer_alone():
    """The real model (float32 on CPU): three synthetic conversations of different lengths
    and budgets, asked together (and one joining mid-way) answer as each does alone."""
    from pipeline.corpus.render import render_conversation
    from pipeline.corpus.synthetic import make_corpus
    from pipeline.kv import models, prompts

    lm = models.load_llm()
    caches, questions = [], []
    for conv, budget in zip(make_corpus(3, 500, seed=5), (48, 96, 64)):
        ids = prompts.context_ids(lm.tokenizer, render_conversation(conv).text)
        n_layers = lm.config.num_hidden_layers
        cache, _ = block_prefill(lm.model, ids, EpiCache(patch=ids[-16:]), [budget] * n_layers,
                                 PrefillConfig(block=128))
        caches.append(cache)
        questions.append(conv.questions[0].question)
    alone = [decode_answer(lm, c, q, 12) for c, q in zip(caches, questions)]
    alone.append(decode_answer(lm, caches[2], questions[0], 12))  # a question of another one
    batcher = DecodeBatcher(lm, max_batch=8)
    try:
        first = batcher.submit(caches[0], questions[0], 12)
        while len(first.ids) < 3 and not first.future.done():
            time.sleep(0.005)
        jobs = [first] + [batcher.submit(c, q, 12) for c, q in
                          ((caches[1], questions[1]), (caches[2], questions[2]),
                           (caches[2], questions[0]))]
        got = [j.future.result(timeout=300) for j in jobs]
        stats = batcher.stats()
        assert stats["peak_batch"] >= 3 and stats["prefixes"] == 3  # instruction entries reused
    finally:
        batcher.close()
    assert [g.text for g in got] == [a.text for a in alone]
    assert got == alone
