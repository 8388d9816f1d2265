"""Compact positions: key re-rotation, a compacted block prefill, its storage, and the refusal
of conversations longer than the model's positions."""

from __future__ import annotations

import pytest
import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from pipeline.answer.decode import generate_from_cache
from pipeline.eval.metrics import continuation_nll
from pipeline.kv.methods.epicache import EpiCache
from pipeline.kv.methods.streamingllm import StreamingLLM
from pipeline.kv.positions import ContextTooLongError, KeyRotation, check_fits
from pipeline.kv.prefill import PrefillConfig, block_prefill
from pipeline.kv.tristate import TriStateConfig
from pipeline.store.objects import cache_format
from tests.support.tiny_models import StandIn, one_torch_thread, random_ids, tiny_model  # noqa: F401

DAPQ_CANNOT = PrefillConfig(decode_positions=True).cannot_compact


def rotated(model, keys: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """`keys` [n, d] rotated at `positions` [n] the way the model does it."""
    cos, sin = model.model.rotary_emb(keys[None], positions[None])
    _, k = apply_rotary_pos_emb(keys[None, None], keys[None, None], cos, sin)
    return k[0, 0]


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_rotation_moves_a_key_to_the_shifted_position(family):
    model = tiny_model(family)
    g = torch.Generator().manual_seed(0)
    keys = torch.randn(40, model.config.head_dim, generator=g)
    start = torch.randint(0, 900, (40,), generator=g)
    shift = torch.randint(-900, 900, (40,), generator=g).clamp(min=-start)
    moved = KeyRotation.for_model(model).rotate(rotated(model, keys, start), shift)
    torch.testing.assert_close(moved, rotated(model, keys, start + shift), atol=1e-4, rtol=1e-4)
    assert not torch.allclose(moved, rotated(model, keys, start), atol=1e-3)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_compacting_a_recent_window_is_invisible(family):
    """StreamingLLM without sinks keeps a contiguous window, so compacting it only shifts every
    position by the same amount: RoPE attention is relative, so the answers are those of the
    uncompacted build, while the positions stay within the window."""
    model = tiny_model(family)
    ids, question = random_ids(300, seed=3), random_ids(5, seed=4)
    built = {mode: block_prefill(model, ids, StreamingLLM(sink=0), [24] * 3,
                                 PrefillConfig(block=16, positions=mode, compact_recent=0))[0]
             for mode in ("original", "compact")}
    original, compact = built["original"], built["compact"]
    assert original.next_position == compact.tokens_seen == 300
    assert compact.next_position == 24 + 16 - 16  # the window, the last block evicted into it
    for a, b in zip(original.layers, compact.layers):
        assert torch.equal(a.positions, b.positions)  # the tokens kept: the same
        assert torch.equal(b.rope_positions[b.valid], torch.arange(24).repeat(b.valid.shape[0]))
        torch.testing.assert_close(a.values, b.values, atol=1e-4, rtol=0)
    prefix, target = question[:2], question[2:]
    assert continuation_nll(model, compact, prefix, target) == pytest.approx(
        continuation_nll(model, original, prefix, target), abs=1e-4)
    assert generate_from_cache(StandIn(model), compact, question, 8).tolist() == \
        generate_from_cache(StandIn(model), original, question, 8).tolist()


def test_compact_prefill_reads_past_the_model_positions_and_round_trips():
    """A history 3x the tiny model's 1,024 positions: every block, patch and question stays
    within them; the stored cache keeps the positions mode and decodes the same after loading."""
    model = tiny_model("llama")
    limit = model.config.max_position_embeddings
    ids = random_ids(3 * limit, seed=5)
    budget, block = 32, 64
    cache, stats = block_prefill(model, ids, EpiCache(patch=random_ids(12, seed=6)), [budget] * 3,
                                 PrefillConfig(block=block, positions="compact", compact_recent=0))
    assert cache.tokens_seen == stats.tokens == 3 * limit
    held = max(layer.valid.shape[1] for layer in cache.layers)
    assert cache.next_position == held <= budget * model.config.num_key_value_heads
    for layer in cache.layers:
        counts = layer.valid.sum(dim=1)
        for h, n in enumerate(counts.tolist()):
            assert layer.rope_positions[h, :n].tolist() == list(range(n))
        assert int(layer.positions[layer.valid].max()) >= 2 * limit  # late tokens are kept too
    data = cache_format.serialize(cache, {"conversation_id": "c", "episode": 0}, torch.float32)
    assert cache_format.read_header(data)["positions"] == "compact"
    loaded, header = cache_format.deserialize(data, None)
    assert loaded.next_position == cache.next_position and header["next_position"] == held
    for a, b in zip(cache.layers, loaded.layers):
        assert torch.equal(a.rope_positions[a.valid], b.rope_positions[b.valid])
    question = random_ids(6, seed=7)
    assert continuation_nll(model, loaded, question[:3], question[3:]) == pytest.approx(
        continuation_nll(model, cache, question[:3], question[3:]), abs=1e-5)


def test_original_positions_are_stored_as_original():
    model = tiny_model("qwen2")
    cache, _ = block_prefill(model, random_ids(100, seed=8), StreamingLLM(sink=4), [16] * 3,
                             PrefillConfig(block=16, positions="original"))
    header = cache_format.read_header(cache_format.serialize(cache, {}, torch.float32))
    assert header["positions"] == "original" and header["next_position"] == 100


def test_compact_positions_refuse_what_they_cannot_re_rotate():
    with pytest.raises(ValueError, match="compact positions"):
        PrefillConfig(positions="compact", decode_positions=True)
    # tri-state's Quantized keys are re-rotated (their codes made anew): compact by default
    assert PrefillConfig(tristate=TriStateConfig(enabled=True)).position_mode == "compact"


def test_a_history_past_the_positions_is_refused_with_both_ways_out():
    check_fits("c1", 7680, 8192)  # fits: 512 positions left for the question and answer
    with pytest.raises(ContextTooLongError) as e:
        check_fits("c1", 23456, 8192)
    message = str(e.value)
    assert "'c1' is 23,456 tokens" in message and "8,192 positions" in message
    assert "--max-context-tokens 7680" in message and "--positions compact" in message
    with pytest.raises(ContextTooLongError) as e:  # DapQ cannot compact: not offered
        check_fits("c1", 23456, 8192, cannot_compact=DAPQ_CANNOT)
    assert "--positions compact" not in str(e.value) and DAPQ_CANNOT in str(e.value)


@pytest.mark.e2e
def test_a_build_refuses_a_long_conversation_unless_cut_or_compact():
    """With SmolLM2 (8,192 positions): a ~9,500-token conversation is kept whole by default
    (compact positions), refused with original positions (also where the default falls back to
    them: DapQ), and cut at a session boundary with --max-context-tokens."""
    from pipeline.builder.cluster import fit_context
    from pipeline.config import BuildConfig
    from pipeline.corpus.synthetic import make_conversation

    conv = make_conversation("long", target_tokens=9500, seed=0)
    assert fit_context(conv, BuildConfig()) is conv
    for prefill, way_out in ((PrefillConfig(positions="original"), "--positions compact"),
                             (PrefillConfig(decode_positions=True), DAPQ_CANNOT)):
        with pytest.raises(ContextTooLongError, match=f"'long' is .* tokens.*{way_out}"):
            fit_context(conv, BuildConfig(prefill=prefill))
        cut = fit_context(conv, BuildConfig(prefill=prefill, max_context_tokens=7600))
        assert 0 < len(cut.turns) < len(conv.turns) and cut.meta["cut"]["max_tokens"] == 7600


def test_compacting_all_but_the_recent_tokens_keeps_their_spacing():
    """`compact_recent`: the entries of the last N tokens keep their original spacing after the
    packed older ones (the same for every head and layer), and a question reads them at the
    distances a full-history read would (`next_position` = packed older + N)."""
    model = tiny_model("llama")
    ids, recent = random_ids(400, seed=11), 96
    cache, _ = block_prefill(model, ids, EpiCache(patch=random_ids(12, seed=12)), [40] * 3,
                             PrefillConfig(block=64, positions="compact", compact_recent=recent))
    cut = cache.tokens_seen - recent
    base = max(int((layer.valid & (layer.positions < cut)).sum(dim=1).max())
               for layer in cache.layers)
    assert cache.next_position == base + recent
    for layer in cache.layers:
        for h in range(layer.valid.shape[0]):
            kept = layer.valid[h]
            pos, rope = layer.positions[h][kept], layer.rope_positions[h][kept]
            older = pos < cut
            assert rope[older].tolist() == list(range(int(older.sum())))  # packed, in order
            assert (rope[~older] - pos[~older]).tolist() == [base - cut] * int((~older).sum())
    assert int((cache.layers[0].positions >= cut).sum()) > 0  # some recent entries were kept
    loaded, _ = cache_format.deserialize(cache_format.serialize(cache, {}, torch.float32), None)
    assert loaded.next_position == cache.next_position
    for a, b in zip(cache.layers, loaded.layers):
        assert torch.equal(a.rope_positions[a.valid], b.rope_positions[b.valid])


def test_the_default_positions_keep_a_short_history_at_its_spacing():
    """The default (`auto`: compact, the last 2,048 tokens at their spacing) builds a history
    shorter than 2,048 tokens exactly as original positions do; `compact_recent=0` packs it."""
    model = tiny_model("qwen2")
    ids = random_ids(300, seed=13)
    default, original, packed = (
        block_prefill(model, ids, EpiCache(patch=random_ids(8, seed=14)), [24] * 3,
                      PrefillConfig(block=32, **kw))[0]
        for kw in ({}, {"positions": "original"}, {"positions": "compact", "compact_recent": 0}))
    assert default.next_position == original.next_position == 300 > packed.next_position
    for a, b in zip(default.layers, original.layers):
        assert torch.equal(a.rope_positions, b.rope_positions) and torch.equal(a.keys, b.keys)
