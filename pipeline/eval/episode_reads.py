"""An episodic cell's reads, so that any router's choice is a selection from one cell.

An EpiCache cell builds every episode's cache and measures every question on each of them, and
on the two-episode caches a "two" rule may read (each router's best two episodes, joined). It
also keeps every router's episode scores. A method's routing variant (`rwin`, `two20`, ...)
then picks its question's read from those (`select_route`): routing variants share one cell,
and the route-hit rate, retention on hits and misses, and bytes read per question of every
router come from the same caches.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from pipeline.corpus.schema import Question
from pipeline.episodes import EpisodeSet
from pipeline.eval.methods import EvalConfig, topup_prefix
from pipeline.kv.cache import EpisodicCache
from pipeline.routers import ROUTERS, chosen, ranked

# The fields a read decides; `select_route` fills them from the chosen read's lists.
READ_FIELDS = ("evidence_nll", "answer_nll", "evidence_kept", "kv_bytes", "bytes_tokens",
               "kept_entries", "topup_tokens", "topup_recall")


def question_embeddings(encoder, questions: list[Question]) -> np.ndarray:
    """[questions, d] unit-norm embeddings of the questions (the routers' and the top-up's)."""
    return encoder.encode([q.question for q in questions], normalize_embeddings=True,
                          show_progress_bar=False)


def route_scores(embeddings: np.ndarray, episodes: EpisodeSet) -> dict[str, np.ndarray]:
    """Every router's [questions, episodes] scores of the questions' `embeddings`."""
    index = episodes.route_index()
    return {name: np.stack([router.scores(e, index) for e in embeddings]) if len(embeddings)
            else np.zeros((0, index.n_episodes)) for name, router in ROUTERS.items()}


def candidate_pairs(scores: dict[str, np.ndarray]) -> dict[tuple[int, int], list[int]]:
    """The two-episode reads any router may make: (a, b) -> the questions whose best two they are."""
    pairs: dict[tuple[int, int], set[int]] = {}
    for table in scores.values():
        for i, row in enumerate(table):
            order = ranked(row)
            if len(order) > 1:
                pairs.setdefault(tuple(sorted(order[:2])), set()).add(i)
    return {pair: sorted(questions) for pair, questions in sorted(pairs.items())}


# (cache, question indices, the episodes it holds) -> the measured fields of those questions
Measure = Callable[[EpisodicCache, list[int], tuple[int, ...]], list[dict]]
Route = tuple[str, float]  # (router, two_below): `RoutingConfig`'s fields


def episodic_reads(questions: list[Question], members: list[tuple[str, ...]],
                   caches: list[EpisodicCache], scores: dict[str, np.ndarray],
                   measures: dict[str, tuple[Measure, Route | None]]) -> list[dict]:
    """Per question, the lists a router selects from: each episode's read (`episode_*`), each
    candidate pair's (`pair_*`), whether each episode holds the evidence, every router's
    scores. `members` are each episode's turns; each of `measures` (by field prefix: "" plain,
    `topup_prefix(...)` with a top-up) gives the measured fields of questions over a read
    (`READ_FIELDS` and any others): every read of every question when its route is None (the
    plain one, measured first), else only the read that route picks (NaN for the others)."""
    pairs = candidate_pairs(scores)
    everyone = list(range(len(questions)))
    pairs_of = [[p for p, idx in pairs.items() if i in idx] for i in everyone]
    records: list[dict] = [{} for _ in questions]
    for prefix, (measure, route) in measures.items():
        wanted = None if route is None else [
            tuple(sorted(chosen(scores[route[0]][i], route[1]))) for i in everyone]

        def measured(read: tuple[int, ...], candidates: list[int], cache) -> dict[int, dict]:
            idx = [i for i in candidates if wanted is None or wanted[i] == read]
            return dict(zip(idx, measure(cache(), idx, read))) if idx else {}

        per_episode = [measured((k,), everyone, lambda k=k: caches[k]) for k in range(len(caches))]
        per_pair = {pair: measured(pair, idx, lambda pair=pair: EpisodicCache.joined(
            [caches[pair[0]], caches[pair[1]]])) for pair, idx in pairs.items()}
        for i in everyone:
            if not records[i]:
                records[i] |= per_episode[0][i]
            records[i] |= {f"{prefix}episode_{f}": [_field(measured_k, i, f)
                                                    for measured_k in per_episode]
                           for f in READ_FIELDS}
            records[i] |= {f"{prefix}pair_{f}": [_field(per_pair[p], i, f) for p in pairs_of[i]]
                           for f in READ_FIELDS}
    for i, q in enumerate(questions):
        records[i] |= {"pair_a": [p[0] for p in pairs_of[i]], "pair_b": [p[1] for p in pairs_of[i]],
                       "episode_hit": [not set(q.evidence).isdisjoint(m) for m in members]}
        records[i] |= {f"scores_{name}": [float(x) for x in table[i]]
                       for name, table in scores.items()}
    return records


def _field(measured: dict[int, dict], question: int, name: str) -> float:
    return float(measured[question][name]) if question in measured else float("nan")


def select_route(record: dict, method: str, config: EvalConfig) -> dict:
    """The record as `method`'s router reads it: the episode (or two) it picks, and the
    measured fields of that read. Records of other methods are returned as they are."""
    if "scores_centroid" not in record:
        return record
    router, two_below = config.route_of(method)
    prefix = topup_prefix(config.topup_of(method), (router, two_below))
    scores = np.asarray(record[f"scores_{router}"])
    read = chosen(scores, two_below)
    if len(read) == 1:
        values = {f: record[f"{prefix}episode_{f}"][read[0]] for f in READ_FIELDS}
    else:
        pair = tuple(sorted(read))
        j = list(zip(record["pair_a"], record["pair_b"])).index(pair)
        values = {f: record[f"{prefix}pair_{f}"][j] for f in READ_FIELDS}
    return record | values | {
        "method": method, "episode": read[0], "episodes_read": len(read),
        "route_similarity": float(scores[read[0]]),
        "route_hit": any(record["episode_hit"][k] for k in read),
        "route_margin": float(scores[read[0]] - np.sort(scores)[-2]) if len(scores) > 1 else float("nan")}
