"""A question's way to its episode: the conversation's manifest, the model check, the route.

The question goes to the episode its router picks in the encoder's space (`RoutingConfig`,
`pipeline.routers`: by default the episode of the nearest window, and the best two read together
when their scores are close; `RoutingConfig("centroid", 0)` is the paper's nearest
centroid). A cache only makes sense with the model that built it, and routing only with the
encoder whose space the centroids live in: by name and by the fingerprint of their files
(`pipeline.kv.fingerprint`). Anything else is an error, never a silent answer.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from pipeline.config import RoutingConfig
from pipeline.corpus.schema import check_safe_id
from pipeline.episodes import embed_texts
from pipeline.routers import RouteIndex, chosen, router
from pipeline.store.backends.base import Store
from pipeline.store.catalogue.manifest import ManifestRecord, read_manifest
from pipeline.store.objects.cache_ref import CacheRef


class ConversationNotFound(LookupError):
    """No manifest for `conversation_id` (the message names the store; an HTTP answer does not)."""

    def __init__(self, conversation_id: str, store_uri: str):
        super().__init__(conversation_id, store_uri)  # args as given, so it pickles (Ray)
        self.conversation_id, self.store_uri = conversation_id, store_uri

    def __str__(self) -> str:
        return (f"conversation {self.conversation_id!r} has no manifest in store "
                f"{self.store_uri} (not built yet?)")


class ModelMismatchError(ValueError):
    """A conversation built with another model or encoder, or other files of it (409)."""


class NeedsRebuildError(ModelMismatchError):
    """A conversation built before caches were bound to their model's files: no fingerprint
    says which weights made its caches, so it is not served until rebuilt."""


def load_manifest(store: Store, conversation_id: str) -> list[ManifestRecord]:
    """The manifest records of a conversation; `ConversationNotFound` if it was never built."""
    check_safe_id(conversation_id)
    records = read_manifest(store, conversation_id)
    if not records:
        raise ConversationNotFound(conversation_id, store.uri)
    return records


def check_models(episodes: Iterable[ManifestRecord | CacheRef], model: str | None,
                 encoder: str | None, *, model_fingerprint: str | None = None,
                 encoder_fingerprint: str | None = None) -> None:
    """A cache only makes sense with the model that built it, and routing only with the encoder
    whose space the centroids live in: anything else is an error, never a silent answer. The
    names and fingerprints given (None: not checked here) must be the episodes'; an episode
    without fingerprints is `NeedsRebuildError` whatever is given."""
    for episode in episodes:
        cid = episode.conversation_id
        if episode.model_fingerprint is None or episode.encoder_fingerprint is None:
            raise NeedsRebuildError(
                f"conversation {cid!r} was built before caches were bound to the files of their "
                "model (its manifest has no model fingerprint) and needs a rebuild: "
                "python -m jobs.build --force ... (same corpus and store)")
        for wanted, built, what in ((model, episode.model_id, "model"),
                                    (encoder, episode.encoder_id, "encoder")):
            if wanted is not None and wanted != built:
                raise ModelMismatchError(f"conversation {cid!r} was built with {what} {built!r}, "
                                         f"not {wanted!r}")
        for wanted, built, name, what in (
                (model_fingerprint, episode.model_fingerprint, episode.model_id, "model"),
                (encoder_fingerprint, episode.encoder_fingerprint, episode.encoder_id,
                 "encoder")):
            if wanted is not None and wanted != built:
                raise ModelMismatchError(
                    f"conversation {cid!r} was built with other files of {what} {name!r} "
                    f"(fingerprint {built}) than the ones loaded here ({wanted}): rebuild it "
                    f"with these files (python -m jobs.build), or load the files it was built "
                    f"with")


def embed_question(encoder, question: str) -> np.ndarray:
    """The question's unit-norm embedding in the encoder's space (the centroids' space)."""
    return embed_texts(encoder, [question])[0]


def route_index(records: list[ManifestRecord]) -> RouteIndex:
    """What the routers compare a question with, from a conversation's manifest records; no
    windows when any record predates window embeddings."""
    windows = [r.window_embeddings for r in records]
    return RouteIndex.of_episodes([r.centroid for r in records],
                                  None if any(w is None for w in windows) else windows)


def route_records(question_embedding: np.ndarray, records: list[ManifestRecord],
                  config: RoutingConfig = RoutingConfig(),
                  index: RouteIndex | None = None) -> tuple[list[ManifestRecord], float]:
    """The records a question reads under `config` (one, or two when the router is unsure)
    and the best score. A conversation whose manifest has no window embeddings (built before
    them) is routed by its centroids."""
    index = route_index(records) if index is None else index
    name = config.router if index.has_windows else "centroid"
    scores = router(name).scores(question_embedding, index)
    read = chosen(scores, config.two_below)
    return [records[k] for k in read], float(scores[read[0]])
