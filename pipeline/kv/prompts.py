"""How the cached history and a question are laid out for the model's chat template.

The conversation sits inside the user message: the cache holds the chat template's opening
(system prompt, user turn start) followed by the rendered conversation; a question later
appends the instruction, the question, the end of the user turn and the assistant opening.
This works with any chat template (and with none).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

QA_INSTRUCTION = ("Based on the above conversation, write an answer in the form of a short phrase "
                  "for the following question. Answer with exact words from the conversation "
                  "whenever possible.")
_MARKER = "\u2063EPISODIC-CONTEXT\u2063"


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


def question_ids(tokenizer, question: str, topup: str = "") -> torch.Tensor:
    """[Q] token ids appended after the cached history to ask `question`, after the
    question's top-up (`topup_ids`) when it has one."""
    fmt = prompt_format(tokenizer)
    asked = encode(tokenizer, f"\n\n{QA_INSTRUCTION}\n\nQuestion: {question}{fmt.suffix}")
    return torch.cat([topup_ids(tokenizer, topup), asked]) if topup else asked
