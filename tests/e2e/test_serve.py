"""The Ray Serve decode endpoint, over real HTTP on 127.0.0.1.

The LRU of loaded caches is tested on its own first (no models). Then one small store is built
with the real SmolLM2 and MiniLM on the session's Ray; an app over it runs in this process's
Ray (local store, bearer token), and `python -m jobs.serve` runs as a subprocess over a copy of
the store in SeaweedFS S3 (its own local Ray, credentials from its environment only). Both are
asked through the answer endpoint and the OpenAI chat endpoint (streamed, read by the official
`openai` client), and checked against the library's `Answerer` and `jobs.answer`. The local app
tops its questions up (`--topup`: the question's nearest turns its episode lacks, read after
the cache); the S3 one does not.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from pipeline.answer.answerer import Answerer
from pipeline.answer.lru import CacheLRU
from pipeline.config import TopUpConfig
from pipeline.corpus.reader import read_corpus, write_jsonl
from pipeline.store.backends.base import manifest_key
from pipeline.store.backends.local import LocalStore
from pipeline.store.backends.uri import open_store
from tests.support.paths import REPO

TOKEN = "serve-test-token"
MAX_NEW = 8
e2e = pytest.mark.e2e


# ---------------------------------------------------------------------------------------------
# The byte-bounded LRU (no models)
# ---------------------------------------------------------------------------------------------

def _lru(max_bytes: int) -> CacheLRU:
    return CacheLRU(max_bytes, sizeof=len)  # values are bytes: their size is their length


def test_lru_evicts_least_recently_used_within_the_byte_budget():
    lru, loads = _lru(10), []

    def get(key, size):
        return lru.get_or_load(key, lambda: loads.append(key) or b"x" * size)

    assert get("a", 4)[1] is False and get("b", 4)[1] is False
    assert get("a", 4)[1] is True  # a is now the most recent
    get("c", 4)  # 12 bytes > 10: b (least recent) goes
    assert "b" not in lru and "a" in lru and "c" in lru and lru.bytes == 8
    assert get("b", 4)[1] is False and loads == ["a", "b", "c", "b"]
    stats = lru.stats()
    assert (stats["hits"], stats["misses"], stats["evictions"]) == (1, 4, 2)


def test_lru_keeps_the_previous_turn_whatever_its_size():
    lru = _lru(0)
    lru.get_or_load("big", lambda: b"x" * 100)
    assert "big" in lru and lru.get_or_load("big", lambda: b"")[1] is True
    lru.get_or_load("next", lambda: b"y" * 100)
    assert list(lru._entries) == ["next"]


def test_lru_loads_a_key_once_under_concurrency_and_never_keeps_a_failed_load():
    lru, calls, gate = _lru(1000), [], threading.Event()

    def slow():
        calls.append(1)
        gate.wait(5)
        return b"v" * 10

    with ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(lru.get_or_load, "k", slow) for _ in range(8)]
        time.sleep(0.2)
        gate.set()
        results = [f.result() for f in futures]
    assert len(calls) == 1 and sum(not hit for _, hit in results) == 1

    def broken():
        raise ValueError("bad object")

    with pytest.raises(ValueError):
        lru.get_or_load("bad", broken)
    assert "bad" not in lru and lru.get_or_load("bad", lambda: b"ok")[1] is False


def test_a_dead_decoder_replica_is_a_503_and_no_answer_in_time_a_504():
    from ray.exceptions import ActorDiedError, ActorUnavailableError
    from ray.serve.exceptions import BackPressureError

    from pipeline.serve.errors import classify

    for error in (ActorDiedError(), ActorUnavailableError("gone", None), BackPressureError(
            num_queued_requests=9, max_queued_requests=8)):
        status, message = classify(error)
        assert status == 503 and "retry" in message
    assert classify(TimeoutError())[0] == 504


# ---------------------------------------------------------------------------------------------
# One small store with the real models
# ---------------------------------------------------------------------------------------------

def _config():
    from pipeline.config import BuildConfig
    from pipeline.episodes import EpisodeConfig
    from pipeline.kv.budgets import CalibrationConfig
    from pipeline.kv.prefill import PrefillConfig

    return BuildConfig(budget=128, episodes=EpisodeConfig(episodes=2, medoids=2),
                       prefill=PrefillConfig(block=256),
                       calibration=CalibrationConfig(tokens=1024, window=256, sink=64))


def _flip_a_byte(data: bytes) -> bytes | None:
    changed = bytearray(data)
    changed[-100] ^= 0xFF  # inside the tensor data: the header still parses
    return bytes(changed)


def _corrupt_copy(store, source_id: str, new_id: str, damage=_flip_a_byte) -> list[str]:
    """A conversation whose manifest names damaged copies of `source_id`'s objects (same
    recorded sizes and checksums; `damage` makes each copy's bytes, None: no copy): every
    answer from it must fail. The default flips a byte, so each fails its checksum."""
    from pipeline.store.catalogue.manifest import read_manifest, write_manifest

    rows, keys = [], []
    for row in read_manifest(store, source_id):
        data = damage(store.get(row.object_key))
        key = row.object_key.replace(f"caches/{source_id}/", f"caches/{new_id}/")
        if data is not None:
            store.put(key, data)
        rows.append(dataclasses.replace(row, conversation_id=new_id, object_key=key))
        keys.append(key)
    write_manifest(store, new_id, rows)
    return keys


@pytest.fixture(scope="module")
def built(tmp_path_factory, ray_local):
    """Two synthetic conversations (~1,600 tokens, 2 episodes, budget 128) and a corrupted one."""
    from pipeline.builder.driver import run_build
    from pipeline.config import DriverOptions
    from pipeline.corpus.synthetic import make_corpus

    root = tmp_path_factory.mktemp("serve")
    corpus = root / "corpus.jsonl"
    write_jsonl(make_corpus(2, 1500, seed=11), corpus)
    store_dir = root / "store"
    summary = run_build(str(corpus), str(store_dir), _config(), DriverOptions(progress=False))
    assert summary.built == 2 and not summary.failed
    store = LocalStore(store_dir)
    broken_keys = _corrupt_copy(store, "synth-0000", "broken-0000")
    # a garbage manifest, the first the server meets: it starts and serves the others
    store.put(manifest_key("aaa-garbage"), b"not a manifest")
    conversations = read_corpus(corpus)[0]
    return corpus, store_dir, conversations, broken_keys


def _free_port() -> int:
    from tests.support.s3_server import free_ports

    return free_ports(1)[0]


def _wait_healthy(url: str, timeout: float = 240.0, proc: subprocess.Popen | None = None,
                  log=None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            log.seek(0)
            raise RuntimeError(f"server exited early:\n{log.read()[-3000:]}")
        try:
            if requests.get(f"{url}/healthz", timeout=5).status_code == 200:
                return
        except requests.RequestException:
            pass
        time.sleep(1)
    raise RuntimeError(f"{url} not healthy after {timeout:.0f}s")


def _listens_on_loopback_only(port: int) -> bool:
    import psutil

    addrs = {c.laddr.ip for c in psutil.net_connections("tcp")
             if c.status == psutil.CONN_LISTEN and c.laddr.port == port}
    return addrs == {"127.0.0.1"}


@pytest.fixture(scope="module")
def local_app(built, ray_local):
    """The app over the local store in this session's Ray, on a free loopback port, with a
    bearer token, manifests checked on every request (ttl 0) and the top-up on; shut down
    afterwards."""
    from ray import serve

    from pipeline.serve.app import APP_NAME, build_app, resolve_models
    from pipeline.serve.settings import ServeSettings

    _, store_dir, _, _ = built
    settings = ServeSettings(store=str(store_dir), auth_token=TOKEN, router_cpus=0,
                             decoder_cpus=0, manifest_ttl_s=0, cache_bytes=256 * 2**20,
                             topup=True)
    model, encoder = resolve_models(LocalStore(store_dir), None, None)
    port = _free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    try:
        serve.run(build_app(settings, model, encoder), name=APP_NAME, route_prefix="/")
        url = f"http://127.0.0.1:{port}"
        _wait_healthy(url)
        yield url, port
    finally:
        serve.shutdown()


AUTH = {"Authorization": f"Bearer {TOKEN}"}
TOPUP = TopUpConfig(enabled=True)  # the local app's


def _answer(url: str, cid: str, question: str, headers: dict = AUTH, **extra) -> requests.Response:
    return requests.post(f"{url}/v1/conversations/{cid}/answer", headers=headers, timeout=300,
                         json={"question": question, "max_new_tokens": MAX_NEW, **extra})


def _stats(url: str) -> dict:
    return requests.get(f"{url}/healthz", headers=AUTH, timeout=60).json()["decoder"]


def _settled_stats(url: str, requested: int = 0, timeout: float = 120.0) -> dict:
    """The decoder's figures once it was asked for `requested` prefetches at least and every
    prefetch it was asked for has ended."""
    deadline = time.monotonic() + timeout
    while True:
        stats = _stats(url)
        ended = sum(stats[f"prefetch_{k}"] for k in ("fetched", "skipped", "failed"))
        settled = stats["prefetch_requested"] >= requested and ended >= stats["prefetch_requested"]
        if settled or time.monotonic() > deadline:
            return stats
        time.sleep(0.2)


def _questions(conversations, per: int = 2) -> list[tuple[str, str]]:
    return [(c.conversation_id, q.question) for c in conversations for q in c.questions[:per]]


# ---------------------------------------------------------------------------------------------
# The local app
# ---------------------------------------------------------------------------------------------

@e2e
def test_app_listens_on_loopback_and_reports_health(local_app):
    url, port = local_app
    assert _listens_on_loopback_only(port)
    health = requests.get(f"{url}/healthz", headers=AUTH, timeout=60).json()
    assert health["status"] == "ok" and health["model"] == "SmolLM2-135M-Instruct"
    assert health["encoder"] == "all-MiniLM-L6-v2" and health["decoder"]["max_bytes"] == 256 * 2**20
    # without the token: whether it is healthy, and nothing more
    assert requests.get(f"{url}/healthz", timeout=60).json() == {"status": "ok"}


@e2e
def test_second_question_routed_to_the_same_episode_does_not_fetch_again(local_app, built):
    url, _ = local_app
    _, store_dir, conversations, _ = built
    conv = conversations[1]
    # two different questions that the library routes to the same one episode
    answerer = Answerer(LocalStore(store_dir))
    from pipeline.answer.lookup import embed_question, route_records
    from pipeline.kv import models

    encoder, rows = models.load_encoder(), answerer.manifest(conv.conversation_id)
    by_episode: dict[tuple[int, ...], list[str]] = {}
    for q in conv.questions:
        read, _ = route_records(embed_question(encoder, q.question), rows)
        if len(read) == 1:
            by_episode.setdefault((read[0].episode,), []).append(q.question)
    first_q, second_q = next(qs for qs in by_episode.values() if len(qs) >= 2)[:2]

    before = _settled_stats(url)
    first = _answer(url, conv.conversation_id, first_q).json()
    middle = _settled_stats(url, len(rows) - 1)  # the first touch prefetched the other episodes
    second = _answer(url, conv.conversation_id, second_q).json()
    after = _stats(url)
    assert second["episode"] == first["episode"]
    assert middle["prefetch_requested"] >= len(rows) - 1  # on its first touch, here or before
    assert middle["prefetch_failed"] == before["prefetch_failed"]
    assert middle["misses"] == before["misses"] + (0 if first["cache_hit"] else 1)
    assert second["cache_hit"] is True
    assert after["misses"] == middle["misses"] and after["fetched_bytes"] == middle["fetched_bytes"]
    assert after["hits"] == middle["hits"] + 1


@e2e
def test_answer_endpoint_routes_like_the_library(local_app, built):
    url, _ = local_app
    _, store_dir, conversations, _ = built
    answerer = Answerer(LocalStore(store_dir))
    for cid, question in _questions(conversations):
        r = _answer(url, cid, question)
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["answer"].strip()
        assert set(body["timings_ms"]) == {"embed", "route", "fetch", "decode"}
        assert all(v >= 0 for v in body["timings_ms"].values())
        lib = answerer.answer(cid, question, max_new_tokens=MAX_NEW)
        assert body["episode"] == lib.episode and body["episodes"] == lib.episodes
        assert body["similarity"] == pytest.approx(lib.similarity, abs=1e-4)


@pytest.fixture(scope="module")
def topped_up(built) -> tuple[str, str, object]:
    """A question the library tops up (its nearest turns not all in its episode): its
    conversation, the question, and the library's answer to it."""
    _, store_dir, conversations, _ = built
    answerer = Answerer(LocalStore(store_dir), topup=TOPUP)
    for cid, question in _questions(conversations, 6):
        lib = answerer.answer(cid, question, max_new_tokens=MAX_NEW)
        if lib.topup["status"] == "used":
            return cid, question, lib
    raise AssertionError("no question of the test corpus was topped up")


def _sse_chunks(r: requests.Response) -> list[dict]:
    assert r.status_code == 200, r.text
    return [json.loads(line.removeprefix("data: ")) for line in r.iter_lines(decode_unicode=True)
            if line and line != "data: [DONE]"]


@e2e
def test_a_topped_up_answer_is_that_of_jobs_answer_on_every_endpoint(local_app, built,
                                                                      topped_up):
    """A question whose nearest turns its episode lacks: the server reads the same turns and
    gives the same answer as `python -m jobs.answer --topup`, and says so on both endpoints
    (the turns, not their text); /healthz counts it."""
    url, _ = local_app
    store_dir = built[1]
    cid, question, lib = topped_up
    proc = subprocess.run(
        [sys.executable, "-m", "jobs.answer", "--store", str(store_dir), "--conversation", cid,
         "--question", question, "--max-new-tokens", str(MAX_NEW), "--topup", "--json"],
        cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    cli = json.loads(proc.stdout.splitlines()[-1])
    assert cli["topup"] == lib.topup and cli["answer"] == lib.answer
    assert cli["topup"]["text"] and cli["topup"]["tokens"] <= TOPUP.max_tokens

    before = requests.get(f"{url}/healthz", headers=AUTH, timeout=60).json()["topup"]
    body = _answer(url, cid, question).json()
    after = requests.get(f"{url}/healthz", headers=AUTH, timeout=60).json()["topup"]
    shown = {k: v for k, v in cli["topup"].items() if k not in ("text", "hidden_spans")}
    assert body["topup"] == shown
    assert (body["episode"], body["episodes"], body["answer"]) == \
        (cli["episode"], cli["episodes"], cli["answer"])
    assert after["enabled"] is True and after["used"] == before["used"] + 1
    assert after["index_bytes_fetched"] > 0

    chat = {"conversation_id": cid, "max_tokens": MAX_NEW,
            "messages": [{"role": "user", "content": question}]}
    whole = requests.post(f"{url}/v1/chat/completions", headers=AUTH, json=chat, timeout=300)
    assert whole.status_code == 200, whole.text
    assert whole.json()["epicache"]["topup"] == shown
    assert whole.json()["choices"][0]["message"]["content"] == cli["answer"]
    chunks = _sse_chunks(requests.post(f"{url}/v1/chat/completions", headers=AUTH, stream=True,
                                       json=chat | {"stream": True}, timeout=300))
    assert chunks[0]["epicache"]["topup"] == chunks[-1]["epicache"]["topup"] == shown
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == cli["answer"]


def _copy_with_own_index(store, source_id: str, new_id: str) -> str:
    """A copy of `source_id` whose manifest names its own turn index (the source's, bound to
    the copy); returns the index object's key."""
    from pipeline.store.catalogue.manifest import read_manifest, write_manifest
    from pipeline.store.objects.turn_index import read_turn_index, store_turn_index

    rows = read_manifest(store, source_id)
    index = read_turn_index(store, rows[0].turn_index, source_id, rows[0].encoder_fingerprint)
    stored = store_turn_index(dataclasses.replace(index, conversation_id=new_id), store)
    write_manifest(store, new_id, [dataclasses.replace(r, conversation_id=new_id,
                                                       **stored.fields()) for r in rows])
    return stored.key


@e2e
def test_a_missing_or_corrupt_turn_index_answers_from_the_episode_alone(local_app, built,
                                                                         topped_up):
    """The turn index object deleted, or corrupted under its recorded checksum: still 200,
    answered as with no top-up, `status` "unavailable" with a note naming the repair but not
    the object; /healthz counts them. An intact copy is topped up as its source is."""
    url, _ = local_app
    store_dir = built[1]
    store = LocalStore(store_dir)
    source, question, lib = topped_up
    plain = Answerer(store, topup=TopUpConfig(enabled=False)).answer(source, question, MAX_NEW)
    keys = {cid: _copy_with_own_index(store, source, cid)
            for cid in ("intact-0000", "noindex-0000", "badindex-0000")}
    store.delete(keys["noindex-0000"])
    data = bytearray(store.get(keys["badindex-0000"]))
    data[-10] ^= 0xFF  # inside the embeddings: the header still parses
    store.put(keys["badindex-0000"], bytes(data))

    intact = _answer(url, "intact-0000", question).json()
    assert intact["topup"]["turn_ids"] == lib.topup["turn_ids"]
    assert intact["answer"] == lib.answer
    before = requests.get(f"{url}/healthz", headers=AUTH, timeout=60).json()["topup"]
    for cid in ("noindex-0000", "badindex-0000"):
        r = _answer(url, cid, question)
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["topup"]["status"] == "unavailable" and body["topup"]["turn_ids"] == []
        note = body["topup"]["note"]
        assert "python -m jobs.build" in note and "turns/" not in note
        assert str(store_dir) not in note
        assert (body["episode"], body["answer"]) == (plain.episode, plain.answer)
    after = requests.get(f"{url}/healthz", headers=AUTH, timeout=60).json()["topup"]
    assert after["unavailable"] == before["unavailable"] + 2
    # the library (jobs.answer) says what is wrong with the object, and answers all the same
    local = Answerer(store, topup=TOPUP).answer("badindex-0000", question, MAX_NEW)
    assert local.topup["status"] == "unavailable" and "failed its checksum" in local.topup["note"]
    assert local.answer == plain.answer


@e2e
def test_chat_completions_stream_read_by_the_openai_client(local_app, built):
    import openai

    url, _ = local_app
    conversations = built[2]
    cid, question = _questions(conversations, 1)[0]
    client = openai.OpenAI(api_key=TOKEN, base_url=f"{url}/v1", max_retries=0)
    messages = [{"role": "system", "content": "You answer briefly."},
                {"role": "user", "content": "an earlier question"},
                {"role": "assistant", "content": "an earlier answer"},
                {"role": "user", "content": question}]
    stream = client.chat.completions.create(
        model="SmolLM2-135M-Instruct", messages=messages, max_tokens=MAX_NEW, stream=True,
        stream_options={"include_usage": True}, extra_body={"conversation_id": cid})
    *chunks, usage = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")
    assert usage.choices == [] and all(c.usage is None for c in chunks)
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks)
    whole = client.chat.completions.create(
        model="SmolLM2-135M-Instruct", messages=messages, max_tokens=MAX_NEW,
        extra_body={"conversation_id": cid})
    # the earlier messages are the live tail: the answer route reads the same as its `live`
    native = _answer(url, cid, question, live=messages[:-1]).json()
    assert streamed and streamed == whole.choices[0].message.content == native["answer"]
    live_tokens = whole.model_extra["epicache"]["live_tokens"]
    assert live_tokens == native["live_tokens"] > 0
    assert chunks[0].model_extra["epicache"]["live_tokens"] == live_tokens
    assert whole.model_extra["epicache"]["episode"] == native["episode"]
    assert whole.usage.completion_tokens == native["tokens"]
    assert usage.usage == whole.usage  # the stream's usage chunk: the same answer's usage


# A fact planted in the session the client is in: no cache and no turn of the corpus holds it
PARROT = "Zephyrino"
LIVE_TAIL = [
    {"role": "system", "content": "You answer questions about a long conversation."},
    {"role": "user", "content": f"Something new since we last talked: my neighbour bought a "
                                f"parrot and named it {PARROT}."},
    {"role": "assistant", "content": f"{PARROT}, what a name for a parrot!"}]
PARROT_QUESTION = "What is the name of my neighbour's parrot?"


@e2e
def test_a_chat_requests_earlier_messages_reach_the_decoder(local_app, built):
    """A chat request whose earlier message plants a fact the caches do not hold: over HTTP its
    live tail is read (its tokens in `epicache`, whole and streamed; the native route's `live`
    the same), and the answer is the library's on the same path (plan, caches, top-up, tail).
    On that path the gold answer's teacher-forced NLL with the tail is well below its NLL
    without it: the tail reaches the decoder."""
    from pipeline.kv.prompts import ChatTurn

    url, _ = local_app
    _, store_dir, conversations, _ = built
    conv = conversations[0]
    assert not any(PARROT in t.text for c in conversations for t in c.turns)
    chat = {"conversation_id": conv.conversation_id, "max_tokens": MAX_NEW,
            "messages": [*LIVE_TAIL, {"role": "user", "content": PARROT_QUESTION}]}
    r = requests.post(f"{url}/v1/chat/completions", headers=AUTH, json=chat, timeout=300)
    assert r.status_code == 200, r.text
    body = r.json()
    meta = body["epicache"]

    answerer = Answerer(LocalStore(store_dir), topup=TOPUP)  # the local app's plan
    turns = [ChatTurn(m["role"], m["content"]) for m in LIVE_TAIL]
    lib = answerer.answer(conv.conversation_id, PARROT_QUESTION, MAX_NEW, live=turns)
    assert meta["live_tokens"] == lib.live_tokens > 0
    assert (meta["episodes"], meta["topup"]["turn_ids"]) == (lib.episodes, lib.topup["turn_ids"])
    assert body["choices"][0]["message"]["content"] == lib.answer
    # usage counts the tokens prefilled at question time, as the library's answer does
    assert body["usage"]["prompt_tokens"] == lib.prompt_tokens > lib.live_tokens

    without = requests.post(f"{url}/v1/chat/completions", headers=AUTH, timeout=300,
                            json=chat | {"messages": chat["messages"][-1:]}).json()
    assert without["epicache"]["live_tokens"] == 0
    assert without["epicache"]["episodes"] == meta["episodes"]  # routed by the question alone

    nll_live = answerer.answer_nll(conv.conversation_id, PARROT_QUESTION, PARROT, live=turns)
    nll_plain = answerer.answer_nll(conv.conversation_id, PARROT_QUESTION, PARROT)
    assert nll_live < 0.5 * nll_plain and nll_plain - nll_live > 1.0, (nll_live, nll_plain)

    chunks = _sse_chunks(requests.post(f"{url}/v1/chat/completions", headers=AUTH, stream=True,
                                       json=chat | {"stream": True}, timeout=300))
    assert chunks[0]["epicache"]["live_tokens"] == chunks[-1]["epicache"]["live_tokens"] == \
        lib.live_tokens
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == lib.answer
    native = _answer(url, conv.conversation_id, PARROT_QUESTION, live=LIVE_TAIL).json()
    assert (native["answer"], native["live_tokens"]) == (lib.answer, lib.live_tokens)


@e2e
def test_a_live_tail_over_its_limit_is_a_422_naming_the_field(local_app, built):
    """Over its tokens (the router renders and counts it) or its characters (before any
    tokenizer): 422 naming the field, on both routes; a role with no turn here, or a message
    after the question, 422 naming the message."""
    url, _ = local_app
    cid = built[2][0].conversation_id
    chat = f"{url}/v1/chat/completions"

    def refused(r) -> str:
        assert r.status_code == 422, (r.status_code, r.text)
        return r.json()["error"]["message"]

    def ask(earlier: list[dict], **extra) -> requests.Response:
        return requests.post(chat, headers=AUTH, timeout=120, json={
            "conversation_id": cid, "max_tokens": MAX_NEW, **extra,
            "messages": [*earlier, {"role": "user", "content": "Who?"}]})

    long_tail = [{"role": "user", "content": "why " * 3000}]  # ~3,000 tokens, 12,000 characters
    message = refused(ask(long_tail))
    assert message.startswith("field 'messages': ") and "the limit is 2048 tokens" in message
    assert "field 'messages'" in refused(ask(long_tail, stream=True))  # a status, not a stream
    message = refused(ask([{"role": "user", "content": "why " * 5000}]))
    assert "field 'messages'" in message and "the limit is 16,384 characters" in message
    message = refused(_answer(url, cid, "Who?", live=long_tail))
    assert message.startswith("field 'live': ") and "2048 tokens" in message
    assert "field 'messages.1.role'" in refused(ask([
        {"role": "user", "content": "Call the tool."}, {"role": "tool", "content": "42"}]))
    assert "field 'messages.1'" in refused(requests.post(chat, headers=AUTH, timeout=60, json={
        "conversation_id": cid, "messages": [{"role": "user", "content": "Who?"},
                                             {"role": "assistant", "content": "Ann"}]}))
    assert "field 'live.0.content'" in refused(_answer(url, cid, "Who?",
                                                       live=[{"role": "user"}]))
    assert ask(LIVE_TAIL).status_code == 200  # and a tail within the limit is answered


@e2e
def test_stream_is_openai_server_sent_events(local_app, built):
    url, _ = local_app
    cid, question = _questions(built[2], 1)[-1]
    r = requests.post(f"{url}/v1/chat/completions", headers=AUTH, stream=True, timeout=300,
                      json={"conversation_id": cid, "stream": True, "max_tokens": MAX_NEW,
                            "messages": [{"role": "user",
                                          "content": [{"type": "text", "text": question}]}]})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    lines = [line for line in r.iter_lines(decode_unicode=True) if line]
    assert all(line.startswith("data: ") for line in lines) and lines[-1] == "data: [DONE]"
    chunks = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
    assert {c["object"] for c in chunks} == {"chat.completion.chunk"}
    assert len({c["id"] for c in chunks}) == 1
    assert all("delta" in c["choices"][0] for c in chunks)
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks).strip()
    assert chunks[-1]["epicache"]["timings_ms"].keys() == {"embed", "route", "fetch", "decode"}


@e2e
def test_conversation_endpoint_lists_episodes(local_app, built):
    url, _ = local_app
    conv = built[2][0]
    r = requests.get(f"{url}/v1/conversations/{conv.conversation_id}", headers=AUTH, timeout=60)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["episodes_built"] == len(body["episodes"]) == 2
    for ep in body["episodes"]:
        assert ep["medoid_text"] and ep["object_bytes"] > 0 and ep["kv_bytes"] > 0
        assert ep["mean_budget"] == pytest.approx(128) and len(ep["layer_budgets"]) == 30


@e2e
def test_error_statuses_and_messages(local_app, built):
    url, _ = local_app
    broken_keys = built[3]
    cid = built[2][0].conversation_id
    post = f"{url}/v1/conversations/{cid}/answer"

    def error(r, status):
        assert r.status_code == status, (r.status_code, r.text)
        assert "Traceback" not in r.text
        return r.json()["error"]["message"]

    store_dir = str(built[1])
    for r in (_answer(url, "unknown-0000", "Who?"),
              requests.get(f"{url}/v1/conversations/unknown-0000", headers=AUTH, timeout=60)):
        message = error(r, 404)
        assert "no manifest in this store" in message and store_dir not in r.text
    assert "invalid conversation id" in error(_answer(url, "a..b", "Who?"), 400)
    assert "not valid JSON" in error(requests.post(
        post, headers=AUTH | {"Content-Type": "application/json"}, data='{"question": ',
        timeout=60), 400)
    assert "field 'question'" in error(requests.post(post, headers=AUTH, json={}, timeout=60), 422)
    assert "field 'question'" in error(requests.post(post, headers=AUTH, json={"question": 3},
                                                     timeout=60), 422)
    assert "must be a JSON object" in error(requests.post(post, headers=AUTH, json=["q"],
                                                          timeout=60), 422)
    assert "empty" in error(_answer(url, cid, "   "), 422)
    assert "the limit is 4,096 characters" in error(_answer(url, cid, "why " * 1100), 422)
    assert "the limit is 512 tokens" in error(_answer(url, cid, "why " * 1000), 422)  # decoder's
    assert "the limit is 512 tokens" in error(requests.post(  # streamed: a status, not a stream
        f"{url}/v1/chat/completions", headers=AUTH, timeout=60, json={
            "conversation_id": cid, "stream": True,
            "messages": [{"role": "user", "content": "why " * 1000}]}), 422)
    assert "max_new_tokens" in error(_answer(url, cid, "Who?", max_new_tokens=0), 422)
    assert "temperature" in error(_answer(url, cid, "Who?", temperature=-1), 422)
    assert "not valid JSON" in error(requests.post(  # NaN is not JSON
        post, headers=AUTH | {"Content-Type": "application/json"}, timeout=60,
        data='{"question": "Who?", "temperature": NaN}'), 400)
    chat = f"{url}/v1/chat/completions"
    assert "conversation_id" in error(requests.post(chat, headers=AUTH, timeout=60, json={
        "messages": [{"role": "user", "content": "Who?"}]}), 422)
    assert "role 'user'" in error(requests.post(chat, headers=AUTH, timeout=60, json={
        "conversation_id": cid, "messages": [{"role": "system", "content": "Hi"}]}), 422)
    # bearer token
    assert "bearer token" in error(_answer(url, cid, "Who?", headers={}), 401)
    r = _answer(url, cid, "Who?", headers={"Authorization": "Bearer wrong"})
    assert "bearer token" in error(r, 401) and r.headers["www-authenticate"] == "Bearer"
    assert error(requests.post(post, data="{", timeout=60), 401)  # auth before parsing
    # a cache failing its checksum: 503 on both endpoints, never an answer, and the object's
    # key and the store's path only in the server's log
    message = error(_answer(url, "broken-0000", "What did they cook?"), 503)
    assert "failed its checksum" in message and not any(k in message for k in broken_keys)
    r = requests.post(chat, headers=AUTH, timeout=60, json={
        "conversation_id": "broken-0000", "stream": True,
        "messages": [{"role": "user", "content": "Where did they go hiking?"}]})
    message = error(r, 503)
    assert "failed its checksum" in message and not any(k in message for k in broken_keys)
    assert store_dir not in message
    assert _answer(url, cid, "Who?").status_code == 200  # and the app still answers


@e2e
def test_one_damaged_conversation_is_one_damaged_conversation(local_app, built, capsys):
    """A store with a garbage manifest (the first the server read at start) and conversations
    whose objects are deleted, truncated or claim a 4 EiB header: each answers 503 naming the
    conversation and no object or path, /healthz counts and names them, and every other
    conversation is answered, over HTTP and by `jobs.answer` across conversations."""
    import struct

    from jobs import answer

    url, _ = local_app
    _, store_dir, conversations, _ = built
    store = LocalStore(store_dir)
    good = [c.conversation_id for c in conversations]
    damaged = {"gone-0000": lambda data: None, "cut-0000": lambda data: data[:len(data) // 2],
               "huge-0000": lambda data: struct.pack("<Q", 2**62) + data[8:]}
    keys = [k for cid, how in damaged.items() for k in _corrupt_copy(store, good[1], cid, how)]
    for cid in [*damaged, "aaa-garbage", "broken-0000"]:
        r = _answer(url, cid, "Where did they go hiking?")
        assert r.status_code == 503, (cid, r.text)
        message = r.json()["error"]["message"]
        assert message.startswith(f"conversation {cid!r}: ") and "repairs it" in message or \
            "rebuilds it" in message, message
        assert store_dir.as_posix() not in r.text and not any(k in r.text for k in keys)
    health = requests.get(f"{url}/healthz", headers=AUTH, timeout=60).json()
    assert health["conversations_corrupt"] >= 5
    assert {*damaged, "aaa-garbage", "broken-0000"} <= set(health["corrupt_conversations"])
    assert "corrupt_conversations" not in requests.get(f"{url}/healthz", timeout=60).json()
    for cid in good:
        assert _answer(url, cid, "Where did they go hiking?").status_code == 200

    capsys.readouterr()
    code = answer.main(["--store", str(store_dir), "--conversation", good[0], "--conversation",
                        "gone-0000", "--conversation", good[1], "--question", "Who?",
                        "--max-new-tokens", "4", "--json"])
    out, err = capsys.readouterr()
    assert code == 1, err
    assert [json.loads(line)["conversation_id"] for line in out.splitlines()] == good
    [line] = [line for line in err.splitlines() if line.startswith("error")]  # Ray logs too
    assert line.startswith("error: conversation gone-0000: ") and "the build run again" in line
    assert "Traceback" not in err


@e2e
def test_bodies_are_bounded_before_they_are_read(local_app, built):
    """Through Serve's proxy to the router: a 100 MB body is a 413 after its first 64 KiB (its
    Content-Length), a chunked one once its bytes pass the limit (no end ever sent); 100,000
    nested brackets a 400; a JSON body sent as text/plain (what a web page can send cross-site
    without asking) a 415, on both POST endpoints."""
    from tests.support import raw_http

    url, port = local_app
    cid = built[2][0].conversation_id
    path = f"/v1/conversations/{cid}/answer"
    json_auth = AUTH | {"Content-Type": "application/json"}
    status, text = raw_http.request(port, path, json_auth | {"Content-Length": str(10**8)},
                                    [b" " * 65536], timeout=60)
    assert status == 413 and "bytes" in json.loads(text)["error"]["message"]
    status, _ = raw_http.request(port, path, json_auth | {"Transfer-Encoding": "chunked"},
                                 raw_http.chunked([b" " * 65536] * 17), timeout=60)
    assert status == 413
    r = requests.post(f"{url}{path}", headers=json_auth, data="[" * 100_000, timeout=60)
    assert r.status_code == 400 and "deeper than" in r.json()["error"]["message"]
    for endpoint, body in ((path, {"question": "Who?"}), ("/v1/chat/completions", {
            "conversation_id": cid, "messages": [{"role": "user", "content": "Who?"}]})):
        r = requests.post(f"{url}{endpoint}", headers=AUTH | {"Content-Type": "text/plain"},
                          data=json.dumps(body), timeout=60)
        assert r.status_code == 415, r.text
        r = requests.post(f"{url}{endpoint}", timeout=300, data=json.dumps(body), headers=AUTH | {
            "Content-Type": "application/json; charset=utf-8"})
        assert r.status_code == 200, r.text


@e2e
def test_model_mismatch_is_an_error(local_app, built):
    from pipeline.store.catalogue.manifest import read_manifest, write_manifest

    url, _ = local_app
    store = LocalStore(built[1])
    rows = [dataclasses.replace(row, conversation_id="other-model-0000",
                                model_id="SomeOtherModel-1B")
            for row in read_manifest(store, "synth-0000")]
    write_manifest(store, "other-model-0000", rows)
    r = _answer(url, "other-model-0000", "Who?")
    assert r.status_code == 409 and "another model" in r.json()["error"]["message"]


@e2e
def test_caches_of_other_model_files_or_without_fingerprints_are_409s(local_app, built):
    """Manifests naming the served model but other files of it (a fine-tune in its folder), or
    no files at all (built before fingerprints): 409 naming the fix, no cache fetched."""
    from pipeline.store.catalogue.manifest import read_manifest, write_manifest

    url, _ = local_app
    store = LocalStore(built[1])
    for cid, change, says in (("other-files-0000", {"model_fingerprint": "0123456789abcdef"},
                               "other files of them"),
                              ("other-encoder-0000", {"encoder_fingerprint": "0123456789abcdef"},
                               "other files of them"),
                              ("unbound-0000", {"model_fingerprint": None,
                                                "encoder_fingerprint": None},
                               "needs a rebuild")):
        write_manifest(store, cid, [dataclasses.replace(row, conversation_id=cid, **change)
                                    for row in read_manifest(store, "synth-0000")])
        before = _stats(url)["misses"]
        r = _answer(url, cid, "Who?")
        assert r.status_code == 409 and says in r.json()["error"]["message"], r.text
        assert _stats(url)["misses"] == before  # refused before any fetch


@e2e
def test_a_changed_manifest_is_read_again(local_app, built):
    from pipeline.store.catalogue.manifest import read_manifest, write_manifest

    url, _ = local_app
    store = LocalStore(built[1])
    rows = [dataclasses.replace(row, conversation_id="changing-0000")
            for row in read_manifest(store, "synth-0001")]
    write_manifest(store, "changing-0000", rows)
    info = lambda: requests.get(f"{url}/v1/conversations/changing-0000", headers=AUTH,  # noqa: E731
                                timeout=60).json()
    assert len(info()["episodes"]) == 2
    write_manifest(store, "changing-0000", rows[1:])  # rebuilt with one episode
    assert [e["episode"] for e in info()["episodes"]] == [rows[1].episode]
    body = _answer(url, "changing-0000", "Where did they go hiking?").json()
    assert body["episode"] == rows[1].episode


@e2e
def test_a_conversation_grown_while_it_is_answered_is_served_at_its_new_version(local_app, built):
    """Questions keep coming while a session is appended to the conversation (the real build
    with SmolLM2): every answer succeeds, each from one version, and once the new manifest is
    committed the server reads the new objects and answers as the library does from them."""
    from pipeline.builder.conversation import build_conversation
    from pipeline.config import GrowthConfig
    from pipeline.corpus.schema import Turn
    from pipeline.store.catalogue.manifest import read_manifest, write_manifest

    url, _ = local_app
    store, source = LocalStore(built[1]), built[2][1]
    cid = "growing-0001"  # a copy: the other tests' conversation stays as built
    write_manifest(store, cid, [dataclasses.replace(r, conversation_id=cid)
                                for r in read_manifest(store, source.conversation_id)])
    info = lambda: requests.get(f"{url}/v1/conversations/{cid}", headers=AUTH,  # noqa: E731
                                timeout=60).json()
    before = info()
    session = max(t.session for t in source.turns) + 1
    said = ["We finally booked the trip to Lisbon for the spring.",
            "Lisbon! Are you taking the night train or flying?",
            "Flying, then a tram up to the castle on the first morning.",
            "Bring good shoes, the hills there are steep."]
    new = tuple(Turn(turn_id=f"G{i}", speaker=source.speakers[i % 2], text=text, session=session,
                     timestamp="3 June 2024") for i, text in enumerate(said))
    grown = dataclasses.replace(source, conversation_id=cid, turns=source.turns + new)
    question = "Where did they book a trip to?"
    stop, statuses = threading.Event(), []

    def keep_asking():
        while not stop.is_set():
            statuses.append(_answer(url, cid, question).status_code)

    asking = threading.Thread(target=keep_asking)
    asking.start()
    try:
        # the new session is one window on a new topic: far from every episode, which the
        # default rule would re-cluster; here it is appended whatever its topic
        records = build_conversation(grown, _config(), store,
                                     GrowthConfig(far_similarity=-1.0)).records
    finally:
        stop.set()
        asking.join()
    assert statuses and set(statuses) == {200}, statuses
    assert [r.appends for r in records] == [1] * len(records)
    after = info()
    assert after["appends"] == 1 and after["turns"] == len(grown.turns)
    assert after["tokens"] > before["tokens"]
    assert [e["object_key"] for e in after["episodes"]] == [r.object_key for r in records]
    served = _answer(url, cid, question).json()
    library = Answerer(store, topup=TOPUP).answer(cid, question, MAX_NEW)
    assert (served["episode"], served["answer"]) == (library.episode, library.answer)
    assert served["topup"]["turn_ids"] == library.topup["turn_ids"]


@e2e
def test_concurrent_requests_all_succeed(local_app, built):
    url, _ = local_app
    pairs = _questions(built[2], 4)
    jobs = [pairs[i % len(pairs)] for i in range(32)]

    def one(i_pair):
        i, (cid, q) = i_pair
        if i % 4 == 3:  # a quarter through the OpenAI endpoint
            r = requests.post(f"{url}/v1/chat/completions", headers=AUTH, timeout=600, json={
                "conversation_id": cid, "max_tokens": 4,
                "messages": [{"role": "user", "content": q}]})
            return r.status_code, r.json()["choices"][0]["message"]["content"] if r.ok else r.text
        r = requests.post(f"{url}/v1/conversations/{cid}/answer", headers=AUTH, timeout=600,
                          json={"question": q, "max_new_tokens": 4})
        return r.status_code, r.json()["answer"] if r.ok else r.text

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(one, enumerate(jobs)))
    assert [s for s, _ in results] == [200] * 32, results
    assert all(text.strip() for _, text in results)


@e2e
def test_answers_decoded_in_a_batch_equal_those_decoded_alone(local_app, built):
    """Greedy answers asked one at a time, then all at once (the replica batches them: JSON
    and streamed requests over different conversations and episodes), are the same."""
    url, _ = local_app
    pairs = _questions(built[2], 3)

    def chat_stream(cid, q):
        r = requests.post(f"{url}/v1/chat/completions", headers=AUTH, stream=True, timeout=300,
                          json={"conversation_id": cid, "stream": True, "max_tokens": MAX_NEW,
                                "messages": [{"role": "user", "content": q}]})
        assert r.status_code == 200, r.text
        chunks = [json.loads(line.removeprefix("data: ")) for line in
                  r.iter_lines(decode_unicode=True) if line and line != "data: [DONE]"]
        return "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)

    def one(i_pair):
        i, (cid, q) = i_pair
        if i % 2:
            return chat_stream(cid, q)
        r = _answer(url, cid, q)
        assert r.status_code == 200, r.text
        return r.json()["answer"]

    alone = [one(p) for p in enumerate(pairs)]
    before = _stats(url)["batch"]
    with ThreadPoolExecutor(len(pairs)) as pool:
        together = list(pool.map(one, enumerate(pairs)))
    after = _stats(url)["batch"]
    assert after["peak_batch"] >= 2 and after["mean_batch"] > before["mean_batch"]
    assert together == alone and all(a.strip() for a in alone)


@e2e
def test_bench_serve_reports_the_split(local_app, built, tmp_path):
    """`python -m jobs.bench.serve` against the running app: its table and its figures."""
    url, _ = local_app
    figures = tmp_path / "figures.json"
    proc = subprocess.run(
        [sys.executable, "-m", "jobs.bench.serve", "--url", url, "--corpus", str(built[0]),
         "--conversations", "2", "--questions-per-conversation", "2", "--requests", "8",
         "--concurrency", "4", "--max-new-tokens", "4", "--token", TOKEN, "--json",
         str(figures)], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert "share of the turn" in proc.stdout
    result = json.loads(figures.read_text())
    assert result["errors"] == 0 and result["cache_hit_rate"] == 1.0  # warmed up first
    assert 0 < result["overhead_share"] < 1 and result["requests_per_s"] > 0
    assert set(result["stages_ms"]) == {"embed", "route", "fetch", "decode"}


# ---------------------------------------------------------------------------------------------
# `python -m jobs.serve` over S3
# ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def s3_app(built, s3_server, tmp_path_factory):
    """The same store copied object by object into SeaweedFS, served by `python -m jobs.serve`
    in a subprocess (its own local Ray; AWS credentials and the token only in its environment)."""
    local = LocalStore(built[1])
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("AWS_") and k not in ("RAY_ADDRESS", "EPICACHE_S3_ENDPOINT")}
    env |= s3_server.env() | {"EPICACHE_SERVE_TOKEN": TOKEN, "OMP_NUM_THREADS": "1"}
    uri = s3_server.uri("serve/store")
    saved = {k: os.environ.get(k) for k in s3_server.env()}
    os.environ.update(s3_server.env())
    try:
        s3 = open_store(uri)
        for key in local.list():
            s3.put(key, local.get(key))
    finally:
        for k, v in saved.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
    port = _free_port()
    log = open(tmp_path_factory.mktemp("serve-s3") / "serve.log", "w+")
    proc = subprocess.Popen(
        [sys.executable, "-m", "jobs.serve", "--store", uri, "--port", str(port),
         "--router-cpus", "0", "--decoder-cpus", "0", "--cache-bytes", "0"],
        cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(url, proc=proc, log=log)
        yield url, port, uri, proc, log
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=30)
        log.close()


@e2e
def test_s3_app_answers_like_the_library_and_streams(s3_app, built, s3_env):
    import openai

    url, port, uri, *_ = s3_app
    assert _listens_on_loopback_only(port)
    answerer = Answerer(open_store(uri))
    for cid, question in _questions(built[2], 1):
        r = _answer(url, cid, question)
        assert r.status_code == 200, r.text
        body = r.json()
        lib = answerer.answer(cid, question, max_new_tokens=MAX_NEW)
        assert body["episode"] == lib.episode and body["answer"].strip()
        assert body["similarity"] == pytest.approx(lib.similarity, abs=1e-4)
        client = openai.OpenAI(api_key=TOKEN, base_url=f"{url}/v1", max_retries=0)
        chunks = list(client.chat.completions.create(
            model="any", messages=[{"role": "user", "content": question}], max_tokens=MAX_NEW,
            stream=True, extra_body={"conversation_id": cid}))
        assert "".join(c.choices[0].delta.content or "" for c in chunks) == body["answer"]
    assert _answer(url, cid, "Who?", headers={}).status_code == 401  # token from the env
    r = _answer(url, "broken-0000", "What did they cook?")
    assert r.status_code == 503 and "failed its checksum" in r.json()["error"]["message"]
    assert "caches/broken-0000/" not in r.text and uri not in r.text


@e2e
def test_s3_app_stops_on_interrupt(s3_app, s3_server):
    *_, proc, log = s3_app
    proc.send_signal(signal.SIGINT)
    proc.wait(timeout=90)
    log.seek(0)
    out = log.read()
    assert proc.returncode == 0, out[-3000:]
    assert "serving s3://" in out and "stopped" in out
    assert s3_server.secret_key not in out and TOKEN not in out
