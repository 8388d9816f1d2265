"""What a build configuration's hash covers, and how configurations written by earlier builds
read back: the compatibility rules kept in one place, apart from the fields themselves.

Stores rely on the hash (a manifest carrying the current hash is not rebuilt), so a field added
after stores were built is hashed only where it differs from what every earlier build had
(`ADDED_LATER`), a configuration written before a field existed reads back with the value
those builds ran with (`PREFILL_BEFORE`, and the paper's scoring where `scoring` is missing),
and a knob retired since keeps hashing as every kept build had it (`RETIRED`).

A build's hash covers what its method reads (`pipeline.config.registry.reads`): a method
section it does not read (a baseline's `scoring` and `episodes`) is hashed as every build before
this rule hashed it, at the values in `UNREAD_AS`, whatever it holds, so a default changed
later re-keys only the methods that read it, and every store built before keeps its hash. A
method section registered later is left out of the hash of the methods that do not read it.
A manifest whose hash is not this build's is still current when the configuration it records,
read back under today's rules, hashes as this build (`is_current`): a baseline built with a
scoring option it never read, before the command line refused one, is not rebuilt.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict
from typing import Any

from pipeline.config import registry
from pipeline.config.format_version import FORMAT
from pipeline.config.stages import (
    CalibrationConfig,
    CodeConfig,
    EpisodeConfig,
    MergeConfig,
    PrefillConfig,
    ScoringConfig,
    TriStateConfig,
)

# (section, field, the value builds before the field had): hashed only when it differs
ADDED_LATER = (("prefill", "compact_recent", 0), ("prefill", "one_pass", False),
               ("prefill", "score_span", 0), ("prefill", "score_span_share", 1.0),
               ("code", "bits", 0), ("code", "group", 32),
               ("code", "bytes_budget", False), ("code", "float_sinks", 0),
               ("code", "float_recent", 0), ("code", "value_bits", None), ("code", "zstd", None),
               ("prefill", "pass_sinks", 0), ("prefill", "one_pass_beyond", "window"),
               ("code", "rotate", False), ("code", "key_axis", "channel"),
               ("code", "double_quant", False), ("code", "rotate_values", False),
               ("prefill", "shared_span", 0), ("prefill", "shared_span_most", 0),
               ("prefill", "pass_focus", None))
# (section, field, the value every build that `jobs.build` could make had, hashed or not): knobs
# measured and retired (docs/changelog.md). A hashed one is hashed with that value, so stores
# keep their hash; a stored configuration holding another value no longer reads back.
RETIRED = (("scoring", "reduce", "max", True), ("scoring", "include_patch", True, True),
           ("scoring", "shared", 0.0, False), ("episodes", "adopt", False, False))
# A method section as hashed for a method that does not read it: the values every build before
# hashes by capability had for it (the defaults then; `jobs.build` refused no option). Never
# change these: a baseline's hash would change, and every baseline store would be rebuilt.
UNREAD_AS = {
    "episodes": {"window": 4, "episodes": 4, "medoids": 4, "seed": 0, "n_init": 10},
    "scoring": {"pool": 0, "utterance": True, "focus": 10.0, "sink": 4, "recent": 0,
                "patch_tokens": 256},
}
# what a configuration written before a prefill field existed had (the defaults changed since):
# original positions, and each later field's earlier value
PREFILL_BEFORE = {"positions": "original"} | {name: earlier for section, name, earlier
                                             in ADDED_LATER if section == "prefill"}


def stored_fields(config: Any) -> dict:
    """Every field of a `BuildConfig` as set, with the cache format, less the fields added after
    stores were built where they hold the value every earlier build had."""
    d = asdict(config) | {"format": FORMAT}
    for section, name, earlier in ADDED_LATER:
        if d[section][name] == earlier:
            del d[section][name]
    if not d["code"]:  # a section added later, at every earlier build's values
        del d["code"]
    return d


def unread_as_before(d: dict, scorer: str) -> dict:
    """`d` (`stored_fields`) with each method section `scorer` does not read replaced by
    `UNREAD_AS` (left out where it has no entry: registered after this rule). An unregistered
    scorer keeps every section: what it reads is not known."""
    if scorer not in registry.METHODS:
        return d
    for section in registry.method_sections():
        if not registry.reads(scorer, section):
            d.pop(section, None)
            if section in UNREAD_AS:
                d[section] = dict(UNREAD_AS[section])
    return d


def hashed_fields(config: Any) -> dict:
    """The fields as hashed, by what decides the caches: the method sections the method reads
    (`unread_as_before`), positions as resolved (so "auto" and the mode it resolves to share a
    hash), `compact_recent` left out where the caches keep original positions, one pass's
    own fields where block prefill builds, and the code's group where the caches are stored
    as floats."""
    d = unread_as_before(stored_fields(config), config.scorer)
    for section, name, value, hashed in RETIRED:
        if hashed and section in d:
            d[section][name] = value
    d["prefill"]["positions"] = config.prefill.position_mode
    if config.prefill.position_mode == "original":  # no effect on such caches
        d["prefill"].pop("compact_recent", None)
    if not config.prefill.one_pass:  # block prefill never reads them
        for name in ("pass_sinks", "one_pass_beyond", "shared_span", "shared_span_most"):
            d["prefill"].pop(name, None)
    if not config.code.bits:  # floats: no groups
        d.pop("code", None)
    else:  # compression keeps the caches as they are: not hashed
        d["code"].pop("zstd", None)
    return d


def config_hash(config: Any) -> str:
    return hashlib.sha256(
        json.dumps(hashed_fields(config), sort_keys=True).encode()).hexdigest()[:16]


def is_current(config: Any, stored_hash: str, stored_json: str | None) -> bool:
    """Whether a manifest's configuration (its hash, and the JSON `stored_fields` wrote) is
    `config`'s build: the same hash, or a stored configuration of this cache format that reads
    back under today's rules and hashes as `config` (one that set a section its method never
    read). A configuration that no longer reads back (a retired knob's other value, a field
    unknown here) or of another cache format (read back, it would take this one's) is not."""
    if stored_hash == config.hash:
        return True
    try:
        fields = json.loads(stored_json or "null")
        if fields.get("format") != FORMAT:
            return False
        stored = type(config)(**stage_fields(fields))
    except (ValueError, TypeError, KeyError, AttributeError):
        return False
    return stored.hash == config.hash


def stage_fields(d: dict) -> dict:
    """The keyword arguments of a `BuildConfig` from its JSON dict (`stored_fields`, or one an
    earlier build wrote): each stage's object made, the fields it lacks as earlier builds had."""
    d = {key: dict(value) if isinstance(value, dict) else value for key, value in d.items()}
    d.pop("format", None)
    for section, name, value, _ in RETIRED:
        stored = d.get(section, {}).pop(name, value)
        if stored != value:
            raise ValueError(f"the configuration sets {section}.{name}={stored!r}, a knob retired "
                             "since (docs/changelog.md): rebuild with the current build")
    prefill = PREFILL_BEFORE | d.pop("prefill")
    prefill = PrefillConfig(tristate=TriStateConfig(**prefill.pop("tristate", {})),
                            merge=MergeConfig(**prefill.pop("merge", {})), **prefill)
    # a configuration written before `scoring` existed scored as the paper does
    scoring = ScoringConfig(**d.pop("scoring")) if "scoring" in d else ScoringConfig.paper()
    return d | {"episodes": EpisodeConfig(**d.pop("episodes")), "prefill": prefill,
                "code": CodeConfig(**d.pop("code", {})),
                "scoring": scoring, "calibration": CalibrationConfig(**d.pop("calibration"))}
