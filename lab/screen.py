"""A fast proxy for ranking EpiCache recipes: one full prefill, then each recipe's selection.

The cache is prefilled once with the full history, then for every episode the patch's attention
to it is scored once and each recipe (the evaluation's presets and overrides,
`pipeline.eval.methods`) keeps its top entries per layer in one step, with the build's own
pieces: its clustering, its episode scorer and its top-k eviction (`pipeline.builder`,
`pipeline.kv.eviction`). Block
prefill decides block by block with an already evicted history, so figures here are higher than
the evaluation's; they rank selection strategies in minutes instead of hours. Each question
reads its router's best episode (the evaluation may read the best two).
"""

from __future__ import annotations

import copy
import sys

import numpy as np
import torch

from pipeline.builder.cluster import cluster_conversation
from pipeline.builder.episode import episode_scorer
from pipeline.builder.profile import allocator
from pipeline.corpus.render import render_conversation, render_header
from pipeline.episodes import embed_texts
from pipeline.eval.cell import prepare, probe_pairs
from pipeline.eval.metrics import continuation_nlls
from pipeline.kv import prompts
from pipeline.kv.eviction import TokenEviction
from pipeline.kv.layout import kept_share, token_layout
from pipeline.kv.methods.full import Full
from pipeline.kv.prefill import PrefillConfig, block_prefill, layer_state
from pipeline.routers import ranked, router


def recall_nlls(lm, conv, questions, cache, config) -> list[float]:
    """Per question, the mean evidence-recall NLL read from `cache` (packed probes)."""
    probes = [probe_pairs(lm, conv, q, config) for q in questions]
    nlls = iter(continuation_nlls(lm.model, cache, [p for pairs, turns in probes
                                                     for p in pairs[:len(turns)]]))
    return [float(np.mean([next(nlls) for _ in turns])) for _, turns in probes]


@torch.inference_mode()
def patch_states(lm, cache, scorer):
    """Every layer's state with the patch's attention to the whole cache (cache unchanged)."""
    patch = scorer.patch_ids(None)
    seen = cache.next_position
    with cache.scratch(), cache.patched(patch.shape[0]):
        lm.model.base_model(input_ids=patch[None], past_key_values=cache, use_cache=True,
                            position_ids=torch.arange(seen, seen + patch.shape[0])[None])
    states = [layer_state(i, layer, 0) for i, layer in enumerate(cache.layers)]
    for layer in cache.layers:
        layer.last_request = None
    return states


def screen_conversation(lm, encoder, conv, methods, budgets, config, profile) -> list[dict]:
    prep = prepare(conv, config)
    conv, questions = prep.conversation, list(prep.questions)
    layout = token_layout(lm.tokenizer, conv)
    ids = prompts.context_ids(lm.tokenizer, render_conversation(conv).text)
    full, _ = block_prefill(lm.model, ids, Full(), None, PrefillConfig(block=1024))
    none, _ = block_prefill(lm.model, prompts.context_ids(lm.tokenizer, render_header(conv)),
                            Full(), None, PrefillConfig())
    refs = {"full": recall_nlls(lm, conv, questions, full, config),
            "none": recall_nlls(lm, conv, questions, none, config)}
    embeddings = embed_texts(encoder, [q.question for q in questions])
    records = []
    for method in methods:
        clustered = cluster_conversation(conv, config.build_config(method, budgets[0]))
        episodes, index = clustered.episodes.episodes, clustered.episodes.route_index()
        chooses = router(config.route_of(method)[0])
        routes = [ranked(chooses.scores(e, index))[0] for e in embeddings]
        for budget in budgets:
            build = config.build_config(method, budget)
            layer_budgets = [budget] * lm.config.num_hidden_layers
            if build.alpha > 0:
                layer_budgets = allocator(build).allocate(profile(), budget)
            for ep in episodes:
                readers = [i for i, r in enumerate(routes) if r == ep.index]
                if not readers:
                    continue
                members = clustered.members[ep.index]
                scorer = episode_scorer(lm.tokenizer, conv, ep.patch_text,
                                        members, build)
                cache = copy.deepcopy(full)
                states = patch_states(lm, full, scorer)
                TokenEviction(layer_budgets, build.prefill.selection,
                              build.prefill.head_floor).step(cache.layers, states, scorer, True)
                nlls = recall_nlls(lm, conv, [questions[i] for i in readers], cache, config)
                for i, nll in zip(readers, nlls):
                    q = questions[i]
                    records.append({
                        "conversation_id": conv.conversation_id, "method": method,
                        "budget": budget, "question_index": i, "evidence_nll": nll,
                        "full": refs["full"][i], "none": refs["none"][i],
                        "route_hit": bool(set(members) & set(q.evidence)),
                        "evidence_kept": float(np.mean([kept_share(cache, *layout.span_of(t))
                                                        for t in q.evidence]))})
        print(f"  {conv.conversation_id} {method} done", file=sys.stderr, flush=True)
    return records


def table(records: list[dict]) -> str:
    lines = ["| method | budget | questions | retention (of means) | on route hits | evidence kept "
             "| route hit |", "|---|---|---|---|---|---|---|"]
    keys = dict.fromkeys((r["method"], r["budget"]) for r in records)
    for method, budget in keys:
        g = [r for r in records if r["method"] == method and r["budget"] == budget]
        hits = [r for r in g if r["route_hit"]]

        def rom(rows):
            none, full = np.mean([r["none"] for r in rows]), np.mean([r["full"] for r in rows])
            return ((none - np.mean([r["evidence_nll"] for r in rows])) / (none - full)
                    if rows else np.nan)

        lines.append(f"| {method} | {budget} | {len(g)} | {100 * rom(g):.1f}% "
                     f"| {100 * rom(hits):.1f}% "
                     f"| {100 * np.mean([r['evidence_kept'] for r in g]):.1f}% "
                     f"| {100 * np.mean([r['route_hit'] for r in g]):.0f}% |")
    return "\n".join(lines)
