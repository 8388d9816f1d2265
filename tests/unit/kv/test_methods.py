"""Every registered method through one matrix (kvpress's press matrix): each is a frozen
dataclass of its parameters, registered under its own name, and builds a cache within its
budget on a tiny model alone and under every compression that composes with it (tri-state, D2O
merging, DapQ, compact positions)."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest
import torch

from pipeline.config import MergeConfig, PrefillConfig, TriStateConfig
from pipeline.kv import methods
from pipeline.kv.methods.base import Method, MethodInputs
from pipeline.kv.methods.shaping import refocused
from pipeline.kv.prefill import block_prefill, entry_bytes
from pipeline.kv.tristate import layer_bytes
from tests.support.paths import REPO
from tests.support.tiny_models import random_ids, tiny_model

N, BUDGET, BLOCK = 120, 24, 32
COMPRESSIONS = {
    "plain": PrefillConfig(block=BLOCK, positions="original"),
    "compact": PrefillConfig(block=BLOCK, positions="compact", compact_recent=32),
    "tri-state": PrefillConfig(block=BLOCK, tristate=TriStateConfig(enabled=True)),
    "merge": PrefillConfig(block=BLOCK, merge=MergeConfig(enabled=True)),
    "dapq": PrefillConfig(block=BLOCK, decode_positions=True),
    "tri-state+merge": PrefillConfig(block=BLOCK, tristate=TriStateConfig(enabled=True),
                                     merge=MergeConfig(enabled=True)),
}


def _inputs() -> MethodInputs:
    """A build's inputs: a text patch, turns of 10 tokens, every other 30 tokens the episode's."""
    return MethodInputs(encode=lambda text: torch.tensor([3 + ord(c) % 100 for c in text]),
                        patch_text="what the episode is about", line_ids=torch.arange(N) // 10,
                        member=(torch.arange(N) // 30) % 2 == 0)


@pytest.fixture(scope="module")
def llama():
    return tiny_model("llama")


@pytest.mark.parametrize("name", sorted(methods.REGISTRY))
def test_a_method_is_a_frozen_dataclass_registered_under_its_name(name):
    cls = methods.method_class(name)
    assert issubclass(cls, Method) and cls.name == name
    method = methods.create(name)
    assert dataclasses.is_dataclass(method)
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(method, "name_of_no_field", 1)
    bound = method.bind(_inputs())
    assert bound is not None and hash(method) == hash(methods.create(name))
    if isinstance(bound, Method):  # what a build binds (a patch's ids) is not a parameter
        assert bound == method and hash(bound) == hash(method)


@pytest.mark.parametrize("compression", sorted(COMPRESSIONS))
@pytest.mark.parametrize("name", sorted(methods.REGISTRY))
def test_every_method_builds_within_its_budget_under_every_compression(llama, name, compression):
    config = COMPRESSIONS[compression]
    budgets = None if name == "full" else [BUDGET] * llama.config.num_hidden_layers
    scorer = methods.create(name).bind(_inputs())
    cache, stats = block_prefill(llama, random_ids(N, seed=5), scorer, budgets, config,
                                 original_element_size=2)
    assert cache.tokens_seen == N and stats.blocks == -(-N // BLOCK)
    heads, sizes = cache.layers[0].valid.shape[0], entry_bytes(llama, 2)
    for layer in cache.layers:
        held = layer.valid.sum(dim=1)
        if budgets is None:
            assert held.tolist() == [N] * heads
        elif config.tristate.enabled:  # a byte budget: the bytes of BUDGET Original entries
            assert layer_bytes(layer, sizes) <= BUDGET * heads * sizes.original
        else:
            assert 0 < int(held.sum()) <= BUDGET * heads
    again, _ = block_prefill(llama, random_ids(N, seed=5), methods.create(name).bind(_inputs()),
                             budgets, config, original_element_size=2)
    assert all(torch.equal(a.valid, b.valid) for a, b in zip(cache.layers, again.layers))


def test_the_registry_names_the_methods_without_importing_torch():
    code = ("import sys; from pipeline.kv import methods; "
            "assert 'epicache' in methods.REGISTRY; print('torch' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                          check=True)
    assert done.stdout.strip() == "False"


def test_an_unknown_method_names_the_known_ones():
    with pytest.raises(ValueError, match="unknown method 'h2o'; known: .*epicache"):
        methods.create("h2o")


def test_refocused_weights_the_episodes_own_turns_as_that_focus_would(llama):
    """`refocused` (the one pass's own focus, `PrefillConfig.pass_focus`) reaches the focus
    inside the default's shaping: the cache is the one `scoring.focus` of that weight makes."""
    budgets = [BUDGET] * llama.config.num_hidden_layers
    def built(scorer):
        cache, _ = block_prefill(llama, random_ids(N, seed=5), scorer, budgets,
                                 COMPRESSIONS["plain"])
        return [layer.valid for layer in cache.layers]
    epicache = methods.method_class("epicache")
    got = built(refocused(epicache().bind(_inputs()), 0.001))
    assert all(map(torch.equal, got, built(epicache(focus=0.001).bind(_inputs()))))
    assert not all(map(torch.equal, got, built(epicache().bind(_inputs()))))
    with pytest.raises(ValueError, match="pass_focus"):
        refocused(methods.create("snapkv").bind(_inputs()), 0.5)
