"""How the cached history and a question are laid out for the model's chat template.

The conversation sits inside the user message: the cache holds the chat template's opening
(system prompt, user turn start) followed by the rendered conversation; a question later
appends the instruction, the question, the end of the user turn and the assistant opening.
This works with any chat template (and with none).

Between the two, a question may read a top-up (more turns of the conversation, rendered as the
conversation is: `topup_ids`) and then a **live tail**: the messages of the session a chat
client is in, which no cache holds (`live_text`). The live tail is rendered by the chat
template as the turns it is: the user turn that holds the history is closed, the live messages
follow as their own turns, and a new user turn opens for the instruction and the question.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)

QA_INSTRUCTION = ("Based on the above conversation, write an answer in the form of a short phrase "
                  "for the following question. Answer with exact words from the conversation "
                  "whenever possible.")
_MARKER = "\u2063EPISODIC-CONTEXT\u2063"
_LIVE_OPEN, _LIVE_CLOSE = "\u2063LIVE-OPEN\u2063", "\u2063LIVE-CLOSE\u2063"
# the roles a live tail's messages may have (OpenAI's "developer" is read as "system")
LIVE_ROLES = ("system", "user", "assistant")


@dataclass(frozen=True)
class PromptFormat:
    prefix: str  # before the conversation
    suffix: str  # after the question: closes the user turn, opens the assistant's


def prompt_format(tokenizer) -> PromptFormat:
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template([{"role": "user", "content": _MARKER}],
                                             tokenize=False, add_generation_prompt=True)
        prefix, suffix = text.split(_MARKER)
        return PromptFormat(prefix, suffix)
    bos = tokenizer.bos_token or ""
    return PromptFormat(bos, "\nShort answer:")


def encode(tokenizer, text: str) -> torch.Tensor:
    """[N] token ids of `text`, no special tokens added."""
    return torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"], dtype=torch.long)


def count_tokens(tokenizer, text: str) -> int:
    """The tokens of `text` as a prompt continues with it (no special tokens): the one count of
    a question (its limit) and of a top-up (its budget), wherever they are counted."""
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


def context_ids(tokenizer, conversation_text: str) -> torch.Tensor:
    """[N] token ids of what the cache holds: the template's opening and the conversation."""
    return encode(tokenizer, prompt_format(tokenizer).prefix + conversation_text)


def patch_ids(tokenizer, patch_text: str) -> torch.Tensor:
    """[P] token ids of a patched prompt (it continues the conversation text)."""
    return encode(tokenizer, "\n" + patch_text)


def question_prefix_ids(tokenizer) -> torch.Tensor:
    """[P] token ids every question's prompt starts with (the instruction), as far as they
    tokenise the same on their own: a decoder computes their cache entries once per cache."""
    return encode(tokenizer, f"\n\n{QA_INSTRUCTION}\n\nQuestion:")


def topup_ids(tokenizer, topup: str) -> torch.Tensor:
    """[T] token ids of a question-time top-up's text (`pipeline.answer.topup`: more turns of
    the conversation), read after the cached history and before the question; tokenised on
    their own, so the evaluation may prefill them apart from the question's ids."""
    return encode(tokenizer, topup)


@dataclass(frozen=True)
class ChatTurn:
    """A message of a live tail: the session a chat client is in, since the last build."""
    role: str  # one of LIVE_ROLES
    content: str


def live_chars(live: Sequence[ChatTurn]) -> int:
    """What a live tail's character bound counts: its messages' roles and text (a role counts,
    so that a flood of empty messages is bounded before a template renders them)."""
    return sum(len(t.role) + len(t.content) for t in live)


def live_text(tokenizer, live: Sequence[ChatTurn]) -> str:
    """The live tail's text, read after the cached history (and the top-up), before the
    instruction: the open user turn closed, the messages as the chat template renders them,
    a new user turn opened; it ends where the instruction begins ("" for no messages).

    A template that refuses these turns (one that takes only alternating user and assistant
    turns, or no system turn), or a tokenizer without one, gets the messages as
    "role: content" lines inside the user turn instead."""
    if not live:
        return ""
    messages = [{"role": t.role, "content": t.content} for t in live]
    if getattr(tokenizer, "chat_template", None):
        try:
            text = tokenizer.apply_chat_template(
                [{"role": "user", "content": _LIVE_OPEN}, *messages,
                 {"role": "user", "content": _LIVE_CLOSE}],
                tokenize=False, add_generation_prompt=True)
        except Exception as e:  # noqa: BLE001 - jinja's TemplateError, or what a template raises
            log.debug("the chat template refused a live tail (%s): read as lines", e)
            text = ""
        _, opened, rest = text.partition(_LIVE_OPEN)
        between, closed, after = rest.partition(_LIVE_CLOSE)
        if opened and closed and after == prompt_format(tokenizer).suffix:
            return between
    lines = "\n".join(f"{t.role}: {t.content}" for t in live)
    return f"\n\n{lines}\n\n"


def live_ids(tokenizer, live: str) -> torch.Tensor:
    """[L] token ids of a live tail's text (`live_text`), tokenised on their own, as the
    top-up's are: its count is the live tail's tokens, wherever it is counted."""
    return encode(tokenizer, live)


def question_ids(tokenizer, question: str, topup: str = "", live: str = "") -> torch.Tensor:
    """[Q] token ids appended after the cached history to ask `question`, after the
    question's top-up (`topup_ids`) and the live tail (`live_text`: the instruction then opens
    the new user turn it ends with) when it has them."""
    fmt = prompt_format(tokenizer)
    opening = "" if live else "\n\n"
    asked = encode(tokenizer, f"{opening}{QA_INSTRUCTION}\n\nQuestion: {question}{fmt.suffix}")
    parts = [topup_ids(tokenizer, topup)] if topup else []
    parts += [live_ids(tokenizer, live)] if live else []
    return torch.cat([*parts, asked]) if parts else asked
