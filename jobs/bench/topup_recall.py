"""The top-up's cheap check: how much of the evidence a routed question lacks each candidate
would bring back, before anything is decoded.

    python -m jobs.bench.topup_recall --corpus ../shared/data/locomo --conversations 26,30,41 \\
        [--max-context-tokens 7600] [--questions-per-conversation 40] [--tokens 256] [--page 16]

Each conversation is cut and clustered as `jobs.build` does, and each question routed as the
Serve endpoint routes it (`RoutingConfig`). The evidence turns the episodes read do not hold
are what a top-up must bring. Two candidates get the same number of tokens (`--tokens`):

- **text**: the question's nearest turns in the turn index (`pipeline.answer.topup`, the
  encoder's space), those the episodes lack, prefilled at question time: an evidence turn is
  recalled whole or not at all;
- **kv pages**: the history's entries the episodes lack, in pages of `--page` tokens with
  Quest's per-channel key min/max as digests, the top pages per layer and KV head chosen by the
  question's queries (its prompt's prefill over the full cache: an optimistic stand-in for its
  prefill over the routed one). Recall is the share of an evidence turn's tokens in the chosen
  pages, averaged over layers and heads.

Reported per routing outcome (hits: the episodes hold some evidence; misses: none): the
questions, the evidence turns they lack, and each candidate's recall of them.
"""

from __future__ import annotations

import argparse
import functools
import statistics

import numpy as np
import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from lab.bench_cli import bench_conversations, bench_parser, start_bench
from lab.tables import print_table
from pipeline.answer.topup import held_turns, select_topup
from pipeline.builder.cluster import cluster_conversation
from pipeline.builder.turns import index_turns
from pipeline.cli.numbers import positive_int
from pipeline.cli.options import add_threads_option
from pipeline.config import BuildConfig, RoutingConfig, TopUpConfig
from pipeline.eval.cell import history_ids, prepare
from pipeline.eval.methods import EvalConfig
from pipeline.eval.reads import question_embeddings, route_scores
from pipeline.eval.window import CUT_TOKENS
from pipeline.kv import models, prompts
from pipeline.kv.cache import EpisodicCache
from pipeline.kv.layout import token_layout
from pipeline.kv.methods.full import Full
from pipeline.kv.prefill import block_prefill
from pipeline.routers import chosen


def page_digests(keys: torch.Tensor, page: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Quest's digests of [Hkv, T, d] keys in pages of `page` tokens: per page and channel the
    min and the max, [Hkv, pages, d] each (the last page padded with its own last key)."""
    heads, tokens, dim = keys.shape
    pad = (-tokens) % page
    if pad:
        keys = torch.cat([keys, keys[:, -1:].expand(heads, pad, dim)], dim=1)
    paged = keys.view(heads, -1, page, dim)
    return paged.amin(dim=2), paged.amax(dim=2)


def page_scores(queries: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor) -> torch.Tensor:
    """[Hkv, pages]: Quest's upper bound of q.k over each page, max over the query heads of the
    KV head's group and the question's tokens. `queries` [Hq, Q, d]."""
    heads = kmin.shape[0]
    q = queries.reshape(heads, -1, queries.shape[-1])  # [Hkv, group * Q, d]
    bound = torch.maximum(q[:, :, None, :] * kmin[:, None], q[:, :, None, :] * kmax[:, None])
    return bound.sum(-1).amax(dim=1)


@torch.inference_mode()
def question_queries(lm: models.LoadedModel, cache: EpisodicCache,
                     ids: torch.Tensor) -> list[torch.Tensor]:
    """Per layer, the question prompt's rotated queries [Hq, Q, d] over `cache` (a Llama-style
    model: SmolLM2)."""
    model = lm.model
    positions = torch.arange(cache.next_position, cache.next_position + len(ids))[None]
    with cache.scratch():
        out = model(input_ids=ids[None], past_key_values=cache, use_cache=True,
                    position_ids=positions, output_hidden_states=True)
    cos, sin = model.model.rotary_emb(out.hidden_states[0], positions)
    queries = []
    for layer, hidden in zip(model.model.layers, out.hidden_states):
        attn = layer.self_attn
        q = attn.q_proj(layer.input_layernorm(hidden))
        q = q.view(1, len(ids), -1, attn.head_dim).transpose(1, 2)
        queries.append(apply_rotary_pos_emb(q, q, cos, sin)[0][0].float())
    return queries


def kv_recall(queries: list[torch.Tensor], cache: EpisodicCache, lacking: torch.Tensor,
              spans: list[tuple[int, int]], tokens: int, page: int) -> float:
    """The mean share of the `spans`' tokens in the top pages (of the tokens `lacking` marks)."""
    n = int(lacking.numel())
    covered = []
    for q, layer in zip(queries, cache.layers):
        keys = layer.keys[0, :, :n].float()  # the full cache: every head holds every token
        kmin, kmax = page_digests(keys, page)
        scores = page_scores(q, kmin, kmax)
        eligible = page_digests(lacking[None, :, None].float(), page)[1][0, :, 0] > 0
        scores[:, ~eligible] = -torch.inf
        top = scores.topk(min(tokens // page, int(eligible.sum())), dim=1).indices
        for head in range(scores.shape[0]):
            chosen_tokens = torch.zeros(n + (-n) % page, dtype=torch.bool)
            chosen_tokens.view(-1, page)[top[head]] = True
            chosen_tokens = chosen_tokens[:n] & lacking
            covered += [float(chosen_tokens[s:e].float().mean()) for s, e in spans]
    return float(np.mean(covered)) if covered else float("nan")


def build_parser() -> argparse.ArgumentParser:
    p = bench_parser("topup_recall", __doc__, conversations="26,30,41")
    p.add_argument("--max-context-tokens", type=positive_int, default=CUT_TOKENS,
                   help="each conversation cut at a session boundary to this many tokens")
    p.add_argument("--questions-per-conversation", type=positive_int, default=40,
                   help="the first questions with evidence inside the cut")
    p.add_argument("--tokens", type=positive_int, default=TopUpConfig.max_tokens,
                   help="each candidate's tokens (per layer and KV head for the pages)")
    p.add_argument("--turns", type=positive_int, default=TopUpConfig.turns,
                   help="the text top-up's nearest turns searched")
    p.add_argument("--page", type=positive_int, default=16, help="tokens per KV page")
    p.add_argument("--queries", choices=("all", "last"), default="all",
                   help="the question prompt's queries that score the pages: all its tokens', or "
                        "the last one's (the first answer token's, as Quest scores at decode)")
    add_threads_option(p)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    a = start_bench(parser, argv)
    config = EvalConfig(BuildConfig(max_context_tokens=a.max_context_tokens),
                        questions_per_conversation=a.questions_per_conversation)
    topup = TopUpConfig(enabled=True, turns=a.turns, max_tokens=a.tokens)
    routing = RoutingConfig()
    lm, encoder = models.load_llm(config.model), models.load_encoder(config.encoder)
    count_tokens = functools.partial(prompts.count_tokens, lm.tokenizer)
    full_prefill = config.build_config("full", None).prefill
    rows: dict[str, list[dict]] = {"hit": [], "miss": []}
    for conv in bench_conversations(parser, a):
        prep = prepare(conv, config)
        questions = list(prep.questions)
        clustered = cluster_conversation(prep.conversation, config.build_config("epicache", 1024))
        embeddings = question_embeddings(encoder, questions)
        scores = route_scores(embeddings, clustered.episodes)[routing.router]
        index = index_turns(prep.conversation, encoder, config.encoder, "")
        layout = token_layout(lm.tokenizer, prep.conversation)
        cache, _ = block_prefill(lm.model, history_ids(lm.tokenizer, prep.conversation), Full(),
                                 None, full_prefill)
        for q, row, embedding in zip(questions, scores, embeddings):
            held = held_turns(clustered.members[k] for k in chosen(row, routing.two_below))
            lacking = [t for t in q.evidence if t not in held]
            outcome = "miss" if len(lacking) == len(q.evidence) else "hit"
            text = select_topup(index, embedding, held, topup, count_tokens)
            record = {"lacking": len(lacking), "text_tokens": text.tokens}
            if lacking:
                record["text"] = float(np.mean([t in text.turn_ids for t in lacking]))
                prompt = prompts.question_ids(lm.tokenizer, q.question)
                queries = question_queries(lm, cache, prompt)
                if a.queries == "last":
                    queries = [layer_queries[:, -1:] for layer_queries in queries]
                not_held = ~layout.turn_mask(held)
                record["kv"] = kv_recall(queries, cache, not_held,
                                         [layout.span_of(t) for t in lacking], a.tokens, a.page)
            rows[outcome].append(record)
        print(f"{conv.conversation_id}: {len(questions)} questions", flush=True)
    table = []
    for outcome, records in rows.items():
        lacking = [r for r in records if r["lacking"]]
        table.append({"routing": outcome, "questions": len(records),
                      "lacking": sum(r["lacking"] for r in records),
                      **{c: statistics.mean(r[c] for r in lacking) if lacking else float("nan")
                         for c in ("text", "kv")},
                      "text_tokens": statistics.mean(r["text_tokens"] for r in records)})
    print(f"\nevidence the episodes read lack, recalled by each candidate ({a.tokens} tokens; "
          f"kv: pages of {a.page}):")
    print_table(table, [("routing", "routing", "s"), ("questions", "questions", "d"),
                        ("lacking", "evidence turns lacking", "d"),
                        ("text", "text top-up recall", ".1%"), ("kv", "kv pages recall", ".1%"),
                        ("text_tokens", "text top-up tokens (mean)", ".0f")])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
