"""The endpoint's load-test client, shared by the benchmarks (`jobs.bench.serve`, one replica;
`jobs.bench.fleet`, many): one timed answer request, the latency summary, and the fault run's
rule for the requests around a killed decoder replica (in flight: may fail; none hangs; none
started after the first success fails)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import requests

# asked of a conversation that has no questions of its own (`jobs.bench.serve`, `jobs.bench.fleet`)
GENERIC_QUESTIONS = ("What did they talk about most?", "Where did they go last weekend?",
                     "What is the name of the pet?", "What did they cook for the party?")


@dataclass
class Sample:
    ok: bool
    latency_ms: float
    status: int
    timings: dict = field(default_factory=dict)
    cache_hit: bool | None = None
    error: str = ""
    start: float = 0.0  # time.perf_counter() when sent
    end: float = 0.0  # when answered (or failed)
    replica: str | None = None  # the decoder replica that answered
    conversation: str = ""
    live_tokens: int = 0  # the live tail's tokens, as the server counted them

    @property
    def hang(self) -> bool:
        return self.status == 0 and "Timeout" in self.error


def ask(session: requests.Session, url: str, cid: str, question: str, max_new_tokens: int,
        headers: dict, timeout: float, live: list[dict] | None = None) -> Sample:
    """One question to the answer endpoint (after the `live` tail's messages, when given),
    timed; a failure is a Sample, never an exception."""
    payload = {"question": question, "max_new_tokens": max_new_tokens}
    if live:
        payload["live"] = live
    t = time.perf_counter()
    try:
        r = session.post(f"{url}/v1/conversations/{cid}/answer", headers=headers, timeout=timeout,
                         json=payload)
    except requests.RequestException as e:
        end = time.perf_counter()
        return Sample(False, (end - t) * 1000, 0, error=type(e).__name__, start=t, end=end,
                      conversation=cid)
    end = time.perf_counter()
    latency = (end - t) * 1000
    if r.status_code != 200:
        return Sample(False, latency, r.status_code, error=r.text[:200], start=t, end=end,
                      conversation=cid)
    body = r.json()
    return Sample(True, latency, 200, body["timings_ms"], body.get("cache_hit"), start=t, end=end,
                  replica=body.get("replica"), conversation=cid,
                  live_tokens=body.get("live_tokens", 0))


def latency_summary(samples: list[Sample]) -> dict:
    """p50 / p95 / mean client latency (ms) of the answered requests."""
    lat = np.array([s.latency_ms for s in samples if s.ok]) if any(s.ok for s in samples) \
        else np.zeros(1)
    return {"p50": round(float(np.percentile(lat, 50)), 1),
            "p95": round(float(np.percentile(lat, 95)), 1), "mean": round(float(lat.mean()), 1)}


def statuses(group: list[Sample]) -> dict[str, int]:
    """How many ended how: an HTTP status, a client error's name, or "timeout" (a hang)."""
    out: dict[str, int] = {}
    for s in group:
        key = "timeout" if s.hang else str(s.status or s.error)
        out[key] = out.get(key, 0) + 1
    return dict(sorted(out.items()))


def fault_report(samples: list[Sample], at: float) -> dict:
    """How the requests around a kill at `at` (time.perf_counter()) ended: those in flight, the
    failures after it, the hangs, how long until a request succeeded again, and whether every
    request started after that succeeded."""
    in_flight = [s for s in samples if s.start <= at < s.end]
    after = sorted((s for s in samples if s.ok and s.end > at), key=lambda s: s.end)
    recovered = after[0].end if after else None
    later = [s for s in samples if recovered is not None and s.start >= recovered]
    return {"in_flight": len(in_flight), "in_flight_statuses": statuses(in_flight),
            "failed_after_kill": statuses([s for s in samples if not s.ok and s.end > at]),
            "hangs": sum(s.hang for s in samples),
            "recovery_s": round(recovered - at, 2) if recovered is not None else None,
            "started_after_recovery": len(later),
            "failed_after_recovery": sum(not s.ok for s in later),
            "error_examples": sorted({f"{s.status} {s.error[:120]}" for s in samples
                                      if not s.ok and s.end > at})[:3]}


def fault_rows(k: dict) -> list[tuple[str, str]]:
    """The fault report's table rows (the kill's own rows are the caller's)."""
    return [("requests in flight at the kill", str(k["in_flight"])),
            ("... how they ended", ", ".join(f"{n} x {s}" for s, n in
                                             k["in_flight_statuses"].items()) or "-"),
            ("failed after the kill (all)", ", ".join(f"{n} x {s}" for s, n in
                                                      k["failed_after_kill"].items()) or "none"),
            ("hangs (client timeouts)", str(k["hangs"])),
            ("first success after the kill", "-" if k["recovery_s"] is None
             else f"{k['recovery_s']:.1f} s later"),
            ("started after that / failed", f"{k['started_after_recovery']} / "
                                            f"{k['failed_after_recovery']}")]
