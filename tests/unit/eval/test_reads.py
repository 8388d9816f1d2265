"""A cell's reads (pipeline.eval.reads): each method's route and top-up measured once, on the
cache it picks, and each method's record selected from its cell's."""

from __future__ import annotations

import pytest

from pipeline.answer.topup import TopUp
from pipeline.config import RoutingConfig, TopUpConfig
from pipeline.eval.methods import EvalConfig, Read
from pipeline.eval.reads import CellCaches, measure_reads, select_read
from pipeline.eval.report import records_parquet
from pipeline.eval.runner import kept_cell
from pipeline.store.backends.local import LocalStore

CONFIG = EvalConfig(routing=RoutingConfig("window", 0.02))
# three episodes; the centroid router is sure of 0, the window router unsure between 1 and 2
SCORES = {"centroid": [[0.9, 0.5, 0.4]], "window": [[0.3, 0.70, 0.69]]}


def _measured(methods: list[str], calls: list | None = None) -> dict:
    """One question's cell record over fake caches: each cache's `nll` is 10 + its episodes'
    sum (a joined pair: 20 + ...); a top-up lowers it by 5."""
    calls = [] if calls is None else calls

    def measure(cache, indices, topups, answer):
        calls.append((cache, len(indices)))
        return [{"evidence_nll": cache - (5.0 if t.text else 0.0), "kept_entries": cache,
                 "topup_tokens": t.tokens} for t in topups]

    def choice(read: Read, i: int):
        from pipeline.routers import chosen
        return chosen(SCORES[read.route[0]][i], read.route[1])

    caches = CellCaches(lambda key: 10.0 * len(key) + sum(key), choice,
                        lambda key: {f"turn-{k}" for k in key})
    reads = tuple(dict.fromkeys(CONFIG.read_of(m) for m in methods))
    topup = lambda config, i, held: TopUp("more turns", ("t",), 7, "used")  # noqa: E731
    [record] = measure_reads(1, reads, caches, measure, topup)
    return record | {"episode_hit": [False, False, True], "method": methods[0],
                     **{f"scores_{k}": v[0] for k, v in SCORES.items()}}


def test_each_read_is_measured_once_on_the_cache_its_route_picks():
    methods = ["epicache", "epicache-episode",
               "epicache+routing.router=centroid+routing.two_below=0"]
    calls = []
    record = _measured(methods, calls)
    # window: episodes 1 and 2 joined (21.0), both reads there in one pass; centroid: episode 0
    assert sorted(calls) == [(10.0, 1), (23.0, 2)]
    window = select_read(record, "epicache", CONFIG)
    assert (window["episode"], window["episodes_read"], window["route_hit"]) == (1, 2, True)
    assert window["evidence_nll"] == 18.0 and window["topup_tokens"] == 7
    assert not any(k.startswith("read") and k != "read" for k in window)  # no other read's
    episode = select_read(record, "epicache-episode", CONFIG)
    assert episode["evidence_nll"] == 23.0 and episode["topup_tokens"] == 0
    centroid = select_read(record, methods[2], CONFIG)
    assert (centroid["episode"], centroid["episodes_read"], centroid["route_hit"]) == (0, 1, False)
    assert centroid["evidence_nll"] == 5.0 and centroid["method"] == methods[2]
    with pytest.raises(KeyError, match="holds no read"):
        select_read(record, "epicache+routing.two_below=0.005", CONFIG)


def test_reads_are_named_by_route_and_top_up():
    default = CONFIG.read_of("epicache")
    assert default == Read(("window", 0.02), TopUpConfig())
    assert CONFIG.read_of("epicache-episode") == Read(("window", 0.02), None)
    assert CONFIG.read_of("snapkv") == Read(None, None)
    # a cache of no episodes holds no turn to skip: one read whatever skip_held says
    nearest = Read(None, TopUpConfig(skip_held=True))
    assert CONFIG.read_of("snapkv+topup.enabled=true") == nearest == \
        CONFIG.read_of("snapkv+topup.enabled=true+topup.skip_held=false")
    assert CONFIG.read_of("rag") == CONFIG.read_of("full+topup.enabled=true") == nearest
    assert CONFIG.read_of("epicache+topup.skip_held=true").prefix != default.prefix
    assert CONFIG.read_of("none") == Read(None, None)
    prefixes = {Read(None, None).prefix, default.prefix, CONFIG.read_of("epicache-episode").prefix,
                CONFIG.read_of("epicache+topup.turns=4").prefix,
                CONFIG.read_of("epicache+routing.router=centroid").prefix,
                CONFIG.read_of("snapkv+topup.enabled=true").prefix}
    assert len(prefixes) == 6 and all(p.startswith("read") and p.endswith("_") for p in prefixes)


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
    assert mode("epicache-tri") == ("compact", 2048)  # its Quantized keys re-rotated too
    for original in ("epicache-orig", "epicache-paper", "keydiff", "snapkv", "epicache-dapq",
                     "full", "rag"):
        assert mode(original) == ("original", None), original
    assert mode(f"keydiff{compact}0") == ("compact", None)  # all packed (0: not hashed)
    assert mode(f"streamingllm{compact}512") == ("compact", 512)
    with pytest.raises(ValueError, match="compact positions work with token eviction only"):
        config.build_config(f"epicache-dapq{compact}0", 512)


def test_a_cell_kept_without_a_read_its_methods_make_is_computed_again(tmp_path):
    kept = LocalStore(tmp_path)
    record = _measured(["epicache"])
    kept.put("cells/new.parquet", records_parquet([record]))
    kept.put("cells/old.parquet", records_parquet([{"method": "epicache", "evidence_nll": 2.0}]))
    episode = CONFIG.read_of("epicache-episode")
    assert kept_cell(kept, "cells/new.parquet", (CONFIG.read_of("epicache"),))[0] == record
    assert kept_cell(kept, "cells/new.parquet", (episode,)) is None  # not measured there
    assert kept_cell(kept, "cells/old.parquet", (episode,)) is None  # before reads
    assert kept_cell(kept, "cells/missing.parquet") is None


def test_a_cell_that_generates_answers_is_kept_apart_and_serves_a_run_that_does_not(tmp_path):
    """The answers a cell generates (F1) are in its key: a run that asks for them never reads
    a cell kept without them; a run that does not may read one kept with them."""
    from pipeline.eval.runner import Cell, kept_or_none

    answering = EvalConfig(generate=True, generate_questions=2, generate_methods=("epicache",))
    plain, with_answers = Cell("c", 512, "cells/c/d/x.parquet", []), \
        Cell("c", 512, "cells/c/d/x.parquet", [])
    for cell, config in ((plain, CONFIG), (with_answers, answering)):
        cell.add("epicache", config)
        cell.add("epicache-episode", config)
    assert plain.key == "cells/c/d/x.parquet" and with_answers.answered == \
        (answering.read_of("epicache"),)
    assert with_answers.key.startswith("cells/c/d/x-answers") and with_answers.key != plain.key
    kept = LocalStore(tmp_path)
    record = _measured(["epicache", "epicache-episode"])
    kept.put(with_answers.key, records_parquet([record]))
    assert kept_or_none(kept, plain)[0] == record  # answers kept beside: read back
    other = Cell("c", 512, "cells/c/d/x.parquet", [])
    other.add("epicache", EvalConfig(generate=True, generate_questions=3,
                                     generate_methods=("epicache",)))
    assert kept_or_none(kept, other) is None  # other answers asked for: computed again


def test_a_cell_key_holds_everything_its_records_depend_on():
    """The oracle window picks the questions every cell measures, and the encoder chooses the
    top-up any cell's reads may read: changing either gives every cell a new key (a cell kept
    before would pair other questions, or stale top-ups)."""
    from pipeline.corpus.synthetic import make_corpus
    from pipeline.eval.methods import NO_HISTORY
    from pipeline.eval.runner import cell_key, conversation_digest

    conv = make_corpus(1, 300, seed=1)[0]
    digest = conversation_digest(conv)
    whole = EvalConfig(reference_window=7600)
    other_encoder = EvalConfig(replace_build(encoder="another-encoder"))
    for method, budget in ((NO_HISTORY, None), ("rag", None), ("full", None),
                           ("snapkv", 512), ("epicache", 512)):
        plain = cell_key(conv, digest, method, budget, CONFIG, None)
        assert cell_key(conv, digest, method, budget, whole, None) != plain, method
        assert cell_key(conv, digest, method, budget, other_encoder, None) != plain, method
    # rag and the no-history reference share their cell (rag is a read of it)
    assert cell_key(conv, digest, "rag", None, CONFIG, None) == \
        cell_key(conv, digest, NO_HISTORY, None, CONFIG, None)


def replace_build(**changes):
    from dataclasses import replace

    from pipeline.config import BuildConfig
    return replace(BuildConfig(), **changes)


def test_a_kept_cell_gains_the_reads_it_lacked_and_loses_none(tmp_path):
    """A run asking a kept cell for one more read measures that read alone, and keeps the cell
    with every read's fields; a computed cell for other questions replaces the kept one."""
    from pipeline.eval.runner import Cell, merged_records, missing_reads

    wide = Read(None, TopUpConfig(turns=None, max_tokens=700))
    plain_read = CONFIG.read_of("rag")
    kept_records = [{"question_index": 0, f"{plain_read.prefix}evidence_nll": 2.0}]
    cell = Cell("c", None, "cells/c/d/x.parquet", ["rag"], kept_records=kept_records)
    cell.add("rag", CONFIG)
    cell.add_sized("rag", 512, wide)
    assert missing_reads(cell) == (wide,)
    computed = [{"question_index": 0, f"{wide.prefix}evidence_nll": 1.5}]
    merged = merged_records(kept_records, computed)
    assert merged == [kept_records[0] | computed[0]]
    assert merged_records(kept_records, [{"question_index": 1}]) == [{"question_index": 1}]
    assert missing_reads(Cell("c", None, "k", ["rag"], reads=(wide,))) == (wide,)
