"""A question's way to its episode: the conversation's manifest, the model check, the route.

The question goes to the episode whose centroid is nearest (cosine) in the encoder's space. A
cache only makes sense with the model that built it, and routing only with the encoder whose
space the centroids live in: anything else is an error, never a silent answer.
"""

from __future__ import annotations

import numpy as np

from pipeline.corpus.schema import check_safe_id
from pipeline.episodes import route
from pipeline.store.base import Store
from pipeline.store.manifest import read_manifest


class ConversationNotFound(LookupError):
    pass


class ModelMismatchError(ValueError):
    pass


def load_manifest(store: Store, conversation_id: str) -> list[dict]:
    """The manifest rows of a conversation; `ConversationNotFound` if it was never built."""
    check_safe_id(conversation_id)
    rows = read_manifest(store, conversation_id)
    if not rows:
        raise ConversationNotFound(f"conversation {conversation_id!r} has no manifest in "
                                   f"store {store.uri} (not built yet?)")
    return rows


def check_models(rows: list[dict], model: str | None, encoder: str | None) -> None:
    """A cache only makes sense with the model that built it, and routing only with the encoder
    whose space the centroids live in: anything else is an error, never a silent answer."""
    for row in rows:
        for wanted, column, what in ((model, "model_id", "model"), (encoder, "encoder_id", "encoder")):
            built = row.get(column) if wanted is not None else None
            if wanted is not None and wanted != built:
                raise ModelMismatchError(f"conversation {row['conversation_id']!r} was built with "
                                         f"{what} {built!r}, not {wanted!r}")


def centroid_matrix(rows: list[dict]) -> np.ndarray:
    """[episodes, dim] centroids of the manifest rows, in row order."""
    return np.stack([np.asarray(r["centroid"], dtype=np.float32) for r in rows])


def embed_question(encoder, question: str) -> np.ndarray:
    """The question's unit-norm embedding in the encoder's space (the centroids' space)."""
    return encoder.encode([question], normalize_embeddings=True, show_progress_bar=False)[0]


def route_question(question_embedding: np.ndarray, rows: list[dict],
                   centroids: np.ndarray | None = None) -> tuple[dict, float]:
    """The manifest row of the episode nearest the question, and its cosine similarity."""
    index, similarity = route(question_embedding,
                              centroid_matrix(rows) if centroids is None else centroids)
    return rows[index], similarity
