"""Tiny random models saved as local model folders, as a user's own model would be: a Llama with
a byte-level tokenizer, and a sentence-transformers encoder (a one-layer BERT, mean pooling).
Made offline in about a second; `pipeline.kv.models` loads them as any local folder."""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, pre_tokenizers
from tokenizers.models import BPE
from transformers import (
    BertConfig,
    BertModel,
    BertTokenizerFast,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
)

SPECIALS = ["<pad>", "<s>", "</s>"]
_CHARS = "abcdefghijklmnopqrstuvwxyz0123456789"


def byte_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level tokenizer (one token per byte, no merges) with pad, bos and eos."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {t: i for i, t in enumerate(SPECIALS + alphabet)}
    tok = Tokenizer(BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>",
                                   eos_token="</s>")


def save_weights(folder: Path, seed: int) -> None:
    """A tiny random Llama's weights and config into `folder` (replacing any there)."""
    tok_size = len(SPECIALS) + 256
    cfg = LlamaConfig(vocab_size=tok_size, hidden_size=32, intermediate_size=64,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=8, max_position_embeddings=8192, pad_token_id=0, bos_token_id=1,
                      eos_token_id=2, tie_word_embeddings=True)
    torch.manual_seed(seed)
    LlamaForCausalLM(cfg).eval().save_pretrained(folder)


def make_llm_folder(folder: Path, seed: int = 0) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    save_weights(folder, seed)
    byte_tokenizer().save_pretrained(folder)
    return folder


def make_encoder_folder(folder: Path, seed: int = 0) -> Path:
    """A sentence-transformers folder: a one-layer BERT over characters, mean pooled."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.models import Pooling, Transformer

    bert = folder.parent / f"{folder.name}-bert"
    bert.mkdir(parents=True, exist_ok=True)
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *_CHARS, *(f"##{c}" for c in _CHARS)]
    (bert / "vocab.txt").write_text("\n".join(vocab) + "\n")
    BertTokenizerFast(str(bert / "vocab.txt")).save_pretrained(bert)
    torch.manual_seed(seed)
    BertModel(BertConfig(vocab_size=len(vocab), hidden_size=32, num_hidden_layers=1,
                         num_attention_heads=2, intermediate_size=64)).save_pretrained(bert)
    body = Transformer(str(bert), max_seq_length=128)
    SentenceTransformer(modules=[body, Pooling(32, "mean")], device="cpu").save(str(folder))
    return folder


def make_model_folders(root: Path) -> tuple[Path, Path]:
    """A tiny LLM folder and a tiny encoder folder under `root`: a build's model and encoder."""
    return make_llm_folder(root / "llm"), make_encoder_folder(root / "encoder")
