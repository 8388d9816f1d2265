"""The build configuration's hash and JSON as every build computed them before the hash covered
only what a build's method reads (`pipeline.config.hashing` at commit bf5f28c): every section
hashed for every method. The tests make stores with it, as those builds made them, and check
that today's code finds them current. A frozen copy: never change it to follow the code."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict
from typing import Any

from pipeline.config.format_version import FORMAT

ADDED_LATER = (("prefill", "compact_recent", 0),)
# Fields added to the configuration after this copy, at the value those builds ran with: a
# configuration of today holds them, the builds this copy stands for did not know them.
# (`pass_sinks`, `one_pass_beyond`: what today's block prefill holds, and never reads)
NOT_YET = (("prefill", "one_pass", False), ("prefill", "score_span", 0),
           ("prefill", "score_span_share", 1.0), ("prefill", "pass_sinks", 4),
           ("prefill", "one_pass_beyond", "blocks"), ("prefill", "shared_span", 0),
           ("prefill", "shared_span_most", 0), ("prefill", "pass_focus", None))
NOT_YET_SECTIONS = {"code": {"bits": 0, "group": 32, "bytes_budget": False, "float_sinks": 0,
                             "float_recent": 0, "value_bits": None, "zstd": None,
                             "rotate": False, "key_axis": "channel",
                             "double_quant": False, "rotate_values": False}}
RETIRED = (("scoring", "reduce", "max", True), ("scoring", "include_patch", True, True),
           ("scoring", "shared", 0.0, False), ("episodes", "adopt", False, False))


def legacy_stored_fields(config: Any) -> dict:
    """Every field as set, with the cache format, less the later fields at their earlier value
    (what those builds wrote as `config_json`)."""
    d = asdict(config) | {"format": FORMAT}
    for section, name, then in NOT_YET:
        if d[section].pop(name) != then:
            raise ValueError(f"{section}.{name} did not exist in those builds")
    for section, then in NOT_YET_SECTIONS.items():
        if d.pop(section) != then:
            raise ValueError(f"{section} did not exist in those builds")
    for section, name, earlier in ADDED_LATER:
        if d[section][name] == earlier:
            del d[section][name]
    return d


def legacy_json(config: Any) -> str:
    """The `config_json` those builds wrote."""
    return json.dumps(legacy_stored_fields(config), sort_keys=True)


def legacy_hash(config: Any) -> str:
    """The `config_hash` those builds wrote: every section, whatever the method read."""
    d = legacy_stored_fields(config)
    for section, name, value, hashed in RETIRED:
        if hashed:
            d[section][name] = value
    d["prefill"]["positions"] = config.prefill.position_mode
    if config.prefill.position_mode == "original":
        d["prefill"].pop("compact_recent", None)
    return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]
