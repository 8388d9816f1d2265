"""A bounded load against a running decode endpoint (`python -m jobs.serve`).

    python -m jobs.bench.serve --url http://127.0.0.1:8000 --corpus corpus.jsonl \
        [--conversations 3] [--requests 200] [--concurrency 1,8] [--max-new-tokens 16] \
        [--live-tokens 256] [--kill-decoder-after N]

Each (conversation, question) pair is asked once first (warm-up, not measured: it fetches the
caches), then `--requests` questions cycle over the pairs from `--concurrency` client threads
(a list, e.g. 1,8: one run per level, side by side, then their ratios). Prints requests/s,
client latency p50/p95, the server's per-stage split, the cache hit rate and the share of the
turn spent on embed + route + fetch (the goal: at most 5% with a warm cache), and exits 1 if
any request failed.

The live-tail case: the same questions at the first level again, each after a chat session of
about `--live-tokens` tokens (a system prompt and user / assistant messages, sent as the answer
body's `live`: read by the decoder after the cache and the top-up, before the question), printed
beside the plain run with its ratios (requests/s, latency, decode time); 0 skips it.

`--kill-decoder-after N` is the fault run: once N requests have completed, the decoder replica
that answers /healthz is killed (SIGKILL to its pid; the app must run on this machine). It
reports how the requests in flight at that moment ended (200, 503, other, or a client timeout:
a hang), how long until a request succeeded again, whether every request started after that
succeeded, and the replacement replica's pid; it then exits 1 only on a hang or on a failure
after the recovery.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import requests

from lab.bench_cli import bench_parser, start_bench
from lab.load_client import (
    GENERIC_QUESTIONS,
    Sample,
    ask,
    fault_report,
    fault_rows,
    latency_summary,
)
from pipeline.corpus.reader import read_corpus

STAGES = ("embed", "route", "fetch", "decode")


def load_questions(corpus: str | None, conversations: list[str], limit: int,
                   per_conversation: int) -> list[tuple[str, str]]:
    """(conversation id, question) pairs: the corpus's own questions, else generic ones."""
    pairs: list[tuple[str, str]] = []
    if corpus:
        convs = read_corpus(corpus)[0]
        if conversations:
            convs = [c for c in convs if c.conversation_id in set(conversations)]
        for conv in convs[:limit]:
            qs = [q.question for q in conv.questions][:per_conversation] or list(GENERIC_QUESTIONS)
            pairs += [(conv.conversation_id, q) for q in qs]
    else:
        for cid in conversations[:limit]:
            pairs += [(cid, q) for q in GENERIC_QUESTIONS[:per_conversation]]
    if not pairs:
        raise ValueError("no conversations to ask about: give --corpus or --conversation")
    return pairs


def decoder_pid(url: str, headers: dict, timeout: float = 30.0) -> int:
    """The pid of the decoder replica that answers /healthz (its `decoder.pid`)."""
    r = requests.get(f"{url}/healthz", headers=headers, timeout=timeout)
    r.raise_for_status()
    pid = r.json().get("decoder", {}).get("pid")
    if not isinstance(pid, int):
        raise RuntimeError(f"{url}/healthz names no decoder pid (an older server?)")
    return pid


class DecoderKiller:
    """Kills the decoder replica (SIGKILL to its pid) once `after` requests have completed."""

    def __init__(self, url: str, headers: dict, after: int):
        from urllib.parse import urlparse

        if urlparse(url).hostname not in ("127.0.0.1", "localhost", "::1"):
            raise ValueError("--kill-decoder-after needs the app on this machine (a loopback "
                             f"--url), not {url}")
        self.url, self.headers, self.after = url, headers, after
        self.pid: int | None = None
        self.at: float | None = None  # time.perf_counter() of the kill
        self.error = ""
        self._done = 0
        self._lock = threading.Lock()

    def completed(self) -> None:
        with self._lock:
            self._done += 1
            due = self._done == self.after
        if due:
            try:
                self.pid = decoder_pid(self.url, self.headers)
                self.at = time.perf_counter()
                os.kill(self.pid, signal.SIGKILL)
            except (OSError, RuntimeError, requests.RequestException) as e:
                self.error = f"could not kill the decoder: {e}"


def kill_report(samples: list[Sample], killer: DecoderKiller, url: str, headers: dict,
                wait_s: float = 120.0) -> dict:
    """How the requests around the kill ended (`fault_report`), and whether the replica was
    replaced."""
    if killer.at is None:
        return {"killed": False, "error": killer.error or "the run ended before the kill"}
    new_pid, deadline = None, time.monotonic() + wait_s
    while time.monotonic() < deadline:
        try:
            new_pid = decoder_pid(url, headers)
            break
        except (RuntimeError, requests.RequestException):
            time.sleep(1)
    return {"killed": True, "pid": killer.pid, "new_pid": new_pid,
            "replaced": new_pid is not None and new_pid != killer.pid,
            **fault_report(samples, killer.at)}


# what a chat session since the last build says, repeated to the length asked (`live_tail`)
LIVE_LINES = (("user", "We finally went to the lake last Sunday, the water was still cold."),
              ("assistant", "That sounds lovely! Did you manage to swim at all?"),
              ("user", "Only for a minute. Then we had lunch at the old boathouse cafe."),
              ("assistant", "The boathouse cafe is a nice spot. What did you order there?"))


def live_tail(tokens: int) -> list[dict]:
    """A chat session of about `tokens` tokens as a chat template renders it (~0.75 words a
    token, ~5 tokens of a message's turn markers; the server counts the exact figure): a system
    prompt, then user and assistant messages in turn; [] for 0."""
    if tokens <= 0:
        return []

    def estimate(messages: list[dict]) -> float:
        return sum(len(m["content"].split()) / 0.75 + 5 for m in messages)

    messages = [{"role": "system", "content": "You answer questions about our conversations."}]
    while True:
        role, text = LIVE_LINES[(len(messages) - 1) % len(LIVE_LINES)]
        more = messages + [{"role": role, "content": text}]
        if estimate(more) > tokens:
            return messages
        messages = more


def run_bench(url: str, pairs: list[tuple[str, str]], n_requests: int = 200,
              concurrency: int = 8, max_new_tokens: int = 16, token: str | None = None,
              warmup: bool = True, seed: int = 0, timeout: float = 300.0,
              kill_decoder_after: int | None = None, live: list[dict] | None = None) -> dict:
    """Warm up, then run the bounded load (killing the decoder replica once
    `kill_decoder_after` requests completed, if given; each question after the `live` tail,
    if given); returns the measured figures."""
    url = url.rstrip("/")
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    if warmup:
        with requests.Session() as s:
            for cid, q in pairs:
                sample = ask(s, url, cid, q, max_new_tokens, headers, timeout)
                if not sample.ok:
                    raise RuntimeError(f"warm-up request for {cid!r} failed: {sample.status} "
                                       f"{sample.error}")
    order = [pairs[i % len(pairs)] for i in range(n_requests)]
    random.Random(seed).shuffle(order)
    local = threading.local()
    killer = DecoderKiller(url, headers, kill_decoder_after) if kill_decoder_after else None

    def one(pair: tuple[str, str]) -> Sample:
        if not hasattr(local, "session"):
            local.session = requests.Session()
        sample = ask(local.session, url, *pair, max_new_tokens, headers, timeout, live)
        if killer is not None:
            killer.completed()
        return sample

    start = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        samples = list(pool.map(one, order))
    wall = time.perf_counter() - start
    ok = [s for s in samples if s.ok]
    lat = np.array([s.latency_ms for s in ok]) if ok else np.zeros(1)
    stage = {k: np.array([s.timings[k] for s in ok]) if ok else np.zeros(1) for k in STAGES}
    server_turn = sum(stage[k].sum() for k in STAGES)
    overhead = stage["embed"].sum() + stage["route"].sum() + stage["fetch"].sum()
    hits = [s.cache_hit for s in ok if s.cache_hit is not None]
    kill = kill_report(samples, killer, url, headers) if killer is not None else None
    return {"kill": kill,
        "requests": n_requests, "concurrency": concurrency, "pairs": len(pairs),
        "conversations": len({c for c, _ in pairs}), "max_new_tokens": max_new_tokens,
        "errors": len(samples) - len(ok),
        "error_examples": sorted({f"{s.status} {s.error}" for s in samples if not s.ok})[:3],
        "wall_s": round(wall, 2), "requests_per_s": round(len(samples) / wall, 3),
        "latency_ms": latency_summary(samples),
        "stages_ms": {k: {"mean": round(float(v.mean()), 2),
                          "p50": round(float(np.percentile(v, 50)), 2),
                          "p95": round(float(np.percentile(v, 95)), 2)} for k, v in stage.items()},
        "cache_hit_rate": round(sum(hits) / len(hits), 4) if hits else None,
        "live_tokens": round(float(np.mean([s.live_tokens for s in ok])), 1) if ok else 0.0,
        "overhead_share": round(float(overhead / server_turn), 4) if server_turn else None,
        # the client's view: what the turn cost end to end beyond the decode itself
        "client_overhead_share": round(float(1 - stage["decode"].sum() / lat.sum()), 4)
        if ok else None,
    }


def format_table(r: dict) -> str:
    s = r["stages_ms"]
    rows = [
        ("load", f"{r['requests']} requests, {r['concurrency']} clients, "
                 f"{r['conversations']} conversations ({r['pairs']} questions), "
                 f"max_new_tokens {r['max_new_tokens']}"),
        ("errors", str(r["errors"])),
        ("requests/s", f"{r['requests_per_s']:.2f}"),
        ("latency p50 / p95 (client)",
         f"{r['latency_ms']['p50']:.0f} / {r['latency_ms']['p95']:.0f} ms"),
        *[(f"{k} mean / p50 / p95",
           f"{s[k]['mean']:.2f} / {s[k]['p50']:.2f} / {s[k]['p95']:.2f} ms") for k in STAGES],
        ("cache hit rate",
         "-" if r["cache_hit_rate"] is None else f"{100 * r['cache_hit_rate']:.1f}%"),
        ("embed + route + fetch share of the turn",
         "-" if r["overhead_share"] is None else f"{100 * r['overhead_share']:.2f}% (goal <= 5%)"),
        ("client latency beyond decode (queueing, HTTP, routing)",
         "-" if r["client_overhead_share"] is None else f"{100 * r['client_overhead_share']:.1f}%"),
    ]
    width = max(len(a) for a, _ in rows)
    lines = [f"| {'metric'.ljust(width)} | value |", f"| {'-' * width} | --- |"]
    lines += [f"| {a.ljust(width)} | {b} |" for a, b in rows]
    return "\n".join(lines)


def format_live(plain: dict, live: dict) -> str:
    """The live-tail case beside the plain run at the same level, with their ratios."""
    rows = [("live tail (tokens read before each question)", "0", f"{live['live_tokens']:.0f}", ""),
            ("requests/s", f"{plain['requests_per_s']:.2f}", f"{live['requests_per_s']:.2f}",
             f"{live['requests_per_s'] / plain['requests_per_s']:.2f}x")]
    for name, key in (("latency p50 (client)", "p50"), ("latency p95 (client)", "p95")):
        a, b = plain["latency_ms"][key], live["latency_ms"][key]
        rows.append((name, f"{a:.0f} ms", f"{b:.0f} ms", f"{b / a:.2f}x"))
    a, b = plain["stages_ms"]["decode"]["mean"], live["stages_ms"]["decode"]["mean"]
    rows.append(("decode mean (server: prefill to last token)", f"{a:.0f} ms", f"{b:.0f} ms",
                 f"{b / a:.2f}x"))
    rows.append(("errors", str(plain["errors"]), str(live["errors"]), ""))
    width = max(len(r[0]) for r in rows)
    head = f"live tail at concurrency {live['concurrency']}"
    lines = [f"| {head.ljust(width)} | plain | live tail | live / plain |",
             f"| {'-' * width} | --- | --- | --- |"]
    return "\n".join(lines + [f"| {r[0].ljust(width)} | {r[1]} | {r[2]} | {r[3]} |"
                              for r in rows])


def format_kill(k: dict) -> str:
    if not k["killed"]:
        return f"decoder kill: not done ({k['error']})"
    rows = [("killed decoder pid", str(k["pid"])), *fault_rows(k),
            ("replacement replica pid", f"{k['new_pid']} "
                                        f"({'replaced' if k['replaced'] else 'NOT replaced'})")]
    width = max(len(a) for a, _ in rows)
    lines = [f"| {'decoder kill'.ljust(width)} | value |", f"| {'-' * width} | --- |"]
    return "\n".join(lines + [f"| {a.ljust(width)} | {b} |" for a, b in rows])


def format_ratios(results: list[dict]) -> str:
    """Throughput and latency of the last concurrency level against the first."""
    lo, hi = results[0], results[-1]
    c_lo, c_hi = lo["concurrency"], hi["concurrency"]
    throughput = hi["requests_per_s"] / lo["requests_per_s"]
    latency = hi["latency_ms"]["p95"] / lo["latency_ms"]["p50"]
    return "\n".join([
        f"throughput c={c_hi} / c={c_lo}: {throughput:.2f}x (goal >= 3x)",
        f"p95 latency c={c_hi} / p50 latency c={c_lo}: {latency:.2f}x (goal <= 3x)",
        f"failed requests: {sum(r['errors'] for r in results)} of "
        f"{sum(r['requests'] for r in results)} (goal 0)"])


def _levels(value: str) -> list[int]:
    levels = [int(v) for v in value.split(",") if v.strip()]
    if not levels or min(levels) < 1:
        raise argparse.ArgumentTypeError(f"concurrency levels must be >= 1, got {value!r}")
    return levels


def build_parser() -> argparse.ArgumentParser:
    p = bench_parser("serve", __doc__)
    p.add_argument("--url", default="http://127.0.0.1:8000", help="the running jobs.serve app")
    p.add_argument("--corpus", help="JSONL corpus the store was built from, for its questions "
                                    "(default: none; generic questions to each --conversation)")
    p.add_argument("--conversation", action="append", default=[],
                   help="a conversation id to ask about (may repeat; default: the corpus's)")
    p.add_argument("--conversations", type=int, default=3, help="conversations asked, at most")
    p.add_argument("--questions-per-conversation", type=int, default=4,
                   help="questions asked of each conversation, at most")
    p.add_argument("--requests", type=int, default=200, help="requests measured")
    p.add_argument("--concurrency", type=_levels, default="8",
                   help="requests in flight at once; a comma list (e.g. 1,8) runs each level in "
                        "turn and prints the last against the first")
    p.add_argument("--timeout", type=float, default=300.0,
                   help="client timeout per request, seconds (a timeout counts as a hang)")
    p.add_argument("--kill-decoder-after", type=int, default=None, metavar="N",
                   help="fault run: SIGKILL the decoder replica (pid from /healthz; the app must "
                        "run on this machine) once N requests have completed, and report how "
                        "the requests around it ended (default: no kill)")
    p.add_argument("--max-new-tokens", type=int, default=16, help="answer length at most (tokens)")
    p.add_argument("--live-tokens", type=int, default=256,
                   help="the live-tail case: the first level again, each question after a chat "
                        "session of about this many tokens (the answer body's 'live'); 0: no "
                        "such case")
    p.add_argument("--no-warmup", action="store_true",
                   help="measure from the first request (no warm-up pass over the questions)")
    p.add_argument("--token", default=os.environ.get("EPICACHE_SERVE_TOKEN"),
                   help="bearer token (default: $EPICACHE_SERVE_TOKEN)")
    p.add_argument("--json", help="also write the figures to this file (default: not written)")
    return p


def main(argv: list[str] | None = None) -> int:
    a = start_bench(build_parser(), argv)
    try:
        pairs = load_questions(a.corpus, a.conversation, a.conversations,
                               a.questions_per_conversation)
        results = []
        for i, level in enumerate(a.concurrency):
            last = i == len(a.concurrency) - 1
            results.append(run_bench(a.url, pairs, a.requests, level, a.max_new_tokens, a.token,
                                     warmup=not a.no_warmup and i == 0, timeout=a.timeout,
                                     kill_decoder_after=a.kill_decoder_after if last else None))
            print(format_table(results[-1]), flush=True)
            if results[-1]["kill"] is not None:
                print(format_kill(results[-1]["kill"]), flush=True)
        if a.live_tokens > 0 and a.kill_decoder_after is None:
            live = run_bench(a.url, pairs, a.requests, a.concurrency[0], a.max_new_tokens,
                             a.token, warmup=False, timeout=a.timeout,
                             live=live_tail(a.live_tokens))
            results[0]["live"] = live  # beside the level it is compared with
            print(format_live(results[0], live), flush=True)
    except (ValueError, RuntimeError, OSError, requests.RequestException) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if len(results) > 1:
        print(format_ratios(results))
    runs = results + ([results[0]["live"]] if "live" in results[0] else [])
    for r in runs:
        if r["errors"]:
            print(f"errors at concurrency {r['concurrency']}: " + "; ".join(r["error_examples"]),
                  file=sys.stderr)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results if len(results) > 1 else results[0], f, indent=2)
    kill = results[-1]["kill"]
    if kill is not None:  # the fault run: failures around the kill are expected, hangs are not
        return 1 if (not kill["killed"] or kill["hangs"] or kill["failed_after_recovery"]
                     or not kill["replaced"]) else 0
    return 1 if any(r["errors"] for r in runs) else 0

if __name__ == "__main__":
    raise SystemExit(main())
