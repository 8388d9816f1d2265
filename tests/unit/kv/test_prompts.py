"""The live tail's layout (`pipeline.kv.prompts.live_text`, `question_ids`): after the cached
history and the top-up, the user turn holding the history is closed, the live messages follow
as the chat template renders them, and a new user turn opens for the instruction and the
question; a template that refuses those turns, or none, reads them as lines."""

from __future__ import annotations

import pytest

from pipeline.kv import prompts
from pipeline.kv.prompts import ChatTurn
from tests.support.tiny_models import CharTokenizer


class ChatMLTokenizer(CharTokenizer):
    """A character tokenizer with a ChatML chat template (SmolLM2's and Qwen2's layout, a
    default system prompt when the first message is not one); `alternating` refuses anything
    but user / assistant turns in turn, as Mistral's template does."""
    chat_template = "chatml"

    def __init__(self, alternating: bool = False):
        self.alternating = alternating

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=False) -> str:
        if self.alternating:
            for i, m in enumerate(messages):
                if m["role"] != ("user", "assistant")[i % 2]:
                    raise ValueError("Conversation roles must alternate user/assistant/...")
        text = "" if messages[0]["role"] == "system" else "<s>system\nDefault<e>\n"
        text += "".join(f"<s>{m['role']}\n{m['content']}<e>\n" for m in messages)
        return text + ("<s>assistant\n" if add_generation_prompt else "")


def _ids(tok, text: str) -> list[int]:
    return tok(text)["input_ids"]


LIVE = [ChatTurn("system", "Be brief."), ChatTurn("user", "My parrot is Zephyrino."),
        ChatTurn("assistant", "A fine name!")]


def test_a_live_tail_closes_the_history_turn_and_opens_the_questions():
    tok = ChatMLTokenizer()
    fmt = prompts.prompt_format(tok)
    assert fmt.prefix == "<s>system\nDefault<e>\n<s>user\n" and fmt.suffix == "<e>\n<s>assistant\n"
    live = prompts.live_text(tok, LIVE)
    assert live == ("<e>\n<s>system\nBe brief.<e>\n<s>user\nMy parrot is Zephyrino.<e>\n"
                    "<s>assistant\nA fine name!<e>\n<s>user\n")
    asked = prompts.question_ids(tok, "Who?", "\nAnna: hi", live).tolist()
    assert asked == _ids(tok, "\nAnna: hi" + live + prompts.QA_INSTRUCTION + "\n\nQuestion: Who?"
                         + fmt.suffix)
    assert len(prompts.live_ids(tok, live)) == len(live)  # one token a character


def test_no_live_tail_leaves_the_prompt_as_it_was():
    tok = ChatMLTokenizer()
    assert prompts.live_text(tok, []) == ""
    assert prompts.question_ids(tok, "Who?", "", "").tolist() == \
        prompts.question_ids(tok, "Who?").tolist()
    assert prompts.question_ids(tok, "Who?").tolist() == _ids(
        tok, "\n\n" + prompts.QA_INSTRUCTION + "\n\nQuestion: Who?" + "<e>\n<s>assistant\n")


def test_a_template_that_refuses_the_turns_or_none_reads_them_as_lines():
    lines = "\n\nsystem: Be brief.\nuser: My parrot is Zephyrino.\nassistant: A fine name!\n\n"
    for tok in (ChatMLTokenizer(alternating=True), CharTokenizer()):
        live = prompts.live_text(tok, LIVE)
        assert live == lines
        asked = prompts.question_ids(tok, "Who?", "", live).tolist()
        assert asked[:len(lines) + len(prompts.QA_INSTRUCTION)] == _ids(
            tok, lines + prompts.QA_INSTRUCTION)


def test_the_character_bound_counts_roles_so_empty_messages_are_bounded_too():
    from pipeline.config.limits import AnswerLimits, LimitError

    limits = AnswerLimits(max_live_tokens=4)  # 32 characters
    assert prompts.live_chars(LIVE[:1]) == len("system") + len("Be brief.")
    limits.check_live_chars(prompts.live_chars([ChatTurn("user", "")] * 8), "field 'live'")
    with pytest.raises(LimitError, match="^field 'live': the live tail is 36 characters long"):
        limits.check_live_chars(prompts.live_chars([ChatTurn("user", "")] * 9), "field 'live'")
