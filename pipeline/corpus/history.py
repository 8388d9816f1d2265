"""What a build covered of a conversation, and how a record differs from it.

A manifest records how many turns of the record it was built from and a digest of them (the
record as read, before any `--max-context-tokens` cut). A later record of the same conversation
is then *unchanged* (the same turns), *grown* (those turns first, then more: a new session), or
*edited* (a covered turn changed, moved or was deleted), which a build tells apart without
reading the caches.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from typing import Literal

from pipeline.corpus.schema import Turn

DIGEST_CHARS = 16
Change = Literal["unchanged", "grown", "edited"]


def turns_digest(turns: Sequence[Turn]) -> str:
    """A SHA-256 over what the model reads of each turn (id, speaker, session, time, text,
    caption), in order; `meta` is not read by the build and is left out."""
    digest = hashlib.sha256()
    for t in turns:
        fields = [t.turn_id, t.speaker, t.session, t.timestamp, t.text, t.caption]
        digest.update(json.dumps(fields, ensure_ascii=False).encode("utf-8") + b"\n")
    return digest.hexdigest()[:DIGEST_CHARS]


def history_change(turns: Sequence[Turn], covered: int, digest: str) -> Change:
    """How `turns` (a record now) differ from the `covered` turns a build digested as
    `digest`."""
    if len(turns) >= covered and turns_digest(turns[:covered]) == digest:
        return "unchanged" if len(turns) == covered else "grown"
    return "edited"
