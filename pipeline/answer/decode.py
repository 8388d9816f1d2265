"""Decoding an answer from an episodic cache: only the question is prefilled, never the history
(with its top-up and the request's live tail, when it has them).

`decode_answer` returns the whole answer; the Serve decoder's batcher (`pipeline.answer.batcher`)
gives the same greedy answers, streamed in pieces that join to the same text (`AnswerPieces`).
`teacher_forced_nll` scores a given answer on the batcher's own forward: how strongly a prompt
path supports it (a test's probe that a live tail reaches the decoder; no endpoint serves it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pipeline.answer.packed import DecodeRow, packed_step
from pipeline.config.limits import DEFAULT_LIMITS, AnswerLimits, check_positions
from pipeline.kv import models, prompts
from pipeline.kv.cache import EpisodicCache


def question_prompt(lm: models.LoadedModel, cache: EpisodicCache, question: str,
                    max_new_tokens: int, limits: AnswerLimits = DEFAULT_LIMITS,
                    topup: str = "", live: str = "") -> torch.Tensor:
    """[Q] prompt ids asking `question` after `cache` (and the question's top-up text,
    `pipeline.answer.topup`, then the live tail's, `prompts.live_text`), or a `LimitError`:
    the question's tokens are over `limits`, or the cache, prompt and answer do not fit the
    model's positions. The question's characters and the sampling parameters were checked at
    the entry that took them (`AnswerLimits.checked`), the live tail's tokens too (the router,
    `Answerer.answer_checked`): they are tokenised as given."""
    limits.check_question_tokens(prompts.count_tokens(lm.tokenizer, question))
    ids = prompts.question_ids(lm.tokenizer, question, topup, live)
    check_positions(cache.next_position, len(ids), max_new_tokens,
                    getattr(lm.model.config, "max_position_embeddings", None))
    return ids


@torch.inference_mode()
def generate_from_cache(lm: models.LoadedModel, cache: EpisodicCache, question_ids: torch.Tensor,
                        max_new_tokens: int = 32, temperature: float = 0.0) -> torch.Tensor:
    """Generated token ids after `question_ids`, decoding from `cache` (left unchanged)."""
    tokenizer = lm.tokenizer
    # generate() expects ids for the cached history too; it only feeds the uncached tail.
    filler = torch.full((cache.next_position,), tokenizer.pad_token_id or 0, dtype=torch.long)
    input_ids = torch.cat([filler, question_ids])[None].to(lm.model.device)
    sampling = {"do_sample": True, "temperature": temperature} if temperature > 0 else \
        {"do_sample": False, "temperature": None, "top_p": None, "top_k": None}
    with cache.scratch():
        out = lm.model.generate(input_ids, past_key_values=cache, max_new_tokens=max_new_tokens,
                                pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id,
                                **sampling)
    return out[0, input_ids.shape[1]:]


@dataclass
class Decoded:
    text: str
    tokens: int
    finish_reason: str  # "stop" (end of sequence) or "length" (max_new_tokens reached)
    # the tokens prefilled after the cache: top-up, live tail, instruction and question
    prompt_tokens: int = 0


def finish_reason(lm: models.LoadedModel, ids: torch.Tensor, max_new_tokens: int) -> str:
    """"stop" if the answer ended with an end-of-sequence token (or early), else "length"."""
    eos = lm.model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, (list, tuple)) else [eos]) - {None}
    if len(ids) >= max_new_tokens and not (len(ids) and int(ids[-1]) in eos):
        return "length"
    return "stop"


def decode_answer(lm: models.LoadedModel, cache: EpisodicCache, question: str,
                  max_new_tokens: int = 32, temperature: float = 0.0,
                  limits: AnswerLimits = DEFAULT_LIMITS, topup: str = "",
                  live: str = "") -> Decoded:
    """The answer text to `question` from `cache` (the cache is left as it was), the
    question's top-up text and the live tail's. The question and the sampling parameters are
    taken as checked at the entry (`Answerer.answer`, `AnswerLimits.checked`); its tokens and
    the model's positions are held to `limits` here (`question_prompt`), before anything is
    decoded."""
    prompt = question_prompt(lm, cache, question, max_new_tokens, limits, topup, live)
    ids = generate_from_cache(lm, cache, prompt, max_new_tokens, temperature)
    text = lm.tokenizer.decode(ids, skip_special_tokens=True).strip()
    return Decoded(text, int(len(ids)), finish_reason(lm, ids, max_new_tokens), len(prompt))


@torch.inference_mode()
def teacher_forced_nll(lm: models.LoadedModel, cache: EpisodicCache, prompt: torch.Tensor,
                       answer: str) -> float:
    """The mean NLL (nats a token) of `answer`'s tokens, each fed after `prompt` over `cache`
    as the batcher decodes (`DecodeRow`, `packed_step`: the prompt prefilled, then one token a
    step): the same forward as a served answer, so a lower NLL is a prompt the decoder reads
    the answer from (tokenised on its own: it follows the assistant's opening). The cache is
    left as it was."""
    target = prompts.encode(lm.tokenizer, answer.strip())
    if not len(target):
        raise ValueError("the answer has no tokens")
    row = DecodeRow(cache, len(prompt) + len(target))
    fed, total = prompt, 0.0
    for token in target:
        logits = packed_step(lm.model, [row], [fed])[0]
        total -= float(torch.log_softmax(logits, dim=-1)[token])
        fed = token[None]
    return total / len(target)


class AnswerPieces:
    """Turns a streamer's text into the pieces of an answer that join to `decode_answer`'s
    stripped text: leading whitespace dropped, trailing whitespace held back until more text
    follows it."""

    def __init__(self) -> None:
        self.pending, self.started = "", False

    def feed(self, text: str) -> str:
        """The next piece to send ("" for none yet)."""
        if not self.started:
            text = text.lstrip()
        text = self.pending + text
        body = text.rstrip()
        if body:
            self.started = True
        self.pending = text[len(body):]
        return body
