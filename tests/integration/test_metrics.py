"""The metrics of `pipeline.telemetry`, exported through a real Ray: a subprocess
(`metrics_probe.py`) starts a local Ray of its own with a known metrics export port, runs the
real build driver over a synthetic corpus and a real Serve deployment counting its requests with
the router's middleware, and this test scrapes the port (Prometheus text, polled until Ray's
1-second reports have arrived) for every metric the module declares, under the name Ray
exports it by and with its tags (a Serve replica's also carry deployment, replica, application).

Its own Ray runs in the subprocess, so it never meets the session's `ray_local`; every process it
leaves behind is stopped by pid. About 40-60 s on two cores.
"""

from __future__ import annotations

import select
import subprocess
import sys
import time
import urllib.request
from collections import defaultdict
from pathlib import Path

import psutil
from prometheus_client.parser import text_string_to_metric_families

from lab.seaweedfs import free_ports
from pipeline.telemetry import BUILD_SPECS, SPECS
from tests.support.paths import REPO

PROBE = Path(__file__).with_name("metrics_probe.py")
SERVE_TAGS = {"deployment", "replica", "application"}
EXPECTED_COUNTS = {  # (sample, tag, value) -> count, from what the probe did
    ("ray_epicache_build_conversations_total", "outcome", "built"): 2,
    ("ray_epicache_build_conversations_total", "outcome", "failed"): 2,  # failed in both runs
    ("ray_epicache_build_conversations_total", "outcome", "skipped"): 2,  # the 2nd run's
    ("ray_epicache_build_conversations_total", "outcome", "appended"): 1,
    ("ray_epicache_requests_total", "route", "answer"): 1,
    ("ray_epicache_requests_total", "route", "chat_stream"): 1,  # named by the endpoint: 503
    ("ray_epicache_requests_total", "route", "other"): 1,  # no endpoint: 404
}


def _scrape(port: int) -> dict[str, list[dict[str, str]]]:
    """sample name -> the label sets of its samples (with the value under "__value__")."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    samples = defaultdict(list)
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name.startswith("ray_epicache_"):
                samples[s.name].append({**s.labels, "__value__": s.value})
    return samples


def _missing(samples: dict[str, list[dict]]) -> list[str]:
    """What the scrape lacks: an exported name, a tag on it, or an expected count."""
    missing = []
    for spec in SPECS:
        tags = set(spec.tags) | (set() if spec in BUILD_SPECS else SERVE_TAGS)
        for name in spec.exported:
            if not samples.get(name):
                missing.append(name)
            elif not any(tags <= set(labels) for labels in samples[name]):
                missing.append(f"{name} with tags {sorted(tags)}")
    for (name, tag, value), count in EXPECTED_COUNTS.items():
        got = sum(s["__value__"] for s in samples.get(name, []) if s.get(tag) == value)
        if got != count:
            missing.append(f"{name}{{{tag}={value!r}}} == {count} (got {got})")
    return missing


def _wait_for_line(proc: subprocess.Popen, line: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready, _, _ = select.select([proc.stdout], [], [], 1.0)
        if ready:
            got = proc.stdout.readline()
            if got.strip() == line:
                return
            if not got and proc.poll() is not None:
                break
    raise AssertionError(f"the probe did not print {line!r} (exit {proc.poll()})")


def _stop(proc: subprocess.Popen) -> None:
    """Close the probe's stdin (it shuts Ray down), then kill by pid whatever is left of it."""
    family = []
    try:
        family = psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        pass
    try:
        proc.stdin.close()
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    for child in family:
        try:
            child.kill()
        except psutil.NoSuchProcess:
            pass


def test_every_metric_is_exported_by_ray_with_its_tags(tmp_path):
    metrics_port, http_port = free_ports(2)
    started = time.monotonic()
    with (tmp_path / "probe.log").open("w") as log:
        proc = subprocess.Popen([sys.executable, str(PROBE), str(metrics_port), str(http_port),
                                 str(tmp_path)], cwd=REPO, stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=log, text=True)
        try:
            try:
                _wait_for_line(proc, "ready", timeout=150)
            except AssertionError:
                log.flush()
                raise AssertionError((tmp_path / "probe.log").read_text()[-4000:]) from None
            deadline, missing = time.monotonic() + 60, ["nothing scraped"]
            while missing and time.monotonic() < deadline:
                time.sleep(1)
                try:
                    samples = _scrape(metrics_port)
                except OSError:
                    continue
                missing = _missing(samples)
        finally:
            _stop(proc)
    assert missing == [], f"after {time.monotonic() - started:.0f}s"
    answer = [s for s in samples["ray_epicache_requests_total"] if s.get("route") == "answer"]
    assert answer[0]["status"] == "200" and answer[0]["deployment"] == "MetricsProbe"
    assert answer[0]["application"] == "probe"
