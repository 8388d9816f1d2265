"""Many decoder replicas, run as an operator runs them: `python -m jobs.bench.fleet` on a small
synthetic store, built with the real SmolLM2 and MiniLM by the Ray job and served by a real Serve
app over HTTP (its own local Ray, with the metrics endpoint on). With conversation affinity each
conversation's questions are answered by one replica; a replica killed mid-run loses nothing
(the fault run's rule) and its conversations are answered elsewhere; the store bytes it reports
come from the decoders' counters scraped from Ray's metrics endpoint."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.support.paths import REPO

pytestmark = pytest.mark.e2e


def _fleet(tmp_path, *args: str) -> tuple[subprocess.CompletedProcess, list[dict]]:
    figures = tmp_path / "fleet.json"
    proc = subprocess.run(
        [sys.executable, "-m", "jobs.bench.fleet", "--dir", str(tmp_path / "fleet"),
         "--conversations", "6", "--target-tokens", "300", "--replicas", "2",
         "--max-new-tokens", "2", "--json", str(figures), *args],
        cwd=REPO, capture_output=True, text=True, timeout=1200)
    assert figures.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc, json.loads(figures.read_text())


def test_affinity_keeps_each_conversation_on_one_replica_and_survives_a_kill(tmp_path):
    proc, results = _fleet(tmp_path, "--warmup", "8", "--requests", "36", "--concurrency", "2",
                           "--kill-after", "18")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    default, affinity = results
    assert (default["mode"], affinity["mode"]) == ("default", "affinity")
    assert default["errors"] == 0
    # two sessions at once never pass the imbalance bound: every conversation has one home
    assert affinity["one_replica_share"] == 1.0
    for r in results:  # the metrics endpoint counted the fetches: every miss is at least one
        assert r["objects_per_question"] > 0 and r["mib_per_question"] > 0
        assert sum(r["per_replica"]) == r["requests"] - r["errors"]
    kill = affinity["kill"]
    assert kill["killed"] and kill["replaced"], kill
    assert kill["hangs"] == 0 and kill["failed_after_recovery"] == 0
    assert kill["answered_by_the_dead"] == 0
    # on the same requests, before the kill: the replacement replica starts with a cold LRU
    assert affinity["lru_hit_rate_before_kill"] >= default["lru_hit_rate_before_kill"]
    assert "LRU hit rate, affinity / default" in proc.stdout
    assert "replica kill" in proc.stdout
    # every metric the project defines, from the real router, decoders and build, was scraped
    assert affinity["metrics_missing"] == []
