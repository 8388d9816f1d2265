"""The quality machinery: packed probe NLLs, the new scorers and score shapers against small
hand or reference computations, the token layout, and the evaluation's diagnostics
(`route_hit`, `evidence_kept`) on a conversation whose evidence is known."""

from __future__ import annotations

import pytest
import torch

from pipeline.config import BuildConfig, ScoringConfig
from pipeline.corpus.render import render_conversation
from pipeline.corpus.schema import Conversation, Question, Turn
from pipeline.eval.cell import evaluate_cell, evidence_diagnostics, prepare
from pipeline.eval.methods import DEFAULT_METHODS, EvalConfig, parse_method, parse_override
from pipeline.eval.metrics import continuation_nll, continuation_nlls, headed_continuation_nlls
from pipeline.kv import models, prompts
from pipeline.kv.eviction import select_keep
from pipeline.kv.layout import kept_share, token_layout
from pipeline.kv.methods.base import LayerState, Scorer
from pipeline.kv.methods.full import Full
from pipeline.kv.methods.oldest import Oldest
from pipeline.kv.methods.shaping import FocusScorer, PooledScorer, ProtectedScorer, UtteranceScorer
from pipeline.kv.prefill import PrefillConfig, block_prefill
from tests.support.methods import bound_method, episodic
from tests.support.tiny_models import one_torch_thread, random_ids, tiny_model  # noqa: F401


class Fixed(Scorer):
    """Given scores, whatever the layer (the inner scorer of the shaping tests)."""
    name = "fixed"

    def __init__(self, scores: torch.Tensor):
        self.scores = scores

    def score(self, layer: LayerState) -> torch.Tensor:
        return self.scores


def _state(positions: torch.Tensor, valid: torch.Tensor | None = None) -> LayerState:
    n_heads, slots = positions.shape
    valid = torch.ones(n_heads, slots, dtype=torch.bool) if valid is None else valid
    keys = torch.zeros(n_heads, slots, 4)
    return LayerState(0, keys, keys, valid, positions, None)


# --------------------------------------------------------------------------- packed probes

def _probe_pairs(seed: int, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(random_ids(int(torch.randint(1, 9, (1,), generator=g)), seed=seed + i),
             random_ids(int(torch.randint(1, 12, (1,), generator=g)), seed=seed + 100 + i))
            for i in range(n)]


@pytest.mark.parametrize("family", ["llama", "qwen2", "llama-mha"])
@pytest.mark.parametrize("pack_tokens", [1, 20, 1024])
def test_packed_probe_nlls_equal_one_at_a_time(family, pack_tokens):
    """Several probes in one forward (block-diagonal mask, positions restarting at the cache's
    next position) give each probe's NLL as alone, over an evicted cache; the cache is left
    unchanged."""
    model = tiny_model(family)
    ids = random_ids(150, seed=3)
    cache, _ = block_prefill(model, ids, bound_method("snapkv", lambda t: ids[:4]), [40] * 3,
                             PrefillConfig(block=32))
    pairs = _probe_pairs(7, 6)
    alone = [continuation_nll(model, cache, p, t) for p, t in pairs]
    packed = continuation_nlls(model, cache, pairs, pack_tokens=pack_tokens)
    assert packed == pytest.approx(alone, rel=1e-4, abs=1e-5)
    assert cache.tokens_seen == 150 and continuation_nll(model, cache, *pairs[0]) == \
        pytest.approx(alone[0], rel=1e-6)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("pack_tokens", [1, 40, 1024])
def test_a_shared_head_reads_as_if_it_began_each_prefix(family, pack_tokens):
    """`headed_continuation_nlls`: each group's head (a question's top-up) is in the forward
    once, and every pair of the group reads the cache, the head, then itself: the NLLs of the
    head glued to each prefix, one at a time; a group without a head reads the cache alone."""
    model = tiny_model(family)
    ids = random_ids(150, seed=3)
    cache, _ = block_prefill(model, ids, bound_method("snapkv", lambda t: ids[:4]), [40] * 3,
                             PrefillConfig(block=32))
    pairs = _probe_pairs(7, 6)
    heads = [random_ids(9, seed=11), None, random_ids(5, seed=12)]
    groups = [(heads[0], pairs[:3]), (heads[1], pairs[3:5]), (heads[2], pairs[5:])]
    want = [[continuation_nll(model, cache, p if head is None else torch.cat([head, p]), t)
             for p, t in group] for head, group in groups]
    got = headed_continuation_nlls(model, cache, groups, pack_tokens=pack_tokens)
    for g, w in zip(got, want):
        assert g == pytest.approx(w, rel=1e-4, abs=1e-5)
    assert cache.tokens_seen == 150


@pytest.mark.e2e
def test_packed_probe_nlls_equal_one_at_a_time_with_smollm2():
    lm = models.load_llm(models.DEFAULT_LLM)
    text = "\n".join(f'Nadia said, "My cousin number {i} keeps {i * 3} goats near the lake."'
                     for i in range(30))
    ids = prompts.context_ids(lm.tokenizer, text)
    cache, _ = block_prefill(lm.model, ids, bound_method("snapkv", lambda t: ids[:4]),
                             [128] * lm.config.num_hidden_layers, PrefillConfig(block=128))
    encode = lambda s: prompts.encode(lm.tokenizer, s)  # noqa: E731
    pairs = [(encode('\nNadia said, "My cousin number 7'),
              encode(" keeps 21 goats near the lake.")),
             (encode("\nBob said"), encode(" that he likes green tea")),
             (prompts.question_ids(lm.tokenizer, "How many goats?"), encode("21"))]
    alone = [continuation_nll(lm.model, cache, p, t) for p, t in pairs]
    assert continuation_nlls(lm.model, cache, pairs) == pytest.approx(alone, rel=1e-3, abs=1e-4)


# --------------------------------------------------------------------------- scorers

def test_oldest_keeps_the_first_tokens():
    positions = torch.tensor([[5, 1, 9, 3]])
    scores = Oldest().score(_state(positions))
    keep = select_keep(scores, torch.ones(1, 4, dtype=torch.bool), 2, "perhead")
    assert keep.tolist() == [[False, True, False, True]]
    assert "oldest" not in DEFAULT_METHODS and parse_method("oldest").preset.scorer == "oldest"


def test_pooling_takes_the_max_of_the_neighbours_and_ignores_invalid_slots():
    scores = torch.tensor([[0.0, 0.0, 9.0, 0.0, 0.0, 0.0, 1.0]])
    valid = torch.ones(1, 7, dtype=torch.bool)
    valid[0, 6] = False  # an invalid slot's score never spreads
    got = PooledScorer(Fixed(scores), kernel=3).score(_state(torch.arange(7)[None], valid))
    assert got[0, :6].tolist() == [0.0, 9.0, 9.0, 9.0, 0.0, 0.0]


def test_utterance_scores_are_the_line_mean_per_head_with_a_token_tie_break():
    line_ids = torch.tensor([0, 0, 0, 1, 1, 2, 2, 2])
    positions = torch.tensor([[0, 1, 2, 3, 4, 5, 6, 7], [0, 2, 3, 4, 5, 7, 7, 7]])
    valid = torch.ones(2, 8, dtype=torch.bool)
    valid[1, 6:] = False  # head 1 holds fewer entries (padded)
    scores = torch.tensor([[0.3, 0.0, 0.0, 0.5, 0.5, 0.1, 0.1, 0.1],
                           [0.4, 0.2, 0.9, 0.1, 0.0, 0.6, 5.0, 5.0]])
    got = UtteranceScorer(Fixed(scores), line_ids, tie_break=0.0).score(
        _state(positions, valid))
    assert got[0].tolist() == pytest.approx([0.1, 0.1, 0.1, 0.5, 0.5, 0.1, 0.1, 0.1])
    # head 1: line 0 = positions 0, 2 -> (0.4 + 0.2) / 2; line 1 = 3, 4 -> 0.5; line 2 = 5, 7
    assert got[1, :6].tolist() == pytest.approx([0.3, 0.3, 0.5, 0.5, 0.3, 0.3])
    keep = select_keep(got, valid, 2, "perhead")  # whole lines win: line 1 in head 1
    assert keep[1].tolist() == [False, False, True, True, False, False, False, False]
    ranked = UtteranceScorer(Fixed(scores), line_ids).score(_state(positions, valid))
    assert ranked[0, 3] > ranked[0, 0] and ranked[0, 0] > ranked[0, 1]  # tie-break inside


def test_focus_weights_the_episode_turns_and_protection_keeps_sink_and_recent():
    scores = torch.tensor([[0.4, 0.3, 0.2, 0.1, 0.05, 0.01]])
    member = torch.tensor([False, False, True, True, False, False])
    focused = FocusScorer(Fixed(scores), member, weight=2.0).score(_state(torch.arange(6)[None]))
    assert focused[0].tolist() == pytest.approx([0.4, 0.3, 0.6, 0.3, 0.05, 0.01])
    protected = ProtectedScorer(Fixed(scores), sink=1, recent=2).score(
        _state(torch.arange(6)[None]))
    assert torch.isinf(protected[0, [0, 4, 5]]).all() and protected[0, 1:4].tolist() == \
        pytest.approx([0.3, 0.2, 0.1])


def test_head_floor_guarantees_each_head_its_top_entries():
    scores = torch.tensor([[9.0, 8.0, 7.0, 6.0], [0.1, 0.3, 0.2, 0.0]])
    valid = torch.ones(2, 4, dtype=torch.bool)
    assert select_keep(scores, valid, 2, "headwise")[1].sum() == 0  # head 1 starves
    keep = select_keep(scores, valid, 2, "headwise", head_floor=0.5)
    assert keep.sum() == 4 and keep[1].tolist() == [False, True, False, False]
    assert keep[0].tolist() == [True, True, True, False]


def test_episodic_scorer_composes_the_configured_shapers():
    patch = torch.arange(10)
    line_ids, member = torch.zeros(5, dtype=torch.long), torch.ones(5, dtype=torch.bool)
    plain = episodic(patch, ScoringConfig.paper())
    assert plain.name == "epicache"
    shaped = episodic(patch, ScoringConfig(pool=3, utterance=True, focus=1.0, sink=4,
                                                  patch_tokens=6), line_ids, member)
    layers = []
    s = shaped
    while hasattr(s, "inner"):
        layers.append(type(s).__name__)
        s = s.inner
    assert layers == ["ProtectedScorer", "FocusScorer", "UtteranceScorer", "PooledScorer"]
    assert shaped.patch_ids(None).tolist() == list(range(6))
    with pytest.raises(ValueError, match="line ids"):
        episodic(patch, ScoringConfig(utterance=True))


def test_a_method_is_a_preset_with_field_overrides():
    config = EvalConfig()
    paper = config.build_config("epicache-paper", 512)
    assert paper.scoring == ScoringConfig.paper() and paper.alpha == 1.0
    assert config.route_of("epicache-paper") == ("centroid", 0.0)
    changed = config.build_config("epicache-paper+alpha=0+scoring.pool=7+scoring.utterance=true"
                                  "+scoring.focus=0.5+episodes.medoids=2+episodes.episodes=8"
                                  "+prefill.head_floor=0.1+scoring.patch_tokens=none", 512)
    assert (changed.alpha, changed.scoring.pool, changed.scoring.utterance,
            changed.scoring.focus, changed.scoring.patch_tokens) == (0.0, 7, True, 0.5, None)
    assert (changed.episodes.medoids, changed.episodes.episodes, changed.prefill.head_floor) == \
        (2, 8, 0.1)
    assert config.build_config("epicache", 512).scoring == config.build.scoring
    assert not config.needs_profile("epicache-paper+alpha=0")
    assert config.needs_profile("epicache-paper")
    overridden = EvalConfig(overrides=(parse_override("scoring.focus=2"),))
    assert overridden.build_config("epicache-paper", 512).scoring.focus == 2.0
    for bad, reason in (("epicache+pool", "PATH=VALUE"),
                        ("epicache+scoring.nope=1", "no configuration"),
                        ("epicache+scoring.pool=x", "scoring.pool"), ("h2o", "unknown method"),
                        ("epicache+budget=4", "not an override")):
        with pytest.raises(ValueError, match=reason):
            parse_method(bad)


def test_the_fair_rows_are_spelled_in_the_method_language_and_refuse_what_they_cannot_take():
    """`rag`, `full+topup.enabled=true` and `<baseline>+topup.enabled=true` parse; an override a
    method never reads is refused naming the method and the field, never ignored; `--set`
    applies to the methods that take it."""
    config = EvalConfig()
    assert not parse_method("rag").history and parse_method("rag").preset.scorer == "full"
    assert config.topup_of("rag") == config.topup_of("full+topup.enabled=true") == \
        config.topup_of("snapkv+topup.enabled=true") == config.topup_of("epicache")
    assert config.topup_of("snapkv") is None and config.topup_of("full") is None
    assert config.topup_of("epicache-paper") is None and config.topup_of("none") is None
    assert config.topup_of("rag+topup.max_tokens=64").max_tokens == 64
    assert config.build_config("rag", None) == config.build_config("none", None)  # one cell
    for bad, reason in (("snapkv+scoring.focus=0.5", "scoring.<field> is read by epicache only"),
                        ("keydiff+routing.two_below=0", "routing.<field> is read by epicache"),
                        ("streamingllm+episodes.episodes=8", "episodes.<field>"),
                        ("snapkv+alpha=1", "uniform"), ("rag+prefill.block=64", "only topup"),
                        ("full+alpha=0", "only topup"),
                        ("none+topup.enabled=true", "no overrides")):
        with pytest.raises(ValueError, match=reason):
            parse_method(bad)
    assert parse_method("question+alpha=1").overrides == (("alpha", 1.0),)  # it allocates
    everyone = EvalConfig(overrides=(parse_override("scoring.focus=2"),
                                     parse_override("topup.max_tokens=64")))
    assert everyone.build_config("epicache", 512).scoring.focus == 2.0
    assert everyone.build_config("snapkv", 512) == config.build_config("snapkv", 512)
    assert everyone.topup_of("snapkv+topup.enabled=true").max_tokens == 64


# --------------------------------------------------------------------------- layout, diagnostics

def _conversation() -> Conversation:
    lines = [("Ann", "I adopted a grey cat called Pixel last spring."),
             ("Ben", "Nice! I am training for a marathon in Lisbon."),
             ("Ann", "Pixel sleeps on my keyboard all day."),
             ("Ben", "My coach says I should run ten miles on Sunday."),
             ("Ann", "I painted the kitchen yellow this weekend."),
             ("Ben", "I bought new running shoes, bright orange ones."),
             ("Ann", "The yellow kitchen looks like a sunflower now."),
             ("Ben", "The marathon route passes the old harbour.")]
    turns = tuple(Turn(f"D{1 + i // 4}:{i % 4 + 1}", s, t, 1 + i // 4, f"day {1 + i // 4}")
                  for i, (s, t) in enumerate(lines))
    questions = (Question("What is the cat called?", "Pixel", ("D1:1",), 1),
                 Question("Where is the marathon?", "Lisbon", ("D1:2", "D2:4"), 1))
    return Conversation("known", ("Ann", "Ben"), turns, questions)


@pytest.mark.e2e
def test_token_layout_finds_every_turn_and_line():
    lm = models.load_llm(models.DEFAULT_LLM)
    conv = _conversation()
    layout = token_layout(lm.tokenizer, conv)
    ids = prompts.context_ids(lm.tokenizer, render_conversation(conv).text)
    assert layout.n_tokens == ids.shape[0] == layout.line_ids.shape[0]
    for turn in conv.turns:
        start, end = layout.span_of(turn.turn_id)
        assert lm.tokenizer.decode(ids[start:end]).strip() == f'{turn.speaker} said, "{turn.text}"'
        assert len(set(layout.line_ids[start:end].tolist())) == 1  # one turn, one line
    assert layout.turn_mask(["D1:1"]).sum() == layout.span_of("D1:1")[1] - layout.span_of("D1:1")[0]


@pytest.mark.e2e
def test_route_hit_and_evidence_kept_on_known_evidence():
    """A cache that holds exactly turn D1:1 (every layer and head) and half of D2:4: the
    diagnostics say so; an episode whose windows hold the evidence is a route hit."""
    lm = models.load_llm(models.DEFAULT_LLM)
    conv = _conversation()
    layout = token_layout(lm.tokenizer, conv)
    ids = prompts.context_ids(lm.tokenizer, render_conversation(conv).text)
    cache, _ = block_prefill(lm.model, ids, Full(), None, PrefillConfig(block=512))
    s1, e1 = layout.span_of("D1:1")
    s4, e4 = layout.span_of("D2:4")
    half = s4 + (e4 - s4) // 2
    for layer in cache.layers:
        held = (layer.positions >= s1) & (layer.positions < e1) | \
            (layer.positions >= s4) & (layer.positions < half)
        layer.keep(held.expand_as(layer.valid).clone())
    assert kept_share(cache, s1, e1) == pytest.approx(1.0)
    assert kept_share(cache, *layout.span_of("D1:2")) == 0.0
    first, second = (evidence_diagnostics(conv, q, layout, cache) for q in conv.questions)
    assert first["evidence_kept"] == pytest.approx(1.0) and first["evidence_session"] == 1
    assert second["evidence_kept"] == pytest.approx(((half - s4) / (e4 - s4)) / 2)
    assert second["evidence_position"] == pytest.approx(
        (layout.span_of("D1:2")[0] + s4) / 2 / layout.n_tokens)


@pytest.mark.e2e
def test_cell_records_carry_the_diagnostics(tmp_path):
    """An EpiCache cell of the known conversation: every record has the diagnostics, and
    `route_hit` agrees with the episode windows the question was routed to."""
    from pipeline.episodes import EpisodeConfig, build_episodes, member_turn_ids

    conv = _conversation()
    config = EvalConfig(BuildConfig(prefill=PrefillConfig(block=32),
                                    episodes=EpisodeConfig(window=2, episodes=2, medoids=1)))
    prep = prepare(conv, config)
    records = evaluate_cell(prep, "epicache", 24, config, None)
    episodes = build_episodes(conv, models.load_encoder(config.encoder),
                              config.build.episodes).episodes
    for r in records:
        members = set(member_turn_ids(conv, episodes[r["episode"]], 2))
        assert r["route_hit"] == bool(members & set(r["evidence"]))
        assert 0.0 <= r["evidence_kept"] <= 1.0 and r["evidence_session"] in (1, 2)
        assert "f1" not in r  # answers are generated only when asked for
