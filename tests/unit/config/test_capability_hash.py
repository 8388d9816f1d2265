"""The build hash covers what the build's method reads (`pipeline.config.registry.reads`): a
section only other methods read leaves it alone, and every store built before keeps its hash
(`pipeline.config.hashing.UNREAD_AS`), or is found current from the configuration it records
(`BuildConfig.matches`). `tests/support/legacy_hash.py` is the hash those stores carry."""

from __future__ import annotations

import copy
import dataclasses
import json

import pytest

from pipeline.config import (
    BuildConfig,
    EpisodeConfig,
    PrefillConfig,
    ScoringConfig,
    TriStateConfig,
    registry,
)
from pipeline.config.hashing import UNREAD_AS, unread_as_before
from pipeline.kv.methods import buildable
from tests.support.legacy_hash import legacy_hash, legacy_json

# The hashes of `jobs.build --scorer M` (then with --budget 512, --full, --tristate, --positions
# original), as the build computed them before this rule (commit bf5f28c): the stores those
# commands built carry them. CHANGE ON PURPOSE ONLY: a default that the method reads changed.
# (--tristate alone built original positions then; it builds compact ones since its Quantized
# keys are re-rotated, a new build on purpose: its stores are those of --tristate --positions
# original.)
PINNED = {
    "epicache": ("b56c12bbb09e2611", "fa6ffef6583a5278", "d5b613aed19d8aed", "a63a2dca465858bd",
                 "96f76004d3580a8c"),
    "full": (None, "7182b9e2cc8aebb6", "8066750b4eb28a87", "fd6b21bd4cafc84c", "ca301cd4f1d0f7d4"),
    "infinipot": ("76807ea44511f1b2", "efcc5f0fd51b4a3c", "b9fdbd95747c3a93", "be62de7a16b304c1",
                  "e8f9c7aba7471cad"),
    "keydiff": ("90259f14b4ba28cf", "951005e9c7096fb9", "99ecb179acf88afa", "34437ad985b1e3ba",
                "08ee611e05098173"),
    "knorm": ("ba877abec924747b", "79457b7bd0fe8533", "c16ef8a0fbf17eb5", "f89299a6e3d278b0",
              "0d7efe76b8636b89"),
    "kvzip": ("c436d5d44b394592", "c718aa1fbdc8834d", "2aa9b27858049605", "ea489d49e3c3df00",
              "b07b7b0e13d9e310"),
    "oldest": ("81182eef3be20601", "3f433d577e793b79", "a5b0cbccae52a394", "4073928340767054",
               "6a8a7838ebda407b"),
    "random": ("229f2a3fcb5fff7b", "645107afba070822", "23f2d8053546816d", "cc2ca1cd79255acb",
               "d1486e7c1643523d"),
    "snapkv": ("44227175b0bc468d", "561a80b313b8d2d3", "56769133a66cd8a7", "51a0f4aa512dadb6",
               "a8aa7393cfc1748d"),
    "streamingllm": ("4dde45eee7813f25", "c7e315b10509a876", "4edb3cae52dfe482",
                     "a03d443eb6f2d631", "3d2044f2998695ec"),
}


def _commands(method: str) -> list[BuildConfig]:
    """What `jobs.build --scorer M` builds, then with --budget 512, --full, --tristate
    --positions original and --positions original."""
    base = BuildConfig(scorer=method)
    return [base, dataclasses.replace(base, budget=512), dataclasses.replace(base, budget=None),
            dataclasses.replace(base, prefill=PrefillConfig(tristate=TriStateConfig(enabled=True),
                                                            positions="original")),
            dataclasses.replace(base, prefill=PrefillConfig(positions="original",
                                                            compact_recent=0))]


def test_every_buildable_method_is_pinned():
    assert set(PINNED) == set(buildable())


@pytest.mark.parametrize("method", sorted(PINNED))
def test_the_stores_of_every_command_still_accepted_keep_their_hash(method):
    """The default method with its defaults, and every baseline at its defaults, hash as their
    stores were built (`--scorer full` alone evicted by equal scores: it is now built without a
    budget, as `--scorer full --full` was)."""
    for config, pinned in zip(_commands(method), PINNED[method]):
        if pinned is not None:
            assert config.hash == pinned == legacy_hash(config), (method, config)


def _one_field_changed(config):
    """(path, config with that one field changed) for a field of every section, nested too."""
    changes = {"budget": 512, "alpha": 1.0, "store_dtype": "float32", "max_context_tokens": 7600,
               "allocator": "variance", "episodes.episodes": 3, "episodes.window": 6,
               "episodes.medoids": 2, "episodes.seed": 3, "scoring.focus": 3.0,
               "scoring.pool": 7, "scoring.patch_tokens": None, "scoring.utterance": False,
               "prefill.block": 256, "prefill.selection": "perhead", "calibration.tokens": 2048}
    out = []
    for path, value in changes.items():
        section, _, name = path.rpartition(".")
        if section:
            inner = dataclasses.replace(getattr(config, section), **{name: value})
            out.append((path, dataclasses.replace(config, **{section: inner})))
        else:
            out.append((path, dataclasses.replace(config, **{name: value})))
    return out


# a build before this rule at the values its unread sections were hashed with
BEFORE = BuildConfig(episodes=EpisodeConfig(**UNREAD_AS["episodes"]),
                     scoring=ScoringConfig(**UNREAD_AS["scoring"]))


@pytest.mark.parametrize("method", buildable())
def test_a_method_hashes_what_it_reads_as_before_and_nothing_else(method):
    """A field the method reads changes the hash exactly as it did (the hash before, every
    section hashed); a field of a section only other methods read changes nothing."""
    base = dataclasses.replace(BEFORE, scorer=method)
    for path, changed in _one_field_changed(base):
        if path == "budget":  # hashed for every method: the command line refuses it for `full`
            assert changed.hash == legacy_hash(changed) != base.hash
        elif registry.reads(method, path):
            assert changed.hash == legacy_hash(changed) != base.hash, path
        else:
            assert changed.hash == base.hash != legacy_hash(changed), path


def test_a_scoring_default_changed_would_re_key_only_its_readers():
    """The baselines hash `scoring` and `episodes` at `UNREAD_AS`, whatever the defaults become."""
    other = ScoringConfig(focus=2.0, patch_tokens=128)
    for method in buildable():
        changed = BuildConfig(scorer=method, scoring=other).hash != BuildConfig(scorer=method).hash
        assert changed == (method in registry.readers("scoring")), method


def test_a_method_section_registered_later_is_hashed_by_its_readers_only(monkeypatch):
    monkeypatch.setitem(registry.METHODS, "toy", registry.Registered("toy:Toy", section="toy"))
    fields = {"episodes": {"window": 9}, "scoring": {"focus": 1.0}, "toy": {"knob": 1},
              "prefill": {"block": 64}}
    snapkv = unread_as_before(copy.deepcopy(fields), "snapkv")
    assert "toy" not in snapkv and snapkv["scoring"] == UNREAD_AS["scoring"]
    assert snapkv["prefill"] == {"block": 64}
    toy = unread_as_before(copy.deepcopy(fields), "toy")
    assert toy["toy"] == {"knob": 1} and toy["episodes"] == UNREAD_AS["episodes"]
    epicache = unread_as_before(copy.deepcopy(fields), "epicache")
    assert "toy" not in epicache and epicache["scoring"] == {"focus": 1.0}


def test_an_unregistered_scorer_hashes_every_section():
    config = BuildConfig(scorer="not-registered", scoring=ScoringConfig(focus=2.0))
    assert config.hash == legacy_hash(config)


def test_a_stored_configuration_is_current_when_it_hashes_as_this_build_today():
    """A baseline built with a scoring or episodes option it never read (the command line
    took one then) is this build; a configuration that differs in what the method reads, or
    that no longer reads back, is not."""
    snapkv = BuildConfig(scorer="snapkv")
    old = BuildConfig(scorer="snapkv", scoring=ScoringConfig(focus=3.0),
                      episodes=EpisodeConfig(episodes=3))
    assert legacy_hash(old) != snapkv.hash
    assert snapkv.matches(legacy_hash(old), legacy_json(old))
    assert snapkv.matches(snapkv.hash, None)
    epicache_old = BuildConfig(scoring=ScoringConfig(focus=3.0))
    assert not BuildConfig().matches(legacy_hash(epicache_old), legacy_json(epicache_old))
    other_budget = dataclasses.replace(old, budget=512)
    assert not snapkv.matches(legacy_hash(other_budget), legacy_json(other_budget))
    retired = json.loads(legacy_json(old))
    retired["scoring"]["shared"] = 0.5  # a retired knob at another value: no longer reads back
    other_format = json.loads(legacy_json(old)) | {"format": "epicache-kv/1"}
    no_format = {k: v for k, v in json.loads(legacy_json(old)).items() if k != "format"}
    for stored in (retired, other_format, no_format):
        assert not snapkv.matches("0" * 16, json.dumps(stored))
    for text in ("not json", "{}", "[]", "null", None, ""):
        assert not snapkv.matches("0" * 16, text)
