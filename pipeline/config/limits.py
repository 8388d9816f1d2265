"""The limits on one answer, one object shared by `jobs.answer`, the library's `Answerer` and
the server, so that a request is refused alike wherever it comes from.

They are checked once, at the entry that takes the request: `jobs.answer`'s arguments, the
server's request body, `Answerer.answer` (the library's entry). The entry hands on a
`CheckedQuestion`, and the layers under it (the plan, the decode, the Serve decoder) trust it;
only what needs the tokenizer or the cache is checked where they are, once: the question's
tokens and the model's positions (`pipeline.answer.decode.question_prompt`).

A question is bounded in tokens, but counting tokens means tokenising, and tokenising unbounded
text costs unbounded time and memory (a 100,000-character question once grew a process to
23.6 GB). So a question is first held to a character bound derived from the token limit
(`CHARS_PER_TOKEN` per token, about twice what prose takes), untouched by any tokenizer; only
then are its tokens counted (`pipeline.answer.decode.question_prompt`). With the answer length
and the model's positions bounded too, the memory of one request is bounded (docs/serving.md,
"Limits"). Nothing here imports torch: a command checks its arguments before loading a model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

CHARS_PER_TOKEN = 8  # English prose takes about 4 characters a token


class LimitError(ValueError):
    """A request over a limit, or with a parameter out of its range (422 over HTTP)."""


@dataclass(frozen=True)
class CheckedQuestion:
    """A question and its sampling parameters, held to the limits at the entry that took them
    (`AnswerLimits.checked`): the layers under it take them as checked."""
    text: str
    max_new_tokens: int
    temperature: float


@dataclass(frozen=True)
class AnswerLimits:
    """The largest question (tokens), the largest answer (new tokens), the temperatures
    accepted and the largest live tail (tokens: the messages of a chat client's session read
    before the question, `pipeline.kv.prompts.live_text`); `max_question_chars` and
    `max_live_chars` follow from the token limits."""
    max_question_tokens: int = 512
    max_new_tokens: int = 512
    max_temperature: float = 2.0
    max_live_tokens: int = 2048

    def __post_init__(self) -> None:
        for name in ("max_question_tokens", "max_new_tokens", "max_live_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if not (math.isfinite(self.max_temperature) and self.max_temperature >= 0):
            raise ValueError(f"max_temperature must be finite and >= 0, got {self.max_temperature}")

    @property
    def max_question_chars(self) -> int:
        """The character bound checked before a question is tokenised."""
        return self.max_question_tokens * CHARS_PER_TOKEN

    def check_question(self, question: object) -> str:
        """The question, if it is non-blank text within the character bound (no tokenizer)."""
        if not isinstance(question, str) or not question.strip():
            raise LimitError("the question is empty")
        if len(question) > self.max_question_chars:
            raise LimitError(f"the question is {len(question):,} characters long; the limit is "
                             f"{self.max_question_chars:,} characters "
                             f"({self.max_question_tokens} tokens)")
        if not question.isascii():
            try:  # a lone surrogate (JSON's "\ud800") is text no tokenizer can take
                question.encode("utf-8")
            except UnicodeEncodeError:
                raise LimitError("the question is not valid Unicode text (a lone surrogate)") \
                    from None
        return question

    def check_question_tokens(self, tokens: int) -> None:
        """The exact bound, once the (character-bounded) question is tokenised."""
        if tokens > self.max_question_tokens:
            raise LimitError(f"the question is {tokens} tokens long; the limit is "
                             f"{self.max_question_tokens} tokens")

    @property
    def max_live_chars(self) -> int:
        """The character bound on a live tail, checked before it is rendered and tokenised."""
        return self.max_live_tokens * CHARS_PER_TOKEN

    def check_live_chars(self, chars: int, name: str = "the live tail") -> None:
        """A live tail's characters (its messages' roles and text, summed:
        `pipeline.kv.prompts.live_chars`) within their bound, before any template renders them
        or any tokenizer sees them; `name` is what the caller calls it (a field)."""
        if chars > self.max_live_chars:
            raise LimitError(f"{name}: the live tail is {chars:,} characters long; the limit is "
                             f"{self.max_live_chars:,} characters ({self.max_live_tokens} "
                             f"tokens)")

    def check_live_tokens(self, tokens: int, name: str = "the live tail") -> None:
        """The exact bound on a live tail, once it is rendered and tokenised."""
        if tokens > self.max_live_tokens:
            raise LimitError(f"{name}: the live tail is {tokens} tokens long; the limit is "
                             f"{self.max_live_tokens} tokens")

    def check_sampling(self, max_new_tokens: object, temperature: object,
                       names: tuple[str, str] = ("max_new_tokens", "temperature"),
                       ) -> tuple[int, float]:
        """(max_new_tokens, temperature) if both are in range; `names` are what the caller
        calls them (a field, an option) in the message."""
        new_name, temperature_name = names
        if (isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int)
                or not 1 <= max_new_tokens <= self.max_new_tokens):
            raise LimitError(f"{new_name} must be an integer from 1 to {self.max_new_tokens}, "
                             f"got {max_new_tokens!r}")
        value = temperature if isinstance(temperature, (int, float)) else math.nan
        if isinstance(temperature, bool) or not 0.0 <= value <= self.max_temperature:  # nan too
            raise LimitError(f"{temperature_name} must be a number from 0 (greedy) to "
                             f"{self.max_temperature:g}, got {temperature!r}")
        return max_new_tokens, float(value)

    def checked(self, question: object, max_new_tokens: object, temperature: object,
                names: tuple[str, str] = ("max_new_tokens", "temperature")) -> CheckedQuestion:
        """The question and its sampling parameters, if within the limits (`check_question`,
        `check_sampling`; no tokenizer): what an entry hands on to the layers under it."""
        max_new, temp = self.check_sampling(max_new_tokens, temperature, names)
        return CheckedQuestion(self.check_question(question), max_new, temp)


DEFAULT_LIMITS = AnswerLimits()


def check_positions(cache_positions: int, prompt_tokens: int, max_new_tokens: int,
                    max_positions: int | None) -> None:
    """The cached history, the prompt and the answer must fit the positions the model was
    trained on (`max_position_embeddings`; None: no bound known)."""
    needed = cache_positions + prompt_tokens + max_new_tokens
    if max_positions is not None and needed > max_positions:
        raise LimitError(f"the answer needs {needed} positions ({cache_positions} cached, "
                         f"{prompt_tokens} of prompt, {max_new_tokens} new tokens); the model "
                         f"has {max_positions}")
