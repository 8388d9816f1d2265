"""Continuous batching for a decoder replica: a prefill thread prefills the questions of the
requests it admits, beside the batch, and a decode thread decodes every prefilled request
together, one token each per step (`pipeline.answer.packed.packed_step`), taking in newly prefilled
ones between steps and dropping finished ones.

Prefilling beside the batch keeps a joining request's prompt out of the batch's steps (a step
that also prefilled a 14-token question took ~40% longer for every row in it) and starts the
prefill as soon as the request is admitted, not at the end of the step in flight; the replica
then uses a second core while a request joins. A request leaves at its end-of-sequence token or
`max_new_tokens`. Admission is first come, first served, up to `max_batch` requests and
`max_batch_tokens` tokens in flight (prefilling or decoding; each row's cache slots + prompt +
max_new_tokens: what its private buffers hold); a request larger than the token cap on its own
still runs, alone. Greedy rows take the arg-max, as `generate()` does, so their answers are the
same as decoded alone; sampled rows draw from their own generator. A step that fails is retried
row by row, so a bad request fails alone.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
import weakref
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from pipeline.answer.decode import Decoded, finish_reason, question_prompt
from pipeline.answer.packed import DecodeRow, Prefix, packed_step
from pipeline.config.limits import DEFAULT_LIMITS, AnswerLimits
from pipeline.kv import models, prompts
from pipeline.kv.cache import EpisodicCache
from pipeline.telemetry import DecoderMetrics

log = logging.getLogger("epicache.serve")


@dataclass
class DecodeJob:
    """One request: its result (`future`: a `Decoded`) and timings; `cancel()` drops it."""
    cache: EpisodicCache
    question: str
    max_new_tokens: int
    temperature: float
    streamer: object | None = None  # a transformers streamer: put(prompt), put(token)..., end()
    future: Future = field(default_factory=Future)
    submitted: float = field(default_factory=time.perf_counter)
    started: float | None = None  # admitted: its prefill starts
    finished: float | None = None
    cancelled: bool = False
    # the batcher's state
    cost: int = 0
    prefix: Prefix | None = None  # the instruction's entries over `cache` (made at submit)
    row: DecodeRow | None = None
    next_ids: torch.Tensor | None = None
    ids: list[int] = field(default_factory=list)
    prompt_tokens: int = field(init=False)  # the prompt's tokens: `next_ids` as made
    generator: torch.Generator | None = None
    warpers: object | None = None  # a sampled request's logits warpers (made once, at its start)

    def __post_init__(self) -> None:
        self.prompt_tokens = len(self.next_ids) if self.next_ids is not None else 0

    def cancel(self) -> None:
        self.cancelled = True

    @property
    def queue_ms(self) -> float:
        return ((self.started or self.finished or self.submitted) - self.submitted) * 1000

    @property
    def decode_ms(self) -> float:
        return ((self.finished or time.perf_counter()) - (self.started or self.submitted)) * 1000


@dataclass
class StepCounts:
    """Forwards of one kind (prefill or decode) that succeeded: how many, over how many rows,
    and the time spent in them."""
    steps: int = 0
    rows: int = 0
    seconds: float = 0.0

    def add(self, rows: int, seconds: float) -> None:
        self.steps += 1
        self.rows += rows
        self.seconds += seconds

    def means(self) -> tuple[float | None, float | None]:
        """Rows per step and ms per step (None before the first step)."""
        if not self.steps:
            return None, None
        return round(self.rows / self.steps, 3), round(1000 * self.seconds / self.steps, 2)


class DecodeBatcher:
    """Decodes the requests submitted to it in batches: a prefill thread and a decode thread."""

    def __init__(self, lm: models.LoadedModel, max_batch: int = 8,
                 max_batch_tokens: int = 32768, limits: AnswerLimits = DEFAULT_LIMITS,
                 metrics: DecoderMetrics | None = None) -> None:
        if max_batch < 1 or max_batch_tokens < 1:
            raise ValueError(f"max_batch and max_batch_tokens must be >= 1, got {max_batch} and "
                             f"{max_batch_tokens}")
        self.lm, self.max_batch, self.max_batch_tokens = lm, max_batch, max_batch_tokens
        self.limits = limits
        self.metrics = metrics  # a decoder replica's (batch sizes, queue depth); None: not exported
        gen = lm.model.generation_config
        eos = gen.eos_token_id
        self._eos = set(eos if isinstance(eos, (list, tuple)) else [eos]) - {None}
        self._top_k, self._top_p = gen.top_k, gen.top_p
        self._prefix_ids = prompts.question_prefix_ids(lm.tokenizer)
        # the instruction's cache entries per resident cache, dropped with the cache
        self._prefixes: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._prefixes_lock = threading.Lock()
        self._queue: deque[DecodeJob] = deque()  # submitted, not admitted yet
        self._prefilling: list[DecodeJob] = []  # admitted, in the prefill thread's hands
        self._ready: list[DecodeJob] = []  # prefilled, joining the batch at the next step
        self._active: list[DecodeJob] = []  # in the batch
        self._wake = threading.Condition()  # one lock over all four; both threads wait on it
        self._closed = False
        self.prefills, self.decodes = StepCounts(), StepCounts()
        self.completed = self.failed = 0
        self.peak_batch = self.peak_tokens = 0
        self._threads = [threading.Thread(target=loop, name=name, daemon=True)
                         for loop, name in ((self._prefill_loop, "decode-prefill"),
                                            (self._decode_loop, "decode-batch"))]
        for thread in self._threads:
            thread.start()

    # -- the callers' side --------------------------------------------------------------------
    def submit(self, cache: EpisodicCache, question: str, max_new_tokens: int,
               temperature: float = 0.0, streamer=None, topup: str = "",
               live: str = "") -> DecodeJob:
        """Queue a request (`topup`: the question's top-up text, `pipeline.answer.topup`;
        `live`: its live tail's text, `pipeline.kv.prompts.live_text`, read after the top-up);
        its `future` gets the `Decoded` answer (or the error). The question and the sampling
        parameters were checked at the entry (the router's request body); a question over the
        token limit, or an answer past the model's positions, is a `LimitError` here, before it
        is queued: the question is tokenised on the caller's thread. The first request over a
        cache computes the instruction's entries for it here too (a forward of its 37 tokens),
        so that the batch never waits on it. A prompt with a top-up or a live tail does not open
        with the instruction: it is prefilled whole."""
        prompt = question_prompt(self.lm, cache, question, max_new_tokens, self.limits, topup,
                                 live)
        prefix = self._prefix(cache) if self._opens_with_prefix(prompt) else None
        job = DecodeJob(cache, question, max_new_tokens, temperature, streamer,
                        next_ids=prompt, prefix=prefix)
        with self._wake:
            if self._closed:
                raise RuntimeError("the decode batcher is closed")
            self._queue.append(job)
            self._report_depth()
            self._wake.notify_all()
        return job

    def close(self) -> None:
        with self._wake:
            self._closed = True
            self._wake.notify_all()
        for thread in self._threads:
            thread.join(timeout=60)
        with self._wake:
            left = [*self._prefilling, *self._ready, *self._active, *self._queue]
        for job in left:
            self._fail(job, RuntimeError("the decoder is shutting down"))

    def stats(self) -> dict:
        with self._wake:
            mean_batch, mean_step_ms = self.decodes.means()
            mean_prefill_rows, mean_prefill_ms = self.prefills.means()
            return {"max_batch": self.max_batch, "max_batch_tokens": self.max_batch_tokens,
                    "batch": len(self._active), "queued": len(self._queue),
                    "prefilling": len(self._prefilling) + len(self._ready),
                    "tokens_in_flight": sum(j.cost for j in self._admitted()),
                    "steps": self.decodes.steps, "mean_batch": mean_batch,
                    "mean_step_ms": mean_step_ms, "prefills": self.prefills.steps,
                    "mean_prefill_rows": mean_prefill_rows, "mean_prefill_ms": mean_prefill_ms,
                    "peak_batch": self.peak_batch, "peak_tokens_in_flight": self.peak_tokens,
                    "completed": self.completed, "failed": self.failed,
                    "prefixes": len(self._prefixes)}

    # -- the two threads -----------------------------------------------------------------------
    def _prefill_loop(self) -> None:
        """Admits queued requests as room frees and prefills them together (their question
        after the instruction's entries); each emits its first token and joins the batch."""
        while True:
            with self._wake:
                joining = self._admit()
                while not joining and not self._closed:
                    self._wake.wait()
                    joining = self._admit()
                if self._closed:
                    return
            for job in joining:
                self._start(job)
            live = [j for j in joining if not j.future.done()]
            if live:
                self._step(live, self.prefills)
            with self._wake:
                self._prefilling = []  # only this thread admits: they were all `joining`
                self._ready += [j for j in live if not self._settled(j)]
                self._report_depth()
                self._wake.notify_all()

    def _decode_loop(self) -> None:
        """One token for every request in the batch per step; newly prefilled ones join
        between steps."""
        while True:
            with self._wake:
                while not self._closed and not self._ready and not self._active:
                    self._wake.wait()
                if self._closed:
                    return
                self._active = [j for j in self._active + self._ready if not self._settled(j)]
                self._ready = []
                self.peak_batch = max(self.peak_batch, len(self._active))
                batch = list(self._active)
            if batch:
                self._step(batch, self.decodes)
            with self._wake:
                self._active = [j for j in self._active if not self._settled(j)]
                self._report_depth()
                self._wake.notify_all()  # room for the prefill thread, if a request left

    def _admitted(self) -> list[DecodeJob]:
        return [*self._prefilling, *self._ready, *self._active]

    def _report_depth(self) -> None:
        """(Under `_wake`.) The requests queued or in flight, to the replica's gauge."""
        if self.metrics is not None:
            self.metrics.queue_depth(len(self._queue) + len(self._admitted()))

    def _admit(self) -> list[DecodeJob]:
        """Queued jobs that fit (first come, first served), moved to the prefill thread."""
        joining = []
        admitted = self._admitted()
        in_flight = sum(j.cost for j in admitted)
        while self._queue and len(admitted) + len(joining) < self.max_batch:
            job = self._queue[0]
            if job.cancelled:
                self._queue.popleft()
                self._fail(job, RuntimeError("cancelled"))
                continue
            if not job.cost:
                try:
                    job.cost = DecodeRow.slots_needed(job.cache,
                                                      len(job.next_ids) + job.max_new_tokens)
                except Exception as e:  # a malformed cache: this request fails, not the batch
                    self._queue.popleft()
                    self._fail(job, e)
                    continue
            if (admitted or joining) and in_flight + job.cost > self.max_batch_tokens:
                break
            self._queue.popleft()
            in_flight += job.cost
            joining.append(job)
        self._prefilling += joining
        self.peak_tokens = max(self.peak_tokens, in_flight)
        return joining

    def _start(self, job: DecodeJob) -> None:
        """Make the job's private view of its cache (its prompt is tokenised already)."""
        job.started = time.perf_counter()
        try:
            prompt = job.next_ids
            prefix = job.prefix if self._opens_with_prefix(prompt) else None
            job.row = DecodeRow(job.cache, len(prompt) + job.max_new_tokens, prefix)
            if prefix is not None:
                job.next_ids = prompt[len(prefix.ids):]
            if job.temperature > 0:
                job.generator = torch.Generator().manual_seed(secrets.randbits(63))
                job.warpers = self._warpers(job.temperature)
            if job.streamer is not None:
                job.streamer.put(prompt[None])  # as generate() does: the prompt comes first
        except Exception as e:
            self._fail(job, e)

    def _prefix(self, cache: EpisodicCache) -> Prefix | None:
        """The instruction's entries over `cache`, made on first use (None for an empty
        instruction); two first requests over one cache may both make them, one is kept."""
        if not len(self._prefix_ids):
            return None
        with self._prefixes_lock:
            prefix = self._prefixes.get(cache)
        if prefix is None:
            made = Prefix(self.lm.model, cache, self._prefix_ids)
            with self._prefixes_lock:
                prefix = self._prefixes.setdefault(cache, made)
        return prefix

    def _opens_with_prefix(self, prompt: torch.Tensor) -> bool:
        """Whether `prompt` opens with the instruction and goes on after it (then a request
        prefills only its question)."""
        n = len(self._prefix_ids)
        return 0 < n < len(prompt) and torch.equal(prompt[:n], self._prefix_ids)

    def _settled(self, job: DecodeJob) -> bool:
        if job.future.done():
            return True
        if job.cancelled:
            self._fail(job, RuntimeError("cancelled"))
            return True
        return False

    def _step(self, jobs: list[DecodeJob], counts: StepCounts) -> None:
        """One forward over the jobs' next tokens (their prompts in a prefill), each choosing
        its next token; on an error, each job alone (a bad one fails)."""
        snapshots = [job.row.snapshot() for job in jobs]
        start = time.perf_counter()
        try:
            logits = packed_step(self.lm.model, [j.row for j in jobs], [j.next_ids for j in jobs])
        except Exception as e:
            for job, snap in zip(jobs, snapshots):
                job.row.restore(snap)
            if len(jobs) == 1:
                self._fail(jobs[0], e)
                return
            for job in jobs:
                self._step([job], counts)
            return
        counts.add(len(jobs), time.perf_counter() - start)
        if self.metrics is not None and counts is self.decodes:
            self.metrics.batch_step(len(jobs))
        for job, row_logits in zip(jobs, logits):
            try:
                self._emit(job, self._choose(job, row_logits))
            except Exception as e:
                self._fail(job, e)

    def _warpers(self, temperature: float):
        """The sampling warpers of a request at `temperature`, as `generate()` builds them."""
        from transformers import (
            LogitsProcessorList,
            TemperatureLogitsWarper,
            TopKLogitsWarper,
            TopPLogitsWarper,
        )

        warpers = LogitsProcessorList([TemperatureLogitsWarper(temperature)])
        if self._top_k:
            warpers.append(TopKLogitsWarper(self._top_k))
        if self._top_p is not None and self._top_p < 1.0:
            warpers.append(TopPLogitsWarper(self._top_p))
        return warpers

    def _choose(self, job: DecodeJob, logits: torch.Tensor) -> int:
        if job.temperature <= 0:
            return int(torch.argmax(logits))
        scores = job.warpers(None, logits[None])
        probs = torch.softmax(scores, dim=-1)
        return int(torch.multinomial(probs[0], 1, generator=job.generator))

    def _emit(self, job: DecodeJob, token: int) -> None:
        job.ids.append(token)
        if job.streamer is not None:
            job.streamer.put(torch.tensor([token]))
        if token in self._eos or len(job.ids) >= job.max_new_tokens:
            ids = torch.tensor(job.ids, dtype=torch.long)
            text = self.lm.tokenizer.decode(ids, skip_special_tokens=True).strip()
            job.finished = time.perf_counter()
            job.row = None  # its buffers go now, not when the caller drops the job
            if job.streamer is not None:
                job.streamer.end()
            with self._wake:
                self.completed += 1
            job.future.set_result(Decoded(text, len(job.ids),
                                          finish_reason(self.lm, ids, job.max_new_tokens),
                                          job.prompt_tokens))
        else:
            job.next_ids = torch.tensor([token], dtype=torch.long)

    def _fail(self, job: DecodeJob, error: BaseException) -> None:
        if job.future.done():
            return
        job.finished = time.perf_counter()
        job.row = None
        with self._wake:
            self.failed += 1
        if job.streamer is not None:
            try:
                job.streamer.end()
            except Exception:
                log.exception("streamer end failed")
        job.future.set_exception(error)

