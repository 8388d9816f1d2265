"""Cache affinity across decoder replicas: a conversation's questions go to the replica that
holds its caches, unless that replica is much busier than the least busy one.

Each replica keeps its own LRU, so Serve's default routing (power of two choices on queue
length) fetches and holds a conversation's caches on every replica its follow-ups happen to
land on. This router ranks the replicas by rendezvous hashing (highest random weight) of the
conversation id instead: every handle in every router replica computes the same order with no
shared state, a new replica takes about 1/N of the conversations from the others, and a dead
replica's conversations move to their next replica while the rest stay where they are.

Load stays bounded ("consistent hashing with bounded loads", Mirrokni et al., 2018): a replica
whose queue is more than `max_imbalance` requests longer than the shortest queue drops to the
last rank, so a hot conversation spills to its second replica (always the same one, which then
warms) rather than queueing behind itself. A request that names no conversation (`stats`) goes
to the shorter queue of two random replicas, as Serve's default does. The router names the
conversation on each decoder call it makes (`Router._decoder_for`).

Why not `serve.multiplexed`: it keys on one model id per replica-held object, evicts by count
rather than bytes, and sends an id no replica has loaded to the replica with the fewest ids,
so a cold conversation is placed by load and its home is forgotten when it is evicted; the
decoder's caches are many per conversation under a byte budget, with a disk tier and a
prefetch beneath. A `RequestRouter` keeps the placement a pure function of the conversation
and the live replicas, which is what the LRU, the disk tier and the prefetch all want.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable, Hashable, Sequence
from typing import TypeVar

from ray.serve.request_router import (
    FIFOMixin,
    MultiplexMixin,
    PendingRequest,
    RequestRouter,
    RunningReplica,
)

from pipeline.serve.settings import DEFAULT_MAX_IMBALANCE

Replica = TypeVar("Replica")


def rendezvous_order(key: str, replicas: Sequence[Replica],
                     name: Callable[[Replica], str] = str) -> list[Replica]:
    """The replicas in the key's rendezvous order (highest random weight first): the same
    order for the same key and replica names, wherever it is computed."""
    def weight(replica: Replica) -> bytes:
        return hashlib.blake2b(f"{key}\0{name(replica)}".encode(), digest_size=8).digest()
    return sorted(replicas, key=weight, reverse=True)


def affinity_ranks(key: str, replicas: Sequence[Replica], queue_len: Callable[[Replica], int],
                   max_imbalance: int = DEFAULT_MAX_IMBALANCE,
                   name: Callable[[Replica], str] = str) -> list[list[Replica]]:
    """The ranks to try, best first: each replica within `max_imbalance` requests of the
    shortest queue alone in its rank, in the key's rendezvous order, then those past the bound
    together (the least loaded of them is taken when every other rank is full)."""
    if not replicas:
        return []
    shortest = min(queue_len(r) for r in replicas)
    ordered = rendezvous_order(key, replicas, name)
    within = [r for r in ordered if queue_len(r) <= shortest + max_imbalance]
    over = [r for r in ordered if queue_len(r) > shortest + max_imbalance]
    return [[r] for r in within] + ([over] if over else [])


def conversation_of(request: PendingRequest | None) -> str | None:
    """The conversation a decoder call is about: the router names it in the request's
    `multiplexed_model_id` (`Router._decoder_for`); None for a call that names none."""
    if request is None:
        return None
    return request.metadata.multiplexed_model_id or None


class ConversationAffinityRouter(FIFOMixin, MultiplexMixin, RequestRouter):
    """Serve's `RequestRouter` for the decoder: `affinity_ranks` on the conversation id, with
    the queue lengths Serve caches (replicas not in the cache are asked first, as Serve's
    prefix-affinity router does). Configured with `request_router_kwargs={"max_imbalance": N}`.

    The conversation rides in `multiplexed_model_id` (a public handle option) for the two
    mixins' sake: a replica chosen for a conversation is handed to that conversation's oldest
    pending request (`MultiplexMixin`'s index), else to the oldest request (`FIFOMixin`). Matching
    by request id alone, the base router's rule, hangs: the calls one HTTP request makes (its
    answer and its conversation's prefetch) share Serve's internal request id, so a replica
    chosen for one can be given to the other and the first is never fulfilled."""

    def initialize_state(self, max_imbalance: int = DEFAULT_MAX_IMBALANCE, **kwargs) -> None:
        if max_imbalance < 0:
            raise ValueError(f"max_imbalance must be >= 0, got {max_imbalance}")
        self.max_imbalance = max_imbalance

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None,
                              ) -> list[list[RunningReplica]]:
        key = conversation_of(pending_request)
        if key is None or len(candidate_replicas) == 1:
            return [random.sample(candidate_replicas, min(2, len(candidate_replicas)))]
        queues = await self._queue_lens(candidate_replicas)
        return affinity_ranks(key, candidate_replicas, lambda r: queues[r.replica_id],
                              self.max_imbalance, name=lambda r: r.replica_id.unique_id)

    async def _queue_lens(self, replicas: list[RunningReplica]) -> dict[Hashable, int]:
        """Each replica's queue length: Serve's cached figure, else probed now; a replica that
        does not answer the probe counts as full (it is tried last)."""
        queues, unknown = {}, []
        for r in replicas:
            cached = self._replica_queue_len_cache.get(r.replica_id)
            if cached is None:
                unknown.append(r)
            else:
                queues[r.replica_id] = cached
        for r, probed in await self._probe_queue_lens(unknown, 0) if unknown else []:
            queues[r.replica_id] = r.max_ongoing_requests if probed is None else probed
        return queues
