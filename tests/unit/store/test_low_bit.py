"""Caches stored in low-bit codes (`BuildConfig.code`, formats 3-9): keys per channel and values per
token (`pipeline.store.objects.low_bit`), read back within the code's error, their bytes as
counted, and a damaged object refused like any other."""

from __future__ import annotations

import copy
import dataclasses
import json
import struct

import pytest
import torch
from safetensors.torch import load, save

from kernels.quant_reference import GROUP_BITS, pack_codes, unpack_codes
from pipeline.answer.decode import generate_from_cache
from pipeline.config import BuildConfig, CodeConfig, PrefillConfig, TriStateConfig
from pipeline.config.format_version import (
    CODED_FORMAT,
    FLOATS_CODED_FORMAT,
    LOW_FIRST_SPLIT_FORMAT,
    MIXED_BITS_FORMAT,
    READABLE_FORMATS,
    ROTATED_FORMAT,
    SPLIT_FORMAT,
    TURNED_VALUES_FORMAT,
)
from pipeline.config.stages import CODE_BITS
from pipeline.kv.methods.epicache import EpiCache
from pipeline.kv.prefill import block_prefill
from pipeline.store.objects import low_bit
from pipeline.store.objects.cache_format import (
    CacheCorruptError,
    as_stored,
    coded_kv_bytes,
    deserialize,
    read_header,
    serialize,
    sha256,
)
from tests.support.tiny_models import StandIn, one_torch_thread, random_ids, tiny_model  # noqa: F401

NAME = "caches/conv-1/abcd/episode-0.safetensors"


def step_bound(rows: torch.Tensor) -> torch.Tensor:
    """Per group of `rows` [R, G]: half the float16 step plus float16's rounding of the range's
    ends (2^-10 of the largest magnitude), what a code may be off by."""
    step = (rows.amax(dim=1) - rows.amin(dim=1)) / 15
    return step / 2 + rows.abs().amax(dim=1) * 2 ** -10 + 1e-6


def test_the_config_and_the_kernels_agree_on_the_widths():
    assert CODE_BITS == GROUP_BITS


@pytest.mark.parametrize("lengths", [[37, 5, 0, 64], [1, 1, 1, 1], [0, 0, 0, 0]])
def test_keys_are_coded_per_channel_over_each_heads_entries(lengths):
    """Each head's entries in runs of `group`, per channel: a head's last run filled up with its
    last entry and cut off again; an outlier channel widens only its own channel's step."""
    torch.manual_seed(0)
    keys = torch.randn(sum(lengths), 16)
    keys[:, 3] *= 50  # an outlier channel, as keys have
    coded = low_bit.encode_per_channel(keys, lengths, bits=4, group=8)
    back = low_bit.decode_per_channel(coded, lengths, 16, 4, 8, torch.float32)
    assert back.shape == keys.shape
    if not sum(lengths):
        return
    error = (back - keys).abs()
    assert float(error[:, 3].max()) > 5 * float(error[:, [0, 1, 2, 4]].max())
    start = 0
    for n in lengths:  # every run of a head within its own channel's bound
        head, head_back = keys[start:start + n], back[start:start + n]
        for run in range(0, n, 8):
            part = head[run:run + 8].T  # [channels, entries]
            assert ((head_back[run:run + 8].T - part).abs() <= step_bound(part)[:, None]).all()
        start += n
    values = low_bit.encode_per_token(keys, bits=4, group=8)  # any [entries, d] will do
    stored = low_bit.coded_bytes(lengths, 16, CodeConfig(bits=4, group=8))
    assert sum(t.nbytes for t in (*coded, *values)) == stored


def test_values_are_coded_per_token_in_runs_of_channels():
    torch.manual_seed(1)
    values = torch.randn(21, 16)
    for group, span in ((8, 8), (32, 16)):  # a group past the head dimension spans the head
        coded = low_bit.encode_per_token(values, bits=4, group=group)
        assert coded.codes.shape == (21 * 16 // span, span * 4 // 8)
        back = low_bit.decode_per_token(coded, 21, 16, 4, group, torch.float32)
        rows = values.reshape(-1, span)
        assert ((back.reshape(-1, span) - rows).abs() <= step_bound(rows)[:, None]).all()
    with pytest.raises(ValueError, match="does not split"):
        low_bit.encode_per_token(torch.randn(3, 24), bits=4, group=16)


@pytest.fixture(scope="module")
def built():
    """(model, cache): a head-wise budgeted block prefill at compact positions, heads ragged."""
    model = tiny_model("llama")
    cache, _ = block_prefill(model, random_ids(70, seed=1), EpiCache(patch=random_ids(5, seed=2)),
                             [10, 14, 18], PrefillConfig(block=8, selection="headwise",
                                                         positions="compact", compact_recent=16))
    return model, cache


@pytest.mark.parametrize("bits", GROUP_BITS)
def test_a_coded_cache_reads_back_within_its_codes_error(built, bits):
    """Format 3 keeps every head's entries, positions and compact positions exactly, and keys and
    values within the code's error; smaller per bit; a question decodes from it."""
    model, cache = built
    code = CodeConfig(bits=bits, group=8)
    data = serialize(cache, {"conversation_id": "conv-1"}, code=code)
    loaded, header = deserialize(data, sha256(data), NAME)
    # widths packed in two parts are format 8's
    assert header["format"] == (CODED_FORMAT if bits in (2, 4, 8) else SPLIT_FORMAT)
    assert header["format"] in READABLE_FORMATS
    assert header["code"] == {"bits": bits, "group": 8} and header["positions"] == "compact"
    assert loaded.tokens_seen == cache.tokens_seen and loaded.next_position == cache.next_position
    floats = sum(int(layer.valid.sum()) * 2 * layer.keys.shape[-1] * 2 for layer in cache.layers)
    # per number: bits / 8 bytes of code and a 4-byte step and minimum per group of 8 (float16:
    # 2 bytes), with room for the keys' last runs filled up
    assert coded_kv_bytes(loaded, code) < floats * (bits / 8 + 4 / 8) / 2 * 1.25
    worst = 0.0
    for a, b in zip(cache.layers, loaded.layers):
        assert torch.equal(a.valid.sum(1), b.valid.sum(1))
        assert torch.equal(a.positions[a.valid], b.positions[b.valid])
        assert torch.equal(a.rope_positions[a.valid], b.rope_positions[b.valid])
        for name in ("keys", "values"):
            x, y = getattr(a, name)[0][a.valid], getattr(b, name)[0][b.valid]
            spread = float(x.max() - x.min())
            assert float((x - y).abs().max()) <= spread / (2 ** bits - 1)  # a whole step at most
            worst = max(worst, float((x - y).abs().max()) / spread)
    assert worst > 0  # coded, not copied
    question = random_ids(4, seed=3)
    assert generate_from_cache(StandIn(model), loaded, question, 4).shape[-1] == 4
    coded_parts = ("codes", "steps", "mins")
    assert coded_kv_bytes(loaded, code) == sum(
        t.nbytes for k, t in load(data).items() if k.split(".")[-1][1:] in coded_parts)


def test_a_coded_objects_positions_take_the_narrowest_integer_that_holds_them(built):
    """int16 while every position fits (a coded entry is ~72 bytes, int32 would add 4), int32
    past it; read back exactly either way."""
    _, cache = built
    code = CodeConfig(bits=4, group=8)
    assert load(serialize(cache, {}, code=code))["layers.0.positions"].dtype == torch.int16
    far = copy.deepcopy(cache)
    for layer in far.layers:
        layer.positions = layer.positions + 40_000
    data = serialize(far, {}, code=code)
    assert load(data)["layers.0.positions"].dtype == torch.int32
    loaded, _ = deserialize(data, sha256(data), NAME)
    for a, b in zip(far.layers, loaded.layers):
        assert torch.equal(a.positions[a.valid], b.positions[b.valid])


def test_float_sinks_and_recent_entries_read_back_exactly_the_rest_coded(built):
    """Format 4: each head's first and last entries kept as floats beside the codes read back
    as the float16 object would hold them, the others within the code's error as in format 3,
    each entry in its place; the bytes counted are those stored."""
    model, cache = built
    code = CodeConfig(bits=4, group=8, float_sinks=2, float_recent=3)
    data = serialize(cache, {"conversation_id": "conv-1"}, code=code)
    loaded, header = deserialize(data, sha256(data), NAME)
    assert header["format"] == FLOATS_CODED_FORMAT in READABLE_FORMATS
    assert header["code"] == {"bits": 4, "group": 8, "float_sinks": 2, "float_recent": 3}
    plain = as_stored(cache, CodeConfig(bits=4, group=8))
    for a, b, c in zip(cache.layers, loaded.layers, plain.layers):
        assert torch.equal(a.positions[a.valid], b.positions[b.valid])
        floats = low_bit.float_entries(a.valid.sum(1).tolist(), 2, 3)
        assert 0 < int(floats.sum()) < len(floats)
        for name in ("keys", "values"):
            x, y = getattr(a, name)[0][a.valid], getattr(b, name)[0][b.valid]
            assert torch.equal(y[floats], x[floats].half().float())
            spread = float(x.max() - x.min())
            assert float((x - y).abs().max()) <= spread / 15
            assert not torch.equal(y[~floats], getattr(c, name)[0][c.valid][~floats]) or \
                name == "values"  # keys coded per channel over other runs than format 3's
    coded_parts = ("codes", "steps", "mins", "floats")
    assert coded_kv_bytes(loaded, code) == sum(
        t.nbytes for k, t in load(data).items() if k.split(".")[-1][1:] in coded_parts)
    assert coded_kv_bytes(loaded, code) > coded_kv_bytes(loaded, CodeConfig(bits=4, group=8))
    question = random_ids(4, seed=3)
    assert generate_from_cache(StandIn(model), loaded, question, 4).shape[-1] == 4
    with pytest.raises(ValueError, match="need a low-bit code"):
        CodeConfig(float_sinks=4)


def test_values_at_other_bits_than_the_keys(built):
    """Format 5: the values coded at `value_bits`, the keys at `bits`, each within its own
    code's error; the bytes counted are those stored, fewer than both at the keys' width; an
    object of another width is refused by a configuration check, never misread."""
    model, cache = built
    code = CodeConfig(bits=4, group=8, float_sinks=1, value_bits=2)
    assert code.mixed_bits and code.bytes_per_number == (4 + 2) / 16 + 4 / 8
    data = serialize(cache, {"conversation_id": "conv-1"}, code=code)
    loaded, header = deserialize(data, sha256(data), NAME)
    assert header["format"] == MIXED_BITS_FORMAT in READABLE_FORMATS
    assert header["code"] == {"bits": 4, "group": 8, "float_sinks": 1, "float_recent": 0,
                              "value_bits": 2}
    for a, b in zip(cache.layers, loaded.layers):
        floats = low_bit.float_entries(a.valid.sum(1).tolist(), 1, 0)
        for name, bits in (("keys", 4), ("values", 2)):
            x, y = getattr(a, name)[0][a.valid], getattr(b, name)[0][b.valid]
            assert torch.equal(y[floats], x[floats].half().float())
            spread = float(x.max() - x.min())
            assert float((x - y).abs().max()) <= spread / (2 ** bits - 1)
        x, y = a.values[0][a.valid], b.values[0][b.valid]
        assert float((x - y).abs().max()) > float(x.max() - x.min()) / 15  # 2 bits, not 4
    coded_parts = ("codes", "steps", "mins", "floats")
    assert coded_kv_bytes(loaded, code) == sum(
        t.nbytes for k, t in load(data).items() if k.split(".")[-1][1:] in coded_parts)
    same = CodeConfig(bits=4, group=8, float_sinks=1)
    assert coded_kv_bytes(loaded, code) < coded_kv_bytes(loaded, same)
    assert read_header(serialize(cache, {}, code=same))["format"] == FLOATS_CODED_FORMAT
    assert not CodeConfig(bits=4, value_bits=4).mixed_bits
    with pytest.raises(ValueError, match="value_bits must be one of"):
        CodeConfig(value_bits=2)
    with pytest.raises(ValueError, match="value_bits must be one of"):
        CodeConfig(bits=4, value_bits=7)
    question = random_ids(4, seed=3)
    assert generate_from_cache(StandIn(model), loaded, question, 4).shape[-1] == 4


def test_keys_turned_before_coding_are_turned_back(built):
    """Format 6: the coded keys are turned by a Hadamard matrix before coding and back when
    read, so their error is the code's in the turned space; the float entries and the values
    are as without the turn, and so are the bytes."""
    model, cache = built
    plain = CodeConfig(bits=4, group=8, float_sinks=1)
    code = CodeConfig(bits=4, group=8, float_sinks=1, rotate=True)
    data = serialize(cache, {"conversation_id": "conv-1"}, code=code)
    loaded, header = deserialize(data, sha256(data), NAME)
    unturned, _ = deserialize(serialize(cache, {}, code=plain), None, NAME)
    assert header["format"] == ROTATED_FORMAT in READABLE_FORMATS
    assert header["code"]["rotate"] == "hadamard"
    for a, b, c in zip(cache.layers, loaded.layers, unturned.layers):
        floats = low_bit.float_entries(a.valid.sum(1).tolist(), 1, 0)
        x, y = a.keys[0][a.valid], b.keys[0][b.valid]
        assert torch.equal(y[floats], x[floats].half().float())
        turned = low_bit.turned(x[~floats])
        error = low_bit.turned(y[~floats]) - turned  # the code's own error, turned back
        assert float(error.abs().max()) <= float(turned.max() - turned.min()) / 15 + 1e-3
        assert torch.equal(b.values, c.values)
    assert coded_kv_bytes(loaded, code) == coded_kv_bytes(loaded, plain)
    tensor_bytes = [sum(t.nbytes for t in load(d).values())
                    for d in (data, serialize(cache, {}, code=plain))]
    assert tensor_bytes[0] == tensor_bytes[1]
    with pytest.raises(ValueError, match="need a low-bit code"):
        CodeConfig(rotate=True)
    with pytest.raises(ValueError, match="power of two"):
        low_bit.turned(torch.randn(3, 24))
    question = random_ids(4, seed=3)
    assert generate_from_cache(StandIn(model), loaded, question, 4).shape[-1] == 4


def test_values_turned_before_coding_are_turned_back(built):
    """Format 9: the values turned before coding as the keys are, and back when read, so their
    error is the code's in the turned space; the keys, the float entries and the bytes are
    those of the object whose keys alone are turned."""
    model, cache = built
    keys_turned = CodeConfig(bits=4, group=8, float_sinks=1, rotate=True)
    code = dataclasses.replace(keys_turned, rotate_values=True)
    data = serialize(cache, {"conversation_id": "conv-1"}, code=code)
    loaded, header = deserialize(data, sha256(data), NAME)
    keys_only = serialize(cache, {}, code=keys_turned)
    unturned, _ = deserialize(keys_only, None, NAME)
    assert header["format"] == TURNED_VALUES_FORMAT in READABLE_FORMATS
    assert header["code"]["rotate_values"] == "hadamard" == header["code"]["rotate"]
    for a, b, c in zip(cache.layers, loaded.layers, unturned.layers):
        floats = low_bit.float_entries(a.valid.sum(1).tolist(), 1, 0)
        x, y = a.values[0][a.valid], b.values[0][b.valid]
        assert torch.equal(y[floats], x[floats].half().float())
        rows = low_bit.turned(x[~floats]).reshape(-1, 8)  # the groups: 8 channels of a token
        error = (low_bit.turned(y[~floats]).reshape(-1, 8) - rows).abs()
        assert (error <= step_bound(rows)[:, None] + 1e-3).all()
        assert torch.equal(b.keys, c.keys)
        assert not torch.equal(b.values, c.values)
    assert ({k: t.nbytes for k, t in load(data).items()}
            == {k: t.nbytes for k, t in load(keys_only).items()})
    with pytest.raises(ValueError, match="need a low-bit code"):
        CodeConfig(rotate_values=True)
    question = random_ids(4, seed=3)
    assert generate_from_cache(StandIn(model), loaded, question, 4).shape[-1] == 4


def test_turned_keys_coded_per_token_and_widths_in_two_parts(built):
    """Format 8: keys turned then coded per token (`key_axis="token"`), each entry within its
    own group's step in the turned space; keys at 5 bits and values at 3 (codes packed in two
    parts), each within its width's step; the bytes counted are those stored, and 5 + 3 bits
    take the bytes of 4 + 4."""
    model, cache = built
    code = CodeConfig(bits=5, value_bits=3, group=8, float_sinks=1, rotate=True,
                      key_axis="token")
    data = serialize(cache, {"conversation_id": "conv-1"}, code=code)
    loaded, header = deserialize(data, sha256(data), NAME)
    assert header["format"] == SPLIT_FORMAT in READABLE_FORMATS
    assert header["code"] == {"bits": 5, "group": 8, "float_sinks": 1, "float_recent": 0,
                              "value_bits": 3, "rotate": "hadamard", "key_axis": "token"}
    for a, b in zip(cache.layers, loaded.layers):
        floats = low_bit.float_entries(a.valid.sum(1).tolist(), 1, 0)
        x, y = a.keys[0][a.valid], b.keys[0][b.valid]
        assert torch.equal(y[floats], x[floats].half().float())
        rows = low_bit.turned(x[~floats]).reshape(-1, 8)  # the groups: 8 channels of a token
        error = (low_bit.turned(y[~floats]).reshape(-1, 8) - rows).abs()
        assert (error <= (rows.amax(1) - rows.amin(1))[:, None] / 31 / 2 + 2e-3).all()
        x, y = a.values[0][a.valid][~floats], b.values[0][b.valid][~floats]
        rows = x.reshape(-1, 8)
        error = (y.reshape(-1, 8) - rows).abs()
        assert (error <= (rows.amax(1) - rows.amin(1))[:, None] / 7 / 2 + 2e-3).all()
        assert float(error.max()) > float((rows.amax(1) - rows.amin(1)).max()) / 31  # 3 bits
    coded_parts = ("codes", "steps", "mins", "floats")
    assert coded_kv_bytes(loaded, code) == sum(
        t.nbytes for k, t in load(data).items() if k.split(".")[-1][1:] in coded_parts)
    same_bytes = CodeConfig(bits=4, group=8, float_sinks=1, rotate=True, key_axis="token")
    assert coded_kv_bytes(loaded, code) == coded_kv_bytes(loaded, same_bytes)
    assert read_header(serialize(cache, {}, code=same_bytes))["format"] == SPLIT_FORMAT
    with pytest.raises(ValueError, match="key_axis"):
        CodeConfig(key_axis="token")
    with pytest.raises(ValueError, match="key_axis"):
        CodeConfig(bits=4, key_axis="diagonal")
    question = random_ids(4, seed=3)
    assert generate_from_cache(StandIn(model), loaded, question, 4).shape[-1] == 4


def _as_format_7(data: bytes, code: CodeConfig) -> bytes:
    """A format 8 object as format 7 wrote it: each split code's low bits packed first."""
    def low_first(tensors: dict, header: dict) -> None:
        header["format"] = LOW_FIRST_SPLIT_FORMAT
        for name, t in tensors.items():
            if name.endswith("codes"):
                bits = code.bits if name.endswith("kcodes") else code.value_width
                tensors[name] = pack_codes(unpack_codes(t, bits).to(torch.uint8), bits,
                                           high_first=False)
    return _with(data, low_first)


@pytest.mark.parametrize("bits, value_bits", [(3, 5), (5, 3), (6, 4)])
def test_format_7_objects_read_as_they_were_written(built, bits, value_bits):
    """Objects that format 7 wrote (a split code's low bits first) read back to the same cache
    as the format 8 object of the same codes, whose bytes differ where a width is split."""
    _, cache = built
    code = CodeConfig(bits=bits, value_bits=value_bits, group=8, rotate=True)
    data = serialize(cache, {}, code=code)
    legacy = _as_format_7(data, code)
    assert legacy != data and read_header(legacy)["format"] == "epicache-kv/7"
    new, old = deserialize(data, None, NAME)[0], deserialize(legacy, None, NAME)[0]
    for a, b in zip(new.layers, old.layers):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)


def test_double_quantized_scales_read_back_within_their_blocks_step():
    """Each step or minimum is an 8-bit code over its block of 256 rows' range: read back
    within half that range / 255 (and float16's rounding), a last block part filled, none too."""
    torch.manual_seed(4)
    coded = low_bit.Coded(torch.zeros(600, 4, dtype=torch.uint8),
                          torch.rand(600).half() * 0.1, torch.randn(600).half())
    stored = low_bit.stored_scales(coded, CodeConfig(bits=4, double_quant=True))
    assert stored["steps"].dtype == torch.uint8 and stored["steps"].shape == (600,)
    assert stored["mins_steps"].shape == stored["mins_mins"].shape == (3,)  # 256 + 256 + 88
    steps, mins = low_bit.scales_of_stored(stored.__getitem__, CodeConfig(bits=4,
                                                                          double_quant=True))
    for back, scales in ((steps, coded.steps), (mins, coded.mins)):
        assert back.dtype == torch.float16
        for block in range(3):
            rows = slice(256 * block, 256 * (block + 1))
            x = scales[rows].float()
            bound = float(x.max() - x.min()) / 255 / 2 + float(x.abs().max()) * 2 ** -10
            assert float((back[rows].float() - x).abs().max()) <= bound
    empty = low_bit.Coded(torch.zeros(0, 4, dtype=torch.uint8), torch.zeros(0).half(),
                          torch.zeros(0).half())
    stored = low_bit.stored_scales(empty, CodeConfig(bits=4, double_quant=True))
    back = low_bit.scales_of_stored(stored.__getitem__, CodeConfig(bits=4, double_quant=True))
    assert [t.shape for t in back] == [(0,), (0,)]


def test_a_cache_with_double_quantized_scales(built):
    """Format 8 with `double_quant`: the scales take about half their bytes, counted as stored;
    the cache reads back near the one with float16 scales (each number off by at most its
    step's and minimum's own error, a code of at most 31 times the step's); a question decodes."""
    model, cache = built
    code = CodeConfig(bits=3, value_bits=5, group=8, float_sinks=1, rotate=True,
                      double_quant=True)
    plain = dataclasses.replace(code, double_quant=False)
    data, plain_data = serialize(cache, {}, code=code), serialize(cache, {}, code=plain)
    loaded, header = deserialize(data, sha256(data), NAME)
    reference, _ = deserialize(plain_data, None, NAME)
    assert header["format"] == SPLIT_FORMAT and header["code"]["double_quant"] == 256
    stored = load(data)
    assert coded_kv_bytes(loaded, code) == sum(
        t.nbytes for k, t in stored.items() if k.split(".")[-1][1:].startswith(
            ("codes", "steps", "mins", "floats")))
    rows = sum(int(t.numel()) for k, t in stored.items() if k.endswith(("ksteps", "vsteps")))
    assert coded_kv_bytes(loaded, plain) - coded_kv_bytes(loaded, code) > rows * 2 * 0.8
    plain_stored = load(plain_data)
    for i, (a, b) in enumerate(zip(reference.layers, loaded.layers)):
        steps, mins = plain_stored[f"layers.{i}.vsteps"].float(), plain_stored[f"layers.{i}.vmins"]
        bound = (float(steps.max() - steps.min()) * 31 + float(mins.max() - mins.min())) / 510
        error = (a.values[0][a.valid] - b.values[0][b.valid]).abs().max()
        assert 0 < float(error) <= bound + float(mins.abs().max()) * 2 ** -9 + 1e-3
    question = random_ids(4, seed=3)
    assert generate_from_cache(StandIn(model), loaded, question, 4).shape[-1] == 4
    with pytest.raises(ValueError, match="double_quant"):
        CodeConfig(double_quant=True)


def test_a_turn_evens_the_error_over_the_channels_the_queries_read():
    """Why keys are turned: per channel, a key's outlier channel takes a wide step and so most
    of the error, and queries are large in that same channel, so the attention logits take it
    at its largest. Turned, the error is about as large but spread over every channel, and the
    logits' error is a fraction of it."""
    torch.manual_seed(2)
    keys = torch.randn(64, 16)
    keys[:, 3] *= 20  # an outlier channel, as keys have
    queries = torch.randn(32, 16) * 0.1
    queries[:, 3] = 3.0  # the queries read it
    key_errors, logit_errors = [], []
    for turn in (lambda x: x, low_bit.turned):
        coded = low_bit.encode_per_channel(turn(keys).contiguous(), [64], bits=4, group=8)
        error = turn(low_bit.decode_per_channel(coded, [64], 16, 4, 8, torch.float32)) - keys
        key_errors.append(float(error.norm()))
        logit_errors.append(float((queries @ error.T).norm()))
    assert key_errors[1] < 1.5 * key_errors[0]
    assert logit_errors[1] < 0.5 * logit_errors[0]


def test_a_turn_narrows_the_step_of_values_with_a_wide_channel():
    """Why values may be turned too: coded per token, one wide channel sets the step of every
    channel of its token; turned, the range is shared and the steps narrow."""
    torch.manual_seed(3)
    values = torch.randn(64, 16)
    values[:, 5] *= 12  # a wide channel, as some heads' values have
    errors = []
    for turn in (lambda x: x, low_bit.turned):
        coded = low_bit.encode_per_token(turn(values).contiguous(), bits=4, group=16)
        errors.append(float((turn(low_bit.decode_per_token(coded, 64, 16, 4, 16, torch.float32))
                             - values).norm()))
    assert errors[1] < 0.7 * errors[0]


def test_eight_bits_answer_as_the_float_cache(built):
    """At 8 bits the cache is within a 255th of each group's range: the same greedy tokens."""
    model, cache = built
    question = random_ids(4, seed=3)
    assert generate_from_cache(StandIn(model), as_stored(cache, CodeConfig(bits=8)), question,
                               6).tolist() == \
        generate_from_cache(StandIn(model), cache, question, 6).tolist()
    assert as_stored(cache, CodeConfig()) is cache


def _with(data: bytes, change) -> bytes:
    """The object with its tensors or header changed by `change(tensors, header)`."""
    (size,) = struct.unpack("<Q", data[:8])
    header = json.loads(json.loads(data[8:8 + size])["__metadata__"]["header"])
    tensors = dict(load(data))
    change(tensors, header)
    return save(tensors, metadata={"header": json.dumps(header)})


@pytest.mark.parametrize("change", [
    lambda t, h: t.update({"layers.0.kcodes": t["layers.0.kcodes"][:-1]}),
    lambda t, h: t.update({"layers.1.vsteps": t["layers.1.vsteps"][:-2]}),
    lambda t, h: t.pop("layers.0.vmins"),
    lambda t, h: h["code"].update(bits=7),
    lambda t, h: h.pop("code") and None,
    lambda t, h: h.update(head_dim=0),
    lambda t, h: h["code"].update(rotate="givens"),
    lambda t, h: h["code"].update(bits=5),
    lambda t, h: h["code"].update(key_axis="token"),
    lambda t, h: h["code"].update(key_axis="diagonal"),
    lambda t, h: h["code"].update(double_quant=256),
    lambda t, h: h["code"].update(double_quant=128),
    lambda t, h: h["code"].update(rotate_values="givens"),
], ids=["key-rows", "value-steps", "missing", "bits", "no-code", "head-dim", "turn", "width",
        "key-axis", "unknown-axis", "scales-not-coded", "scale-block", "value-turn"])
def test_a_damaged_coded_object_is_corrupt_naming_it(built, change):
    _, cache = built
    data = _with(serialize(cache, {}, code=CodeConfig(bits=4, group=8)), change)
    with pytest.raises(CacheCorruptError, match="episode-0"):
        deserialize(data, None, NAME)


def test_codes_and_tristate_are_one_or_the_other():
    with pytest.raises(ValueError, match="choose one"):
        BuildConfig(code=CodeConfig(bits=4),
                    prefill=PrefillConfig(tristate=TriStateConfig(enabled=True)))
    with pytest.raises(ValueError, match="bits"):
        CodeConfig(bits=7)
    with pytest.raises(ValueError, match="group"):
        CodeConfig(bits=4, group=24)
