"""An episodic cell's reads and each routing variant's selection from them (pipeline.eval.episode_reads)."""

from __future__ import annotations

import numpy as np
import pytest

from pipeline.config import RoutingConfig, TopUpConfig
from pipeline.eval.episode_reads import READ_FIELDS, candidate_pairs, select_route
from pipeline.eval.methods import EvalConfig
from pipeline.eval.report import records_parquet
from pipeline.eval.runner import kept_cell
from pipeline.store.local import LocalStore


def _record() -> dict:
    """Three episodes; the evidence is in episode 2. The centroid router is sure of 0; the
    window router is unsure between 1 and 2."""
    per = {f: [10.0, 11.0, 12.0] for f in READ_FIELDS}
    return {**{f"episode_{f}": v for f, v in per.items()},
            **{f"pair_{f}": [21.0, 30.0] for f in READ_FIELDS},
            "pair_a": [0, 1], "pair_b": [1, 2], "episode_hit": [False, False, True],
            "scores_centroid": [0.9, 0.5, 0.4], "scores_window": [0.3, 0.70, 0.69],
            "scores_knn": [1.0, 0.0, 0.0], "scores_expand": [0.9, 0.5, 0.4],
            "scores_expandwin": [0.3, 0.7, 0.69], "method": "epicache"}


def test_each_routing_variant_selects_its_read_from_the_same_cell():
    # the episodes' own reads (no top-up: the next test has the top-up's)
    config = EvalConfig(routing=RoutingConfig("window", 0.02), topup=TopUpConfig(enabled=False))
    centroid = select_route(_record(), "epicache+routing.router=centroid+routing.two_below=0", config)
    assert (centroid["episode"], centroid["episodes_read"], centroid["route_hit"]) == (0, 1, False)
    assert centroid["evidence_nll"] == 10.0 and centroid["method"] == \
        "epicache+routing.router=centroid+routing.two_below=0"
    window = select_route(_record(), "epicache", config)  # the default: window, two when unsure
    assert (window["episode"], window["episodes_read"], window["route_hit"]) == (1, 2, True)
    assert window["evidence_nll"] == 30.0 and window["kv_bytes"] == 30.0
    sure = select_route(_record(), "epicache+routing.two_below=0.005", config)
    assert (sure["episode"], sure["episodes_read"], sure["evidence_nll"]) == (1, 1, 11.0)
    paper = select_route(_record(), "epicache-paper", config)  # the paper's nearest centroid
    assert (paper["episode"], paper["episodes_read"]) == (0, 1)
    assert select_route({"method": "snapkv", "evidence_nll": 1.0}, "snapkv", config) == \
        {"method": "snapkv", "evidence_nll": 1.0}


def test_routing_overrides_parse():
    assert EvalConfig().route_of("epicache+routing.router=window+routing.two_below=0.035") == \
        ("window", 0.035)
    assert EvalConfig().route_of("epicache") == ("window", 0.02)
    with pytest.raises(ValueError, match="router must be one of"):
        EvalConfig().route_of("epicache+routing.router=knn")


def test_each_method_keeps_its_positions():
    """`epicache` keeps the library's default positions (compact, the last 2,048 tokens at their
    spacing); `epicache-orig` original positions; the baselines and the paper's recipe keep
    original positions unless overridden; where entries cannot be re-rotated the default falls
    back to original."""
    config = EvalConfig()
    mode = lambda m: (config.build_config(m, 512).prefill.position_mode,  # noqa: E731
                      config.build_config(m, 512).as_dict()["prefill"].get("compact_recent"))
    compact = "+prefill.positions=compact+prefill.compact_recent="
    assert mode("epicache") == mode(f"epicache{compact}2048") == ("compact", 2048)
    assert config.build_config("epicache", 512).hash == \
        config.build_config(f"epicache{compact}2048", 512).hash
    for original in ("epicache-orig", "epicache-paper", "keydiff", "snapkv", "epicache-tri",
                     "epicache-dapq", "full"):
        assert mode(original) == ("original", None), original
    assert mode(f"keydiff{compact}0") == ("compact", None)  # all packed (0: not hashed)
    assert mode(f"streamingllm{compact}512") == ("compact", 512)
    with pytest.raises(ValueError, match="compact positions work with token eviction only"):
        config.build_config(f"epicache-tri{compact}0", 512)


def test_the_two_episode_reads_are_each_routers_best_two():
    scores = {"centroid": np.array([[0.9, 0.5, 0.4], [0.1, 0.2, 0.3]]),
              "window": np.array([[0.3, 0.7, 0.69], [0.1, 0.2, 0.3]])}
    assert candidate_pairs(scores) == {(0, 1): [0], (1, 2): [0, 1]}


def test_an_episodic_cell_kept_before_every_route_was_measured_is_computed_again(tmp_path):
    kept = LocalStore(tmp_path)
    old = [{"method": "epicache", "episode": 1, "route_hit": True, "evidence_nll": 2.0}]
    baseline = [{"method": "snapkv", "episode": 0, "route_hit": None, "evidence_nll": 3.0}]
    kept.put("cells/old.parquet", records_parquet(old))
    kept.put("cells/snapkv.parquet", records_parquet(baseline))
    kept.put("cells/new.parquet", records_parquet([_record() | {"episode": 1, "route_hit": True}]))
    assert kept_cell(kept, "cells/old.parquet") is None
    assert kept_cell(kept, "cells/missing.parquet") is None
    assert kept_cell(kept, "cells/snapkv.parquet") == baseline
    assert kept_cell(kept, "cells/new.parquet")[0]["scores_centroid"] == [0.9, 0.5, 0.4]


def test_a_top_up_variant_selects_its_own_fields_from_the_same_cell():
    """`epicache` (the default: topped up) and `epicache-episode` (the episode alone) share one
    cell: the top-up's reads are fields of their own, selected by the same route."""
    from pipeline.eval.methods import topup_prefix

    config = EvalConfig(routing=RoutingConfig("window", 0.02))
    topup = config.topup_of("epicache")
    assert topup is not None and topup.enabled and config.topup_of("epicache-episode") is None
    assert config.topup_of("epicache-paper") is None  # the paper reads its episode alone
    assert config.topup_of("snapkv+topup.enabled=true") is None  # episodic methods only
    assert config.topup_of("epicache+topup.max_tokens=64").max_tokens == 64
    prefix = topup_prefix(topup, ("window", 0.02))
    nan = float("nan")  # a top-up is measured on the read its route picks only
    record = _record() | {f"{prefix}episode_{f}": [nan, nan, nan] for f in READ_FIELDS} \
        | {f"{prefix}pair_{f}": [nan, 5.0] for f in READ_FIELDS}
    plain, topped = (select_route(record, m, config) for m in ("epicache-episode", "epicache"))
    assert (plain["episode"], plain["episodes_read"]) == (topped["episode"], topped["episodes_read"])
    assert plain["evidence_nll"] == 30.0 and topped["evidence_nll"] == 5.0
    assert topup_prefix(topup, ("window", 0.02)) != \
        topup_prefix(config.topup_of("epicache+topup.turns=8"), ("window", 0.02))
    assert topup_prefix(topup, ("window", 0.02)) != topup_prefix(topup, ("centroid", 0.0))
    with pytest.raises(ValueError, match="no configuration field"):
        EvalConfig().topup_of("epicache+topup.bogus=1")
