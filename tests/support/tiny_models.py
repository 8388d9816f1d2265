"""Tiny, randomly initialised causal LMs (Llama, Qwen2, Mistral; GQA and MHA) for fast tests.

`tiny_model(family)` returns a model using the "episodic" attention; `stock_twin(model)` a
second instance with identical weights on transformers' stock "sdpa" (or "eager") attention.
"""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from pipeline.kv.attention import register_episodic_attention

VOCAB = 128
FAMILIES = ("llama", "qwen2", "mistral", "llama-mha")

_COMMON = dict(vocab_size=VOCAB, hidden_size=96, intermediate_size=128, num_hidden_layers=3,
               num_attention_heads=6, num_key_value_heads=2, head_dim=16,
               max_position_embeddings=1024, pad_token_id=0, bos_token_id=1, eos_token_id=2)


def tiny_config(family: str, **overrides):
    kw = dict(_COMMON, **overrides)
    if family == "llama":
        return LlamaForCausalLM, LlamaConfig(**kw)
    if family == "llama-mha":  # multi-head attention: as many KV heads as query heads
        return LlamaForCausalLM, LlamaConfig(**(kw | {"num_key_value_heads": 6}))
    if family == "qwen2":
        return Qwen2ForCausalLM, Qwen2Config(**kw)
    if family == "mistral":
        return MistralForCausalLM, MistralConfig(**({"sliding_window": None} | kw))
    raise ValueError(family)


def tiny_model(family: str = "llama", seed: int = 0, **overrides) -> torch.nn.Module:
    """A tiny random model of `family` with the episodic attention, in eval mode (float32)."""
    register_episodic_attention()
    cls, cfg = tiny_config(family, **overrides)
    torch.manual_seed(seed + FAMILIES.index(family))  # a different model per family
    model = cls(cfg).eval()
    with torch.no_grad():  # larger-than-default weights: sharper attention, easier to tell apart
        for name, p in model.named_parameters():
            if "proj" in name:  # weights, and Qwen2's q/k/v biases
                p.normal_(0.0, 0.08)
    model.set_attn_implementation("episodic")
    return model


def stock_twin(model: torch.nn.Module, implementation: str = "sdpa") -> torch.nn.Module:
    """An identical copy of `model` on a stock transformers attention implementation."""
    twin = copy.deepcopy(model)
    twin.set_attn_implementation(implementation)
    return twin.eval()


def random_ids(n: int, seed: int = 1) -> torch.Tensor:
    """[n] random token ids avoiding the special ids 0-2."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (n,), generator=g)


class CharTokenizer:
    """A character-level tokenizer over the tiny models' vocabulary (ids 3..VOCAB-1)."""
    pad_token_id, bos_token_id, eos_token_id = 0, 1, 2
    bos_token, chat_template = "", None

    def __call__(self, text: str, add_special_tokens: bool = False) -> dict:
        return {"input_ids": [3 + ord(c) % (VOCAB - 3) for c in text]}

    def decode(self, ids, skip_special_tokens: bool = True, **_) -> str:
        ids = ids.tolist() if isinstance(ids, torch.Tensor) else list(ids)
        return "".join(chr(32 + (i - 3) % 95) for i in ids if not (skip_special_tokens and i < 3))


class StandIn:
    """What the decoding code (`pipeline.answer`, `pipeline.answer.batcher`) needs of a loaded
    model: .model, .tokenizer, and the .fingerprint of its files (`pipeline.kv.fingerprint`)."""

    def __init__(self, model, fingerprint: str = "stand-in-files"):
        self.model, self.tokenizer, self.fingerprint = model, CharTokenizer(), fingerprint


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread():
    """Tiny models run fastest on one thread (and do not stall when the CPU is shared);
    imported into a test module, this applies to that module only and is undone after it."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
