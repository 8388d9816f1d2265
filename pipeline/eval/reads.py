"""A cell's reads: what each of its methods' questions read, measured once on the cache it picks.

A cell builds its caches once; its methods may differ in what a question reads at question
time (`Read`: the route among an episodic cell's episodes, the top-up). Each read is measured
on the cache(s) its route picks for each question, and only there, its fields prefixed with
`Read.prefix`; a method's record is its read's fields (`select_read`). The questions of one
cache are measured together whatever read brought them there: one packed pass per cache.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from pipeline.answer.topup import TopUp
from pipeline.config import TopUpConfig
from pipeline.corpus.schema import Question
from pipeline.episodes import EpisodeSet, embed_texts
from pipeline.eval.methods import EvalConfig, Read
from pipeline.kv.cache import EpisodicCache
from pipeline.routers import ROUTERS, chosen

Key = tuple[int, ...]  # which cache a question reads: an episode, two joined, or the one cache
# (cache, question indices, each one's top-up, whether to generate each one's answer)
#   -> the measured fields of each
Measure = Callable[[EpisodicCache, list[int], list[TopUp], list[bool]], list[dict]]


@dataclass
class CellCaches:
    """The caches of a cell, by key, and which one each read of each question picks. `held`
    is the turns a key's cache holds whole (its episodes' windows; none for the others), which
    a top-up with `skip_held` skips."""
    get: Callable[[Key], EpisodicCache]
    choice: Callable[[Read, int], Key]
    held: Callable[[Key], set[str]] = lambda key: set()


def one_cache(cache: Callable[[], EpisodicCache]) -> CellCaches:
    """A cell with one cache every question reads (a baseline, the references)."""
    return CellCaches(lambda key: cache(), lambda read, i: (0,))


def question_embeddings(encoder, questions: list[Question]) -> np.ndarray:
    """[questions, d] unit-norm embeddings of the questions (the routers' and the top-up's)."""
    return embed_texts(encoder, [q.question for q in questions])


def route_scores(embeddings: np.ndarray, episodes: EpisodeSet) -> dict[str, np.ndarray]:
    """Every router's [questions, episodes] scores of the questions' `embeddings`."""
    index = episodes.route_index()
    return {name: np.stack([router.scores(e, index) for e in embeddings]) if len(embeddings)
            else np.zeros((0, index.n_episodes)) for name, router in ROUTERS.items()}


def routed(scores: dict[str, np.ndarray]) -> Callable[[Read, int], Key]:
    """The episode (or two, best first: joined as the answer path joins them) a read's route
    picks for question i."""
    def choice(read: Read, i: int) -> Key:
        router, two_below = read.route
        return chosen(scores[router][i], two_below)
    return choice


def measure_reads(n_questions: int, reads: tuple[Read, ...], caches: CellCaches,
                  measure: Measure, topup_of: Callable[[TopUpConfig, int, set[str]], TopUp],
                  generates: Callable[[Read, int], bool] = lambda read, i: False) -> list[dict]:
    """Per question, every read's measured fields (prefixed `Read.prefix`) and the cache it
    read (`<prefix>read`): each cache taken once, its questions (of every read) measured
    together, each with its own top-up (`topup_of(config, question, turns skipped)`), answers
    generated where `generates(read, question)`."""
    jobs: dict[Key, list[tuple[int, Read]]] = {}
    for read in reads:
        for i in range(n_questions):
            jobs.setdefault(caches.choice(read, i), []).append((i, read))
    records: list[dict] = [{} for _ in range(n_questions)]
    for key in sorted(jobs):
        items, held = jobs[key], caches.held(key)
        topups = [TopUp() if read.topup is None else
                  topup_of(read.topup, i, held if read.topup.skip_held else set())
                  for i, read in items]
        answer = [generates(read, i) for i, read in items]
        for (i, read), fields in zip(items, measure(caches.get(key), [i for i, _ in items],
                                                    topups, answer)):
            records[i] |= {f"{read.prefix}{name}": value for name, value in fields.items()}
            records[i][f"{read.prefix}read"] = list(key)
    return records


READ_FIELD = re.compile(r"read[0-9a-f]{8}_(.+)")  # `Read.prefix` and a measured field


def select_read(record: dict, method: str, config: EvalConfig, read: Read | None = None) -> dict:
    """The record as `method` reads it: its read's measured fields under their plain names
    (every read's prefixed fields, and another read's plain ones, left out), and for an
    episodic method the episode (or two) its route picked. `read`: another read than the
    method's own (`rag` at a row's decode-time entries)."""
    read = config.read_of(method) if read is None else read
    fields = {k[len(read.prefix):]: v for k, v in record.items() if k.startswith(read.prefix)}
    if not fields:
        raise KeyError(f"the cell holds no read of {method!r} (its fields {read.prefix}*)")
    measured = {m.group(1) for m in map(READ_FIELD.fullmatch, record) if m}
    out = {k: v for k, v in record.items() if k not in measured and not READ_FIELD.fullmatch(k)}
    out |= fields | {"method": method}
    if read.route is None:
        return out
    episodes = fields["read"]
    scores = np.asarray(record[f"scores_{read.route[0]}"])
    return out | {
        "episode": episodes[0], "episodes_read": len(episodes),
        "route_similarity": float(scores[episodes[0]]),
        "route_hit": any(record["episode_hit"][k] for k in episodes),
        "route_margin": float(np.sort(scores)[-1] - np.sort(scores)[-2]) if len(scores) > 1
        else float("nan")}
