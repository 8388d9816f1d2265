"""A conversation's turn index on disk: every turn's text and its embedding, for the top-up.

The question-time top-up (`pipeline.answer.topup`) looks for the question's nearest turns in the
whole conversation, not only in the episode it was routed to, and prefills the ones the episode
lacks. This object is what it searches: safetensors (never pickle) holding `embeddings`
[turns, d] float16 (unit norm, the encoder's space), with the turns (id, session, the session's
date line and the turn's rendered line) and what the index is bound to (conversation, encoder
name and fingerprint) in the header (one JSON metadata entry, `index`). From format 2 on each
turn also holds its [start, end) token span in the ids the conversation's caches were built
from, so a top-up that reads its turns once (`TopUpConfig.read_once`) can hide the caches'
entries of them. It is written in stage 1 of a build, before the manifest that names it,
under a key of its own content (`turn_index_key`), and checked as a cache is: the manifest
records its length and SHA-256, and a reader checks both and the header's binding.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

import numpy as np
from safetensors import SafetensorError
from safetensors.numpy import load as st_load
from safetensors.numpy import save as st_save

from pipeline.corpus.schema import check_safe_id
from pipeline.store.backends.base import ObjectNotFound, Store, StoreError

FORMAT = 2  # 2: each turn's token span; 1 (read): none
READABLE_FORMATS = (1, 2)
MAX_TURNS = 1_000_000  # a header claiming more is corrupt (limits what a reader allocates)
# a manifest claiming a bigger index is corrupt: nothing that large is read (a 1,000-turn
# conversation's index is about 1 MB)
MAX_INDEX_BYTES = 1 << 30


class TurnIndexUnavailable(RuntimeError):
    """A turn index that cannot be used: missing, the wrong size or checksum, or bound to
    another conversation or encoder. A question is then answered from its episode alone."""


@dataclass(frozen=True)
class IndexedTurn:
    turn_id: str
    session: int
    date_line: str  # the session's header as the conversation renders it
    line: str  # the turn as the conversation renders it
    # [start, end) of its tokens in the ids the caches were built from; None: not recorded
    # (a format-1 index, built before spans)
    span: tuple[int, int] | None = None


@dataclass(frozen=True)
class TurnIndex:
    conversation_id: str
    encoder_id: str
    encoder_fingerprint: str
    turns: tuple[IndexedTurn, ...]
    embeddings: np.ndarray  # [turns, d] float16, unit norm

    def __post_init__(self):
        if self.embeddings.ndim != 2 or len(self.embeddings) != len(self.turns):
            raise ValueError(f"{len(self.turns)} turns need [turns, d] embeddings, got "
                             f"{self.embeddings.shape}")

    def scores(self, question_embedding: np.ndarray) -> np.ndarray:
        """[turns] cosine similarity of each turn with the (unit norm) question."""
        return self.embeddings.astype(np.float32) @ question_embedding.astype(np.float32)


@dataclass(frozen=True)
class StoredIndex:
    """A turn index object in the store: what the manifest records of it."""
    key: str
    sha256: str
    size: int

    def fields(self) -> dict:
        """The manifest columns that name it."""
        return {"turn_index_key": self.key, "turn_index_sha256": self.sha256,
                "turn_index_bytes": self.size}


def turn_index_key(conversation_id: str, encoder_fingerprint: str, sha256: str) -> str:
    """Where a turn index goes: named by its content, so a grown conversation's new index is
    written beside the one being served (`jobs.gc` removes the old one once no manifest names
    it)."""
    return (f"turns/{check_safe_id(conversation_id)}/{encoder_fingerprint[:16]}/"
            f"index-{sha256[:16]}.safetensors")


def serialize(index: TurnIndex) -> bytes:
    """The object's bytes: the same index gives the same bytes, so the same key (the header is
    one metadata entry: safetensors writes several in a random order)."""
    header = {"format": FORMAT, "conversation_id": index.conversation_id,
              "encoder_id": index.encoder_id, "encoder_fingerprint": index.encoder_fingerprint,
              "turns": [[t.turn_id, t.session, t.date_line, t.line,
                         *(t.span if t.span is not None else (None, None))]
                        for t in index.turns]}
    return st_save({"embeddings": np.ascontiguousarray(index.embeddings, dtype=np.float16)},
                   metadata={"index": json.dumps(header, ensure_ascii=False)})


def parse(data: bytes, name: str) -> TurnIndex:
    """The index in `data`, or `TurnIndexUnavailable` naming the object and what is wrong."""
    def bad(reason: str) -> TurnIndexUnavailable:
        return TurnIndexUnavailable(f"turn index {name} is corrupt: {reason}")

    try:
        header = json.loads(_metadata(data)["index"])
        rows = header["turns"]
        if header.get("format") not in READABLE_FORMATS:
            raise bad(f"format {header.get('format')!r}, this reader reads "
                      f"{', '.join(map(str, READABLE_FORMATS))}")
        if not isinstance(rows, list) or len(rows) > MAX_TURNS:
            raise bad("its turn list is not a list of at most "
                      f"{MAX_TURNS:,} turns")
        turns = tuple(_turn(row, header["format"]) for row in rows)
        embeddings = st_load(data)["embeddings"]
        return TurnIndex(header["conversation_id"], header["encoder_id"],
                         header["encoder_fingerprint"], turns, embeddings)
    except TurnIndexUnavailable:
        raise
    except (SafetensorError, KeyError, ValueError, TypeError, AttributeError) as e:
        raise bad(f"{type(e).__name__}: {e}") from None


def _turn(row: list, format: int) -> IndexedTurn:
    """A turn of the header's list: [id, session, date line, line] and, from format 2 on, its
    span's start and end (both null where it was not recorded)."""
    fields = 4 if format == 1 else 6
    if len(row) != fields:
        raise ValueError(f"a turn of {len(row)} fields, format {format} has {fields}")
    turn_id, session, date_line, line, *span = row
    if span and (span[0] is None) != (span[1] is None):
        raise ValueError(f"turn {turn_id!r} has half a span: {span}")
    if span and span[0] is not None and not 0 <= int(span[0]) <= int(span[1]):
        raise ValueError(f"turn {turn_id!r} has span {span}")
    return IndexedTurn(str(turn_id), int(session), str(date_line), str(line),
                       None if not span or span[0] is None else (int(span[0]), int(span[1])))


def _metadata(data: bytes) -> dict[str, str]:
    """The safetensors header's metadata, read with the header's own length checked first."""
    if len(data) < 8:
        raise ValueError("shorter than a safetensors header")
    length = int.from_bytes(data[:8], "little")
    if length > len(data) - 8:
        raise ValueError(f"its header claims {length:,} bytes of {len(data) - 8:,}")
    return json.loads(data[8:8 + length]).get("__metadata__") or {}


def store_turn_index(index: TurnIndex, store: Store) -> StoredIndex:
    data = serialize(index)
    checksum = hashlib.sha256(data).hexdigest()
    key = turn_index_key(index.conversation_id, index.encoder_fingerprint, checksum)
    store.put(key, data)
    return StoredIndex(key, checksum, len(data))


def read_turn_index(store: Store, stored: StoredIndex, conversation_id: str,
                    encoder_fingerprint: str | None) -> TurnIndex:
    """The conversation's turn index, checked against its manifest (length, SHA-256) and bound
    to the conversation and the encoder files whose space the question is embedded in;
    `TurnIndexUnavailable` saying why not."""
    if stored.size is not None and not 0 < stored.size <= MAX_INDEX_BYTES:
        raise TurnIndexUnavailable(f"turn index {stored.key}: its manifest claims {stored.size:,} "
                                   f"bytes (at most {MAX_INDEX_BYTES:,} are read)")
    try:
        with store.open(stored.key) as f:
            data = f.read(stored.size + 1 if stored.size is not None else -1)
    except ObjectNotFound:
        raise TurnIndexUnavailable(f"turn index {stored.key} is missing from the store") from None
    except (StoreError, OSError) as e:
        raise TurnIndexUnavailable(f"turn index {stored.key} cannot be read: {e}") from None
    return checked_turn_index(data, stored, conversation_id, encoder_fingerprint)


def checked_turn_index(data: bytes, stored: StoredIndex, conversation_id: str,
                       encoder_fingerprint: str | None) -> TurnIndex:
    """The index in `data`, the bytes read of `stored.key`, after every check a reader makes
    (`jobs.gc --verify` makes them on the bytes it read)."""
    if stored.size is not None and len(data) != stored.size:
        raise TurnIndexUnavailable(f"turn index {stored.key} holds {len(data)}"
                                   f"{'+' if len(data) > stored.size else ''} bytes, its "
                                   f"manifest says {stored.size}")
    if hashlib.sha256(data).hexdigest() != stored.sha256:
        raise TurnIndexUnavailable(f"turn index {stored.key} failed its checksum")
    index = parse(data, stored.key)
    if index.conversation_id != conversation_id:
        raise TurnIndexUnavailable(f"turn index {stored.key} belongs to conversation "
                                   f"{index.conversation_id!r}, not {conversation_id!r}")
    if encoder_fingerprint is not None and index.encoder_fingerprint != encoder_fingerprint:
        raise TurnIndexUnavailable(f"turn index {stored.key} was embedded with other encoder "
                                   f"files ({index.encoder_fingerprint}) than the episodes' "
                                   f"({encoder_fingerprint})")
    return index
