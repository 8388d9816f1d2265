"""The limits on one answer (`pipeline.config.limits`), checked once at each entry (the
`Answerer`'s `answer`, `jobs.answer`'s arguments, the server's request body: `checked`) and
held alike past it: a question is bounded in characters before any tokenizer sees it, then in
tokens where it is tokenised (the library's decode, the Serve decoder's batcher); the answer
length and the temperature are in range; the cached history, prompt and answer fit the model's
positions."""

from __future__ import annotations

import math

import pytest

from pipeline.answer.batcher import DecodeBatcher
from pipeline.answer.decode import decode_answer, question_prompt
from pipeline.config.limits import (
    CHARS_PER_TOKEN,
    DEFAULT_LIMITS,
    AnswerLimits,
    LimitError,
    check_positions,
)
from pipeline.kv.methods.epicache import EpiCache
from pipeline.kv.prefill import PrefillConfig, block_prefill
from tests.support.tiny_models import (  # noqa: F401
    CharTokenizer,
    StandIn,
    one_torch_thread,
    random_ids,
    tiny_model,
)

HUGE = "a" * 100_000


class CountingTokenizer(CharTokenizer):
    """A tokenizer that records the length of every text it is given."""

    def __init__(self) -> None:
        self.seen: list[int] = []

    def __call__(self, text: str, add_special_tokens: bool = False) -> dict:
        self.seen.append(len(text))
        return super().__call__(text, add_special_tokens)


@pytest.fixture(scope="module")
def lm_and_cache():
    model = tiny_model("llama")
    cache, _ = block_prefill(model, random_ids(60, seed=3), EpiCache(patch=random_ids(6, seed=4)),
                             [20, 20, 20], PrefillConfig(block=8))
    return StandIn(model), cache


def test_a_question_is_bounded_in_characters_before_tokens():
    limits = AnswerLimits(max_question_tokens=10)
    assert limits.max_question_chars == 10 * CHARS_PER_TOKEN
    assert limits.check_question("x" * limits.max_question_chars) == "x" * 80
    with pytest.raises(LimitError, match="81 characters long; the limit is 80 characters"):
        limits.check_question("x" * 81)
    for blank in ("", "   ", None, 3):
        with pytest.raises(LimitError, match="empty"):
            limits.check_question(blank)
    assert limits.check_question("Wo lebt Zoë? 🙂") == "Wo lebt Zoë? 🙂"
    with pytest.raises(LimitError, match="not valid Unicode"):
        limits.check_question("Who\ud800?")  # JSON's "\ud800": a tokenizer cannot encode it
    limits.check_question_tokens(10)
    with pytest.raises(LimitError, match="11 tokens long; the limit is 10"):
        limits.check_question_tokens(11)


@pytest.mark.parametrize("max_new, temperature", [
    (0, 0.0), (513, 0.0), (1.5, 0.0), (True, 0.0), ("8", 0.0),
    (8, -1.0), (8, math.nan), (8, math.inf), (8, 2.01), (8, "0.5"), (8, None), (8, True)])
def test_sampling_parameters_out_of_range_are_refused(max_new, temperature):
    with pytest.raises(LimitError):
        DEFAULT_LIMITS.check_sampling(max_new, temperature)


def test_sampling_parameters_in_range_pass_and_the_message_names_the_caller_s_field():
    assert DEFAULT_LIMITS.check_sampling(1, 0) == (1, 0.0)
    assert DEFAULT_LIMITS.check_sampling(512, 2.0) == (512, 2.0)
    with pytest.raises(LimitError, match="--temperature must be a number from 0 .* got nan"):
        DEFAULT_LIMITS.check_sampling(8, math.nan, ("--max-new-tokens", "--temperature"))


def test_limits_themselves_must_be_sane():
    for bad in ({"max_question_tokens": 0}, {"max_new_tokens": -1}, {"max_temperature": math.nan}):
        with pytest.raises(ValueError):
            AnswerLimits(**bad)


def test_the_positions_must_hold_the_cache_the_prompt_and_the_answer():
    check_positions(1000, 20, 4, 1024)
    check_positions(10**9, 10, 10, None)  # no bound known
    with pytest.raises(LimitError, match="needs 1025 positions .* the model has 1024"):
        check_positions(1000, 21, 4, 1024)


def test_an_entry_checks_a_question_once_and_the_prompt_counts_its_tokens_once(lm_and_cache):
    lm, cache = lm_and_cache
    with pytest.raises(LimitError, match="100,000 characters"):
        DEFAULT_LIMITS.checked(HUGE, 8, 0.0)  # no tokenizer: a huge question never reaches one
    with pytest.raises(LimitError, match="field 'temperature' must be"):
        DEFAULT_LIMITS.checked("Who?", 8, math.nan,
                               ("field 'max_new_tokens'", "field 'temperature'"))
    asked = DEFAULT_LIMITS.checked("Who?", 8, 0)
    assert (asked.text, asked.max_new_tokens, asked.temperature) == ("Who?", 8, 0.0)
    counting = StandIn(lm.model)
    counting.tokenizer = CountingTokenizer()
    limits = AnswerLimits(max_question_tokens=5)  # the character tokenizer: 1 token a character
    with pytest.raises(LimitError, match="6 tokens long"):
        question_prompt(counting, cache, "x" * 6, 8, limits)
    assert counting.tokenizer.seen == [6]  # only the bounded question, once
    assert len(question_prompt(counting, cache, "x" * 5, 8, limits)) > 5


def test_decode_refuses_an_answer_past_the_model_s_positions(lm_and_cache):
    lm, cache = lm_and_cache
    limit = lm.model.config.max_position_embeddings
    room = limit - cache.next_position - len(question_prompt(lm, cache, "Who?", 1))
    limits = AnswerLimits(max_new_tokens=limit)
    assert decode_answer(lm, cache, "Who?", 2, limits=limits).tokens >= 1
    with pytest.raises(LimitError, match=f"the model has {limit}"):
        decode_answer(lm, cache, "Who?", room + 1, limits=limits)


def test_the_batcher_refuses_before_it_queues(lm_and_cache):
    """Past the router's check of the body: a question over the token limit, or an answer past
    the model's positions, is refused before it is queued."""
    lm, cache = lm_and_cache
    limit = lm.model.config.max_position_embeddings
    batcher = DecodeBatcher(lm, limits=AnswerLimits(max_question_tokens=16, max_new_tokens=4))
    try:
        for question, max_new, match in (("x" * 17, 2, "17 tokens long"),
                                         ("Who?", limit, f"the model has {limit}")):
            with pytest.raises(LimitError, match=match):
                batcher.submit(cache, question, max_new)
        assert batcher.stats()["queued"] == 0 and batcher.stats()["failed"] == 0
        assert batcher.submit(cache, "Who?", 2).future.result(timeout=60).tokens >= 1
    finally:
        batcher.close()


def test_the_answerer_refuses_before_it_reads_the_store_or_loads_a_model(tmp_path):
    from pipeline.answer.answerer import Answerer
    from pipeline.store.backends.local import LocalStore

    answerer = Answerer(LocalStore(tmp_path))  # empty: a read would be ConversationNotFound
    with pytest.raises(LimitError, match="100,000 characters"):
        answerer.answer("synth-0000", HUGE)
    with pytest.raises(LimitError, match="temperature"):
        answerer.answer("synth-0000", "Who?", temperature=-1)
    with pytest.raises(LimitError, match="max_new_tokens"):
        answerer.answer("synth-0000", "Who?", max_new_tokens=10_000)

