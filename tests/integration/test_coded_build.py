"""A build stored in low-bit codes (`BuildConfig.code`): its objects are format 3, read back as
the evaluation measures them (`cache_format.as_stored`), take the bytes counted, hold more
entries where the budget is in bytes and fit its bytes, and a lost one is repaired with the very
bytes it had."""

from __future__ import annotations

import pytest
import torch

from pipeline.builder.append import read_stored_cache
from pipeline.builder.conversation import build_conversation, files_of, is_built
from pipeline.builder.episode import build_episode_caches
from pipeline.config import BuildConfig, CodeConfig, EpisodeConfig, PrefillConfig
from pipeline.config.format_version import CODED_FORMAT
from pipeline.corpus.synthetic import make_conversation
from pipeline.kv import models
from pipeline.store.backends.local import LocalStore
from pipeline.store.objects import cache_format
from pipeline.store.objects.zstd_object import ZSTD_MAGIC
from tests.support.model_folders import make_model_folders


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    return make_model_folders(tmp_path_factory.mktemp("coded-models"))


def coded_config(folders, **code) -> BuildConfig:
    llm, encoder = folders
    return BuildConfig(model=str(llm), encoder=str(encoder), budget=32, store_dtype="float16",
                       prefill=PrefillConfig(block=64), episodes=EpisodeConfig(episodes=2,
                                                                               medoids=1),
                       code=CodeConfig(group=8, **code))


@pytest.mark.parametrize("bytes_budget", [False, True])
def test_coded_caches_read_back_as_measured_and_a_lost_one_is_repaired_alone(folders, tmp_path,
                                                                             bytes_budget):
    config = coded_config(folders, bits=4, bytes_budget=bytes_budget)
    conv = make_conversation("coded-0", target_tokens=600, seed=5)
    store = LocalStore(tmp_path / "store")
    product = build_conversation(conv, config, store, prefill=build_episode_caches)
    lm = models.load_llm(config.model)
    float_entry = 2 * lm.config.head_dim * 2  # a key and a value at float16
    kv_heads, layers = lm.config.num_key_value_heads, lm.config.num_hidden_layers
    for record, built in zip(product.records, product.built):
        data = store.get(record.object_key)
        assert cache_format.read_header(data)["format"] == CODED_FORMAT
        assert max(record.entries_per_layer) <= config.entry_budget
        stored = read_stored_cache(store, record, lm.model)
        measured = cache_format.as_stored(built.cache, config.code)
        for got, want in zip(stored.layers, measured.layers):  # the very cache measured
            assert torch.equal(got.valid, want.valid)
            assert torch.equal(got.rope_positions[got.valid], want.rope_positions[want.valid])
            assert torch.equal(got.keys[0][got.valid], want.keys[0][want.valid].float())
            assert torch.equal(got.values[0][got.valid], want.values[0][want.valid].float())
        coded = cache_format.coded_kv_bytes(stored, config.code)
        if bytes_budget:  # more entries, in about the bytes of the budget's float entries
            assert max(record.entries_per_layer) > config.budget
            assert coded <= 1.1 * config.budget * kv_heads * layers * float_entry
        else:
            floats = sum(stored.entries_per_layer()) * kv_heads * float_entry
            # a code and a share of a float16 step and minimum a number, against float16's 2
            # bytes (the keys' last runs filled up: some slack)
            assert coded <= 1.1 * floats * config.code.bytes_per_number / 2 < floats

    store.delete(product.records[1].object_key)
    assert not is_built(store, conv.conversation_id, config, files_of(config), conv)
    repaired = build_conversation(conv, config, store).records
    assert [r.sha256 for r in repaired] == [r.sha256 for r in product.records]  # the very bytes


@pytest.mark.parametrize("code", [{}, {"bits": 4}], ids=["float16", "coded"])
def test_a_build_compressed_with_zstd_stores_fewer_bytes_of_the_same_caches(folders, tmp_path,
                                                                           code):
    """`code.zstd`: each object compressed whole, read back (and by the answer path's reader)
    as the uncompressed build's, to the bit; the compressed build is current over the plain
    store (the same hash), so a re-run with it keeps the stored objects."""
    plain_config, packed_config = coded_config(folders, **code), coded_config(folders, zstd=3,
                                                                              **code)
    conv = make_conversation("zstd-0", target_tokens=600, seed=5)
    plain_store, packed_store = LocalStore(tmp_path / "plain"), LocalStore(tmp_path / "packed")
    plain = build_conversation(conv, plain_config, plain_store).records
    packed = build_conversation(conv, packed_config, packed_store).records
    lm = models.load_llm(plain_config.model)
    for a, b in zip(plain, packed):
        assert packed_store.get(b.object_key)[:8] == ZSTD_MAGIC
        assert b.object_bytes < a.object_bytes
        one, other = (read_stored_cache(s, r, lm.model) for s, r in ((plain_store, a),
                                                                       (packed_store, b)))
        for x, y in zip(one.layers, other.layers):
            assert torch.equal(x.valid, y.valid) and torch.equal(x.keys, y.keys)
            assert torch.equal(x.values, y.values)
    assert packed_config.hash == plain_config.hash
    assert is_built(plain_store, conv.conversation_id, packed_config, files_of(packed_config),
                    conv)
