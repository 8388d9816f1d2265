"""Answering questions about built conversations in one process: plan, load, decode.

A question is planned (`pipeline.answer.plan`: manifest, embed, route, top-up) as the Serve
router plans it; here the cache(s) it reads are then loaded into a byte-bounded LRU and the
answer decoded, after the top-up and the caller's live tail (a chat session's messages that no
cache holds, rendered by the model's chat template), as the server reads them. The Serve
application (`pipeline.serve`) splits the same steps over two deployments: the router plans
(and renders the live tail), the decoder loads and decodes the requests in flight together.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from pipeline.answer.decode import decode_answer, question_prompt, teacher_forced_nll
from pipeline.answer.fetch import resident_read
from pipeline.answer.lookup import check_models, embed_question
from pipeline.answer.lru import CacheLRU
from pipeline.answer.plan import QuestionPlanner, QuestionTools
from pipeline.answer.topup import TopUps, read_view
from pipeline.config import RoutingConfig, TopUpConfig
from pipeline.config.limits import DEFAULT_LIMITS, AnswerLimits, CheckedQuestion, LimitError
from pipeline.kv import models, prompts
from pipeline.kv.cache import EpisodicCache
from pipeline.kv.prompts import LIVE_ROLES, ChatTurn
from pipeline.store.backends.base import Store
from pipeline.store.catalogue.manifest import ManifestRecord
from pipeline.store.objects.cache_read import read_cache
from pipeline.store.objects.disk_tier import DiskTier


@dataclass
class AnswerResult:
    conversation_id: str
    question: str
    answer: str
    episode: int
    similarity: float
    cache_hit: bool
    timings_ms: dict[str, float] = field(default_factory=dict)
    episodes: list[int] = field(default_factory=list)  # read (two when the router was unsure)
    # the question-time top-up (`TopUp.as_dict`): the turns prefilled after the cache, or why none
    topup: dict = field(default_factory=dict)
    live_tokens: int = 0  # the live tail's, read after the top-up
    prompt_tokens: int = 0  # every token prefilled after the cache (top-up, live tail, question)

    def as_dict(self) -> dict:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


class Answerer:
    """Answers questions about built conversations; keeps the last episode's cache resident
    (and more, up to `resident_bytes`). `answer` is the library's entry: a question or
    parameter over `limits` (the server's limits too) is a `LimitError` there, before any
    model is loaded or any text tokenised; `answer_checked` takes a question an entry checked."""

    def __init__(self, store: Store, model: str | None = None, encoder: str | None = None,
                 device: str = "cpu", resident_bytes: int = 0, disk: DiskTier | None = None,
                 limits: AnswerLimits = DEFAULT_LIMITS, routing: RoutingConfig = RoutingConfig(),
                 topup: TopUpConfig = TopUpConfig()):
        self.store, self.device, self.disk, self.limits = store, device, disk, limits
        self.model_name, self.encoder_name = model, encoder
        self.planner = QuestionPlanner(store, self._tools, routing, topup)
        self.caches = CacheLRU(resident_bytes)

    @property
    def routing(self) -> RoutingConfig:
        return self.planner.routing

    @property
    def topups(self) -> TopUps:
        return self.planner.topups

    def manifest(self, conversation_id: str) -> list[ManifestRecord]:
        """The conversation's manifest records, as the planner keeps them."""
        return self.planner.conversation(conversation_id).records

    def _tools(self, records: list[ManifestRecord]) -> QuestionTools:
        """The encoder and token count of the models the conversation was built with, refused
        (before any question is planned) unless their files are the ones it was built with
        (`check_models`)."""
        first = records[0]
        check_models(records, self.model_name, self.encoder_name)  # names; no fingerprint
        lm = models.load_llm(first.model_id, self.device)
        encoder = models.load_encoder(first.encoder_id, self.device)
        check_models(records, None, None, model_fingerprint=lm.fingerprint,
                     encoder_fingerprint=models.encoder_fingerprint(first.encoder_id))
        return QuestionTools(functools.partial(embed_question, encoder),
                             functools.partial(prompts.count_tokens, lm.tokenizer))

    def load_caches(self, records: list[ManifestRecord]) -> tuple[EpisodicCache, bool]:
        """The cache a question reads: its episode's, or two episodes' joined (`resident_read`),
        each verified against the manifest as it is read (`read_cache`); refused unless the
        model loaded for them has the files they were built with."""
        refs = tuple(r.ref for r in records)
        lm = models.load_llm(refs[0].model_id, self.device)
        check_models(refs, None, None, model_fingerprint=lm.fingerprint)
        return resident_read(self.caches, refs, lambda ref: read_cache(
            self.store, ref, self.disk, lm.model.dtype, self.device).cache)

    def check_live(self, live: Sequence[ChatTurn]) -> None:
        """A live tail's roles and characters, before any model is loaded (`LimitError`)."""
        for i, turn in enumerate(live):
            if turn.role not in LIVE_ROLES:
                raise LimitError(f"live message {i}: its role is one of {', '.join(LIVE_ROLES)}, "
                                 f"not {turn.role!r}")
        self.limits.check_live_chars(prompts.live_chars(live))

    def live_text(self, lm: models.LoadedModel, live: Sequence[ChatTurn]) -> tuple[str, int]:
        """The live tail's text as the model's chat template renders it and its tokens, held to
        the limit (`LimitError`), as the server's router renders and counts it."""
        text = prompts.live_text(lm.tokenizer, live)
        tokens = len(prompts.live_ids(lm.tokenizer, text)) if text else 0
        self.limits.check_live_tokens(tokens)
        return text, tokens

    def answer(self, conversation_id: str, question: str, max_new_tokens: int = 32,
               temperature: float = 0.0, live: Sequence[ChatTurn] = ()) -> AnswerResult:
        """The answer to `question` (after the `live` tail: the session's messages before it,
        which no cache holds), held to the limits first (the library's entry)."""
        checked = self.limits.checked(question, max_new_tokens, temperature)
        self.check_live(live)
        return self.answer_checked(conversation_id, checked, live)

    def answer_checked(self, conversation_id: str, question: CheckedQuestion,
                       live: Sequence[ChatTurn] = ()) -> AnswerResult:
        """The answer to a question an entry held to the limits (`jobs.answer`'s arguments;
        `live` checked by `check_live`): planned, its cache(s) loaded, the live tail rendered
        and counted, decoded."""
        plan = self.planner.plan(conversation_id, question.text)
        lm = models.load_llm(plan.records[0].model_id, self.device)
        live_text, live_tokens = self.live_text(lm, live)
        timings = {k: plan.timings_ms[k] for k in ("embed", "route")}
        t = time.perf_counter()
        cache, hit = self.load_caches(plan.read)
        cache = read_view(cache, plan.topup.hidden_spans)
        timings["load"] = (time.perf_counter() - t) * 1000
        timings["topup"] = plan.timings_ms["topup"]
        t = time.perf_counter()
        decoded = decode_answer(lm, cache, question.text, question.max_new_tokens,
                                question.temperature, self.limits, plan.topup.text, live_text)
        timings["decode"] = (time.perf_counter() - t) * 1000
        return AnswerResult(conversation_id, question.text, decoded.text, plan.read[0].episode,
                            plan.similarity, hit, {k: round(v, 2) for k, v in timings.items()},
                            [r.episode for r in plan.read], plan.topup.as_dict(), live_tokens,
                            decoded.prompt_tokens)

    def answer_nll(self, conversation_id: str, question: str, answer: str,
                   live: Sequence[ChatTurn] = ()) -> float:
        """The teacher-forced NLL of `answer` (nats a token) on the prompt the question is
        answered with here and by the server: its plan (caches, top-up), the live tail, on the
        batcher's forward (`decode.teacher_forced_nll`). What tells a prompt path that reaches
        the decoder from one that does not; no endpoint serves it."""
        checked = self.limits.checked(question, 1, 0.0)
        self.check_live(live)
        plan = self.planner.plan(conversation_id, checked.text)
        lm = models.load_llm(plan.records[0].model_id, self.device)
        live_text, _ = self.live_text(lm, live)
        cache = read_view(self.load_caches(plan.read)[0], plan.topup.hidden_spans)
        answer_tokens = max(1, prompts.count_tokens(lm.tokenizer, answer.strip()))
        prompt = question_prompt(lm, cache, checked.text, answer_tokens, self.limits,
                                 plan.topup.text, live_text)
        return teacher_forced_nll(lm, cache, prompt, answer)
