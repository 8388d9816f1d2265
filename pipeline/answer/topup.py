"""The question-time top-up: the question's nearest turns, prefilled right before the question.

An episode's cache holds its own turns well and the others' hardly at all, so a question routed
to the wrong episode is answered nearly without its evidence, and even the evidence a cache
holds sits far back, at compacted positions (docs/quality.md). Once the question is known, its
nearest turns in the whole conversation are found in the turn index
(`pipeline.store.objects.turn_index`; turn-level keys, as LongMemEval found them best), rendered as
the conversation renders them and prefilled after the cache, before the question, a few hundred
tokens at most (`TopUpConfig`). With `skip_held`, the turns the episodes read hold are
skipped: a question routed right then usually reads no top-up (answers lose: docs/scorecard.md).

A turn index that is missing or corrupt is not an error: the question is answered from its
episode alone and the answer says so (`TopUp.note`).
"""

from __future__ import annotations

import functools
import logging
import threading
from collections import OrderedDict
from dataclasses import asdict, dataclass, replace
from typing import Callable

import numpy as np

from pipeline.config import TopUpConfig
from pipeline.kv.cache import EpisodicCache
from pipeline.kv.layout import token_mask
from pipeline.store.backends.base import Store
from pipeline.store.catalogue.manifest import ManifestRecord
from pipeline.store.objects.turn_index import (
    IndexedTurn,
    TurnIndex,
    TurnIndexUnavailable,
    read_turn_index,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TopUp:
    """What a question reads after the cache: `text` ("" when nothing), the turns in it, its
    tokens, and `status`: "used", "none" (nothing to read: with `skip_held`, the episodes read
    hold the nearest turns),
    "off" (not configured) or "unavailable" (no usable turn index; `note` says why).
    `hidden_spans`: with `TopUpConfig.read_once`, the [start, end) token spans of its turns,
    whose entries the cache read hides for this question (`EpisodicCache.without_tokens`)."""
    text: str = ""
    turn_ids: tuple[str, ...] = ()
    tokens: int = 0
    status: str = "off"
    note: str = ""
    hidden_spans: tuple[tuple[int, int], ...] = ()

    def as_dict(self) -> dict:
        return asdict(self) | {"turn_ids": list(self.turn_ids),
                               "hidden_spans": [list(s) for s in self.hidden_spans]}

    @classmethod
    def unavailable(cls, note: str) -> "TopUp":
        return cls(status="unavailable", note=note)


def render_topup(turns: list[IndexedTurn]) -> str:
    """The turns as the conversation renders them (a date line per session), after a blank
    line, in conversation order."""
    lines: list[str] = []
    session = None
    for t in turns:
        if t.session != session:
            session = t.session
            lines += ["", t.date_line]
        lines.append(t.line)
    return "\n".join(["", *lines]) if lines else ""


def select_topup(index: TurnIndex, question_embedding: np.ndarray, held: set[str],
                 config: TopUpConfig, count_tokens: Callable[[str], int]) -> TopUp:
    """The question's top-up: of its `config.turns` nearest turns, those not in `held` (the
    turns skipped as read: the episodes' with `skip_held`, else none; with
    `config.nearer_than_held`, only those nearer the question than every held turn), best first
    while the text stays within `config.max_tokens`."""
    if not config.enabled:
        return TopUp()
    if not index.turns:
        return TopUp(status="none")
    scores = index.scores(question_embedding)
    nearest = np.argsort(-scores, kind="stable")[:config.turns]
    if config.nearer_than_held:
        held_scores = [s for t, s in zip(index.turns, scores) if t.turn_id in held]
        if held_scores:
            nearest = [i for i in nearest if scores[i] > max(held_scores)]
    chosen: list[int] = []
    tokens = 0
    for i in nearest:
        if index.turns[i].turn_id in held:
            continue
        if line_tokens(count_tokens, index.turns[i].line) > config.max_tokens - tokens + SLACK:
            continue  # cannot fit (a quick bound; the rendered text is counted below)
        text = render_topup([index.turns[j] for j in sorted(chosen + [int(i)])])
        n = count_tokens(text)
        if n <= config.max_tokens:
            chosen.append(int(i))
            tokens = n
    if not chosen:
        return TopUp(status="none")
    turns = [index.turns[j] for j in sorted(chosen)]
    topup = TopUp(render_topup(turns), tuple(t.turn_id for t in turns), tokens, "used")
    return hiding_turns(topup, turns) if config.read_once else topup


def hiding_turns(topup: TopUp, turns: list[IndexedTurn]) -> TopUp:
    """The top-up with its turns' token spans to hide from the cache read; an index without
    spans (format 1) hides nothing, and the top-up's note says so."""
    if any(t.span is None for t in turns):
        return replace(topup, note="the turn index holds no token spans (built before them), "
                                   "so the cache's entries of the top-up's turns are read too: "
                                   "python -m jobs.build --force stores an index with them")
    return replace(topup, hidden_spans=tuple(t.span for t in turns))


def read_view(cache: EpisodicCache, hidden_spans) -> EpisodicCache:
    """The cache as a question reads it: with a top-up read once (`TopUp.hidden_spans`),
    a view without its turns' entries (the stored and resident cache unchanged)."""
    if not hidden_spans:
        return cache
    return cache.without_tokens(token_mask(hidden_spans, cache.tokens_seen))


# a line's own tokens can exceed what it adds to the rendered text by a token or two (the
# tokenizer joins it to the newline before it): a turn is skipped unseen only past this slack
SLACK = 4


@functools.lru_cache(maxsize=1 << 16)
def line_tokens(count_tokens: Callable[[str], int], line: str) -> int:
    """A turn line's tokens alone (memoised: a long top-up tries every turn of the index)."""
    return count_tokens(line)


def held_turns(member_lists) -> set[str]:
    """The turns the episodes read hold (their windows' turns; none known: an empty set)."""
    return {t for members in member_lists for t in (members or ())}


REBUILD = "rebuild it to top up its questions: python -m jobs.build --force (same corpus and store)"
# a stored index that is missing or damaged: the build's skip check finds it and stores it again
REPAIR = ("re-run the build to repair it: python -m jobs.build (same corpus and store; "
          "--verify also finds damage that keeps the object's size)")


# the turn indexes a router keeps: about 300 LoCoMo-length conversations' (~200 KiB each)
KEEP_BYTES = 64 << 20


class TopUps:
    """Questions' top-ups over their conversations' turn indexes, each index fetched once
    (verified) and kept, the most recently used first, within `keep_bytes` of stored index
    bytes (the newest always kept): a bound in bytes, since one long conversation's index can
    weigh a hundred short ones'. An index that cannot be used gives `TopUp.unavailable` saying
    why, logged, and is tried again at the next question."""

    def __init__(self, store: Store, config: TopUpConfig = TopUpConfig(),
                 keep_bytes: int = KEEP_BYTES):
        self.store, self.config, self.keep_bytes = store, config, keep_bytes
        self._indexes: OrderedDict[tuple[str, str], tuple[TurnIndex, int]] = OrderedDict()
        self._lock = threading.Lock()
        self.fetched_bytes = 0
        self.held_bytes = 0

    def index(self, record: ManifestRecord) -> TurnIndex:
        """The conversation's turn index (`TurnIndexUnavailable` if it has none usable)."""
        stored = record.turn_index
        if stored is None:
            raise TurnIndexUnavailable(f"conversation {record.conversation_id!r} was built "
                                       f"before turn indexes: {REBUILD}")
        key = (stored.key, stored.sha256)
        with self._lock:
            if key in self._indexes:
                self._indexes.move_to_end(key)
                return self._indexes[key][0]
        index = read_turn_index(self.store, stored, record.conversation_id,
                                record.encoder_fingerprint)
        size = stored.size or 0
        with self._lock:
            self.fetched_bytes += size
            if key not in self._indexes:  # another question may have read it meanwhile
                self._indexes[key] = (index, size)
                self.held_bytes += size
            while self.held_bytes > self.keep_bytes and len(self._indexes) > 1:
                self.held_bytes -= self._indexes.popitem(last=False)[1][1]
        return index

    def for_question(self, records: list[ManifestRecord], read: list[ManifestRecord],
                     question_embedding: np.ndarray, count_tokens: Callable[[str], int]) -> TopUp:
        """The top-up of a question routed to `read` (records of one conversation); with
        `skip_held`, without the turns of the episodes read."""
        if not self.config.enabled:
            return TopUp()
        try:
            index = self.index(records[0])
        except TurnIndexUnavailable as e:
            log.warning("answering from the episode alone: %s", e)
            return TopUp.unavailable(str(e) if records[0].turn_index is None else
                                     f"{e}; {REPAIR}")
        held = held_turns(r.member_turn_ids for r in read) if self.config.skip_held else set()
        return select_topup(index, question_embedding, held, self.config, count_tokens)
