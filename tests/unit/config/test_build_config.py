"""The build configuration (`pipeline.config`): its hash stable across releases (stored manifests
carry it), changed by every field, its JSON read back, and the package light enough for a
command to parse its options before torch loads."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest

from pipeline.config import (
    BuildConfig,
    CalibrationConfig,
    CodeConfig,
    EpisodeConfig,
    MergeConfig,
    PrefillConfig,
    ScoringConfig,
    TriStateConfig,
)
from pipeline.config.hashing import ADDED_LATER
from pipeline.store.objects import low_bit
from tests.support.paths import REPO


def _changed(value):
    """A different value of the same kind."""
    if dataclasses.is_dataclass(value):
        return None  # handled field by field
    if isinstance(value, bool):
        return not value
    if isinstance(value, int):
        return value + 1
    if isinstance(value, float):  # a weight in (0, 1] stays one (merge beta)
        return value / 2 if 0 < value <= 1 else value + 0.5
    if isinstance(value, str):
        return {"float16": "bfloat16", "headwise": "perhead", "max": "mean",
                "original": "compact", "auto": "original"}.get(value, value + "-x")
    if value is None:
        return 7
    raise TypeError(value)


def _variants(config):
    """(path, config with that one field changed) for every field, nested ones included."""
    out = []
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if dataclasses.is_dataclass(value):
            for path, inner in _variants(value):
                out.append((f"{f.name}.{path}", dataclasses.replace(config, **{f.name: inner})))
        else:
            change = {f.name: _changed(value)} | NEEDS.get(f.name, {})
            out.append((f.name, dataclasses.replace(config, **change)))
    return out


# a field that is refused without another, or has no effect without it: changed together with
# it (or to a value it accepts)
NEEDS = {"score_span": {"one_pass": True}, "pass_sinks": {"one_pass": True},
         "pass_focus": {"pass_focus": 30.0, "one_pass": True},
         "one_pass_beyond": {"one_pass_beyond": "window", "one_pass": True},
         "shared_span": {"shared_span": 64, "one_pass_beyond": "shared", "one_pass": True},
         "shared_span_most": {"shared_span_most": 1024, "one_pass_beyond": "shared",
                              "one_pass": True},
         "score_span_share": {"score_span_share": 0.5, "score_span": 64, "one_pass": True},
         "bits": {"bits": 4}, "group": {"group": 64, "bits": 4},
         "bytes_budget": {"bytes_budget": True, "bits": 4},
         "float_sinks": {"float_sinks": 4, "bits": 4},
         "float_recent": {"float_recent": 16, "bits": 4},
         "value_bits": {"value_bits": 2, "bits": 4}, "rotate": {"rotate": True, "bits": 4},
         "key_axis": {"key_axis": "token", "bits": 4},
         "double_quant": {"double_quant": True, "bits": 4},
         "rotate_values": {"rotate_values": True, "bits": 4}}


def test_build_config_hash_is_stable():
    a, b = BuildConfig(), BuildConfig(episodes=EpisodeConfig(), prefill=PrefillConfig(),
                                      calibration=CalibrationConfig())
    assert a.hash == b.hash
    assert len(a.hash) == 16 and int(a.hash, 16) >= 0
    assert BuildConfig.from_json(a.to_json()).hash == a.hash


# Every field given explicitly, so a change of a default value does not move this hash, but a
# change of what is hashed does: a field added, removed or renamed, FORMAT, the JSON encoding.
PINNED_CONFIG = BuildConfig(
    model="SmolLM2-135M-Instruct", encoder="all-MiniLM-L6-v2", scorer="epicache", budget=512,
    alpha=1.5, allocator="sensitivity", variance_temperature=1.0, store_dtype="float16",
    max_context_tokens=16000,
    episodes=EpisodeConfig(window=4, episodes=3, medoids=2, seed=7, n_init=10),
    scoring=ScoringConfig(pool=0, utterance=True, focus=10.0,
                          sink=4, recent=32, patch_tokens=256),
    prefill=PrefillConfig(block=256, selection="headwise", head_floor=0.1, decode_positions=False,
                          positions="original",
                          tristate=TriStateConfig(enabled=True, fp8=False, window=32, gamma=263.81,
                                                  tau_entropy=7.774, tau_variance=5.407,
                                                  tau_kurtosis=5.528, original_scale=1.0,
                                                  slack=0.75, heavy_hitter=True),
                          merge=MergeConfig(enabled=False, beta=0.7, min_threshold=-1.0)),
    calibration=CalibrationConfig(tokens=2048, sink=64, window=512, seed=0))
# CHANGE ON PURPOSE ONLY. Every stored manifest carries its configuration's hash, and a build
# rebuilds every conversation whose hash differs: a new literal here means every existing store
# is rebuilt. When the configuration's format changes on purpose (a field added to BuildConfig
# or to one of its parts, cache_format.FORMAT bumped), set the new field in PINNED_CONFIG above and
# put the new hash here, and say so in the change.
PINNED_HASH = "3930c653d0aa42f3"  # prefill.positions added (compact positions)


def test_build_config_hash_of_a_fixed_configuration_is_pinned():
    """The hash of a fixed configuration is a literal: a change that would silently invalidate
    every stored manifest fails here instead."""
    assert PINNED_CONFIG.hash == PINNED_HASH, (
        f"the configuration hash changed ({PINNED_CONFIG.hash}); every stored manifest would be "
        f"rebuilt. If that is intended, update PINNED_HASH. Hashed JSON: {PINNED_CONFIG.to_json()}")


# fields that change how the caches are stored, not the caches: left out of the hash, so a
# store built without them is not rebuilt (a reader reads either)
UNHASHED = {"code.zstd"}


def test_build_config_hash_changes_with_every_field():
    """Changing any one field, at any depth, changes the hash (but those `UNHASHED`); all
    variants differ."""
    base = BuildConfig()
    variants = [(path, v) for path, v in _variants(base) if path not in UNHASHED]
    paths = [p for p, _ in variants]
    assert {"model", "budget", "alpha", "store_dtype", "episodes.window", "episodes.seed",
            "scoring.focus", "scoring.utterance", "prefill.head_floor",
            "prefill.block", "prefill.selection", "prefill.positions", "calibration.sink",
            "code.bits", "code.group"} <= set(paths)
    hashes = [v.hash for _, v in variants]
    assert base.hash not in hashes
    assert len(set(hashes)) == len(hashes)
    assert BuildConfig(budget=None).hash != base.hash


@pytest.mark.parametrize("code", [CodeConfig(), CodeConfig(bits=4, value_bits=2)])
def test_compressing_the_stored_objects_keeps_the_hash(code):
    """zstd stores the same caches in fewer bytes: a build with it is current over a store
    built without it (and back), floats or codes; its level is recorded in the JSON."""
    plain = BuildConfig(code=code)
    packed = BuildConfig(code=dataclasses.replace(code, zstd=3))
    assert packed.hash == plain.hash
    assert json.loads(packed.to_json())["code"]["zstd"] == 3
    assert "zstd" not in json.loads(plain.to_json()).get("code", {})
    assert BuildConfig.from_json(packed.to_json()) == packed
    with pytest.raises(ValueError, match="zstd level"):
        CodeConfig(zstd=23)


@pytest.mark.parametrize("config", [
    BuildConfig(),
    BuildConfig(budget=None, alpha=0.0, store_dtype="float32", scorer="streamingllm"),
    BuildConfig(model="/models/x", budget=256, alpha=2.5,
                episodes=EpisodeConfig(window=6, episodes=3),
                prefill=PrefillConfig(block=128, selection="perhead"),
                calibration=CalibrationConfig(tokens=2048, sink=64, window=512, seed=3)),
    BuildConfig(scoring=ScoringConfig.paper(), episodes=EpisodeConfig(medoids=2)),
])
def test_build_config_json_round_trip(config):
    back = BuildConfig.from_json(config.to_json())
    assert back == config and back.hash == config.hash


def test_a_retired_knob_reads_back_at_its_one_value_and_refuses_another():
    """Configurations written before `scoring.reduce`, `scoring.include_patch`, `scoring.shared`
    and `episodes.adopt` were retired read back (with the same hash) where they hold the value
    every build had; another value is a clear error, not a silent other build."""
    written = json.loads(BuildConfig().to_json())
    written["scoring"] |= {"reduce": "max", "include_patch": True, "shared": 0.0}
    written["episodes"]["adopt"] = False
    back = BuildConfig.from_json(json.dumps(written))
    assert back == BuildConfig() and back.hash == BuildConfig().hash
    for section, name, other in (("scoring", "shared", 0.25), ("scoring", "reduce", "mean"),
                                 ("episodes", "adopt", True)):
        changed = json.loads(BuildConfig().to_json())
        changed[section][name] = other
        with pytest.raises(ValueError, match=f"{section}.{name}=.*retired"):
            BuildConfig.from_json(json.dumps(changed))


def test_auto_positions_hash_as_what_they_resolve_to():
    """`auto` (the default) is compact positions, or original where the entries cannot be
    re-rotated, with the reason for the manifest; either way it shares the hash of the mode it
    resolves to, and `compact_recent` is not hashed under original positions."""
    tri = TriStateConfig(enabled=True)
    compact = PrefillConfig(positions="compact", compact_recent=2048)
    assert PrefillConfig().position_mode == "compact" and PrefillConfig().positions_note is None
    assert BuildConfig().hash == BuildConfig(prefill=compact).hash
    auto = PrefillConfig(decode_positions=True)
    original = PrefillConfig(decode_positions=True, positions="original", compact_recent=0)
    assert auto.position_mode == "original"
    assert "original positions" in auto.positions_note and original.positions_note is None
    assert BuildConfig(prefill=auto).hash == BuildConfig(prefill=original).hash
    with pytest.raises(ValueError, match="DapQ"):
        PrefillConfig(decode_positions=True, positions="compact")
    assert PrefillConfig(tristate=tri).position_mode == "compact"  # Quantized keys re-rotated
    # a configuration written before positions existed (or before compact_recent) reads back
    # as what those builds were: original positions, every compacted entry packed
    old = json.loads(BuildConfig(prefill=compact).to_json())
    del old["prefill"]["positions"], old["prefill"]["compact_recent"]
    back = BuildConfig.from_json(json.dumps(old)).prefill
    assert (back.positions, back.compact_recent) == ("original", 0)


@pytest.mark.parametrize("name, then", [("pass_sinks", 0), ("one_pass_beyond", "window")])
def test_one_pass_fields_are_hashed_in_one_pass_builds_only(name, then):
    """Block prefill never reads `pass_sinks` or `one_pass_beyond`: its builds keep their hash
    whatever they hold, and one written before the field existed is current; a one-pass build
    from before the field (its JSON without it) ran as `then` (no sinks; a window past the
    first span), so it is not today's one pass."""
    assert BuildConfig(prefill=PrefillConfig(**{name: then})).hash == BuildConfig().hash
    block_before = json.loads(BuildConfig().to_json())
    del block_before["prefill"][name]
    assert BuildConfig().matches("0" * 16, json.dumps(block_before))
    one_pass = BuildConfig(prefill=PrefillConfig(one_pass=True))
    assert BuildConfig.from_json(one_pass.to_json()) == one_pass
    before = json.loads(one_pass.to_json())
    del before["prefill"][name]
    back = BuildConfig.from_json(json.dumps(before))
    assert getattr(back.prefill, name) == then and back.hash != one_pass.hash
    assert not one_pass.matches("0" * 16, json.dumps(before))
    with pytest.raises(ValueError, match="pass_sinks"):
        PrefillConfig(pass_sinks=-1)


def test_build_config_validates():
    with pytest.raises(ValueError):
        BuildConfig(budget=0)
    with pytest.raises(ValueError):
        BuildConfig(alpha=-1.0)
    with pytest.raises(ValueError):
        BuildConfig(store_dtype="int4")


def test_a_configuration_from_before_later_fields_reads_back_as_those_builds_ran():
    """A configuration written before `scoring` or a later field existed reads back with the
    paper's scoring and each later field's earlier value, and hashes as it did then."""
    old = json.loads(BuildConfig().to_json())
    del old["scoring"], old["prefill"]["positions"]
    for section, name, _ in ADDED_LATER:
        old.get(section, {}).pop(name, None)
    back = BuildConfig.from_json(json.dumps(old))
    assert back.scoring == ScoringConfig.paper() and back.prefill.positions == "original"
    for section, name, earlier in ADDED_LATER:
        assert getattr(getattr(back, section), name) == earlier
        # not hashed at its earlier value (a section added later: not at all)
        assert name not in json.loads(back.to_json()).get(section, {})


def test_the_package_loads_without_torch():
    """Commands parse their options with these before torch, transformers or Ray load."""
    code = ("import sys, pipeline.config, pipeline.config.fields; "
            "print(sorted(m for m in ('torch', 'transformers', 'ray') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert done.stdout.strip() == "[]", done.stderr


@pytest.mark.parametrize("code", [CodeConfig(bits=4, bytes_budget=True),
                                  CodeConfig(bits=4, bytes_budget=True, float_sinks=4,
                                             float_recent=16),
                                  CodeConfig(bits=4, value_bits=2, group=64, bytes_budget=True,
                                             float_sinks=4, float_recent=16)])
def test_a_budget_in_bytes_keeps_the_entries_those_bytes_hold(code):
    """`code.bytes_budget`: the entries kept take the bytes of `budget` float16 entries, the
    float entries counted at float16 (more floats, fewer entries), within a key group's
    rounding of the budget."""
    config = BuildConfig(budget=512, code=code)
    kept, head_dim, heads = config.entry_budget, 64, 3
    stored = low_bit.coded_bytes([kept] * heads, head_dim, code)
    budget = heads * 512 * 2 * head_dim * 2
    assert kept > 512 and budget * 0.97 < stored <= budget * 1.02
    assert stored > low_bit.coded_bytes([kept - 8] * heads, head_dim, code)
