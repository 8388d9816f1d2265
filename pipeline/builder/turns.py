"""Stage 1's second product: the conversation's turn index (`pipeline.store.objects.turn_index`),
embedded with the build's encoder and stored before the manifest that names it.

A grown conversation's index is extended: the turns it already holds keep their embeddings (the
append path changes no turn it has seen), only the new ones are embedded.
"""

from __future__ import annotations

import numpy as np

from pipeline.corpus.render import render_session_header, render_turn
from pipeline.corpus.schema import Conversation
from pipeline.episodes import embed_texts
from pipeline.kv.layout import token_layout
from pipeline.store.backends.base import Store
from pipeline.store.catalogue.manifest import ManifestRecord
from pipeline.store.objects.turn_index import (
    IndexedTurn,
    StoredIndex,
    TurnIndex,
    TurnIndexUnavailable,
    read_turn_index,
    store_turn_index,
)


def indexed_turns(conv: Conversation, tokenizer=None) -> tuple[IndexedTurn, ...]:
    """The conversation's turns as indexed; with the model's `tokenizer`, each with its token
    span in the ids its caches are built from (`pipeline.kv.layout`)."""
    spans = (token_layout(tokenizer, conv).turn_spans if tokenizer is not None
             else [None] * len(conv.turns))
    return tuple(IndexedTurn(t.turn_id, t.session, render_session_header(t), render_turn(t), span)
                 for t, span in zip(conv.turns, spans))


def index_turns(conv: Conversation, encoder, encoder_id: str, encoder_fingerprint: str,
                previous: TurnIndex | None = None, tokenizer=None) -> TurnIndex:
    """The turn index of `conv`: each turn's rendered line embedded (unit norm) and, with the
    model's `tokenizer`, its token span. Turns `previous` holds with the same line keep its
    embeddings."""
    turns = indexed_turns(conv, tokenizer)
    known = {} if previous is None else {
        (t.turn_id, t.line): row for t, row in zip(previous.turns, previous.embeddings)}
    new = [t for t in turns if (t.turn_id, t.line) not in known]
    embedded = iter(embed_texts(encoder, [t.line for t in new]) if new else [])
    rows = [known[(t.turn_id, t.line)] if (t.turn_id, t.line) in known else next(embedded)
            for t in turns]
    embeddings = np.stack(rows).astype(np.float16) if rows else np.zeros((0, 0), np.float16)
    return TurnIndex(conv.conversation_id, encoder_id, encoder_fingerprint, turns, embeddings)


def stored_index(store: Store, previous: list[ManifestRecord] | None) -> TurnIndex | None:
    """The index a conversation's stored build names, None when it has none usable (an index
    that cannot be read is embedded again, not extended)."""
    record = previous[0] if previous else None
    if record is None or record.turn_index is None:
        return None
    try:
        return read_turn_index(store, record.turn_index, record.conversation_id,
                               record.encoder_fingerprint)
    except TurnIndexUnavailable:
        return None


def write_turn_index(conv: Conversation, encoder, encoder_id: str, encoder_fingerprint: str,
                     store: Store, previous: list[ManifestRecord] | None = None,
                     tokenizer=None) -> StoredIndex:
    """Embed (or extend) and store the conversation's turn index (with the model's
    `tokenizer`, its turns' token spans)."""
    index = index_turns(conv, encoder, encoder_id, encoder_fingerprint,
                        stored_index(store, previous), tokenizer)
    return store_turn_index(index, store)
