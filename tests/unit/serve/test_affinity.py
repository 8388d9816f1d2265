"""The decoder's routing rule (`pipeline.serve.affinity`): a conversation keeps its replica,
load stays bounded, and a replica's death or a new replica moves only its share."""

from __future__ import annotations

import asyncio
from collections import Counter

import pytest
from hypothesis import given
from hypothesis import strategies as st
from ray.serve._private.common import (
    DeploymentHandleSource,
    DeploymentID,
    ReplicaID,
    RequestMetadata,
)
from ray.serve.request_router import PendingRequest

from pipeline.serve.affinity import (
    ConversationAffinityRouter,
    affinity_ranks,
    conversation_of,
    rendezvous_order,
)

REPLICAS = [f"replica-{i}" for i in range(4)]
KEYS = [f"conv-{i:04d}" for i in range(2000)]


def _home(key: str, replicas: list[str]) -> str:
    return rendezvous_order(key, replicas)[0]


@given(st.text(min_size=1, max_size=40), st.permutations(REPLICAS))
def test_a_conversation_has_one_home_whatever_the_replicas_order(key, shuffled):
    assert rendezvous_order(key, shuffled) == rendezvous_order(key, REPLICAS)


def test_conversations_spread_evenly_over_the_replicas():
    shares = Counter(_home(k, REPLICAS) for k in KEYS)
    assert set(shares) == set(REPLICAS)
    assert all(0.2 < n / len(KEYS) < 0.3 for n in shares.values()), shares


def test_a_dead_replica_moves_only_its_own_conversations_to_their_next_replica():
    alive = [r for r in REPLICAS if r != "replica-2"]
    for k in KEYS:
        order = rendezvous_order(k, REPLICAS)
        expected = order[1] if order[0] == "replica-2" else order[0]
        assert _home(k, alive) == expected


def test_a_new_replica_takes_about_one_in_n_and_from_every_replica():
    grown = REPLICAS + ["replica-4"]
    moved = [k for k in KEYS if _home(k, grown) != _home(k, REPLICAS)]
    assert all(_home(k, grown) == "replica-4" for k in moved)
    assert 0.15 < len(moved) / len(KEYS) < 0.25
    assert {_home(k, REPLICAS) for k in moved} == set(REPLICAS)


def test_the_home_is_first_while_its_queue_is_within_the_bound():
    key = KEYS[0]
    order = rendezvous_order(key, REPLICAS)
    queues = dict.fromkeys(REPLICAS, 0) | {order[0]: 4}
    ranks = affinity_ranks(key, REPLICAS, queues.__getitem__, max_imbalance=4)
    assert ranks == [[r] for r in order]


def test_a_home_much_busier_than_the_rest_is_passed_over_for_the_next_replica():
    key = KEYS[0]
    order = rendezvous_order(key, REPLICAS)
    queues = dict.fromkeys(REPLICAS, 1) | {order[0]: 6}
    ranks = affinity_ranks(key, REPLICAS, queues.__getitem__, max_imbalance=4)
    assert ranks[0] == [order[1]]  # the same spill-over replica every time: it warms
    assert ranks[-1] == [order[0]]  # still tried when the others are full


@given(st.lists(st.integers(0, 32), min_size=1, max_size=8), st.integers(0, 8),
       st.text(min_size=1, max_size=10))
def test_the_first_choice_is_never_past_the_bound_and_every_replica_is_ranked(queues, bound, key):
    names = [f"r{i}" for i in range(len(queues))]
    load = dict(zip(names, queues))
    ranks = affinity_ranks(key, names, load.__getitem__, max_imbalance=bound)
    assert load[ranks[0][0]] <= min(queues) + bound
    assert sorted(r for rank in ranks for r in rank) == sorted(names)


def _request(conversation: str | None) -> PendingRequest:
    """A decoder call as the router makes it: the conversation in `multiplexed_model_id`."""
    return PendingRequest(args=[], kwargs={}, metadata=RequestMetadata(
        request_id="r", internal_request_id="i", multiplexed_model_id=conversation or ""))


async def _conversations_read() -> list[str | None]:
    # in a loop: a PendingRequest makes its asyncio future as it is made
    return [conversation_of(_request("conv-1")), conversation_of(_request(None)),
            conversation_of(None)]


def test_the_conversation_is_read_from_the_request():
    assert asyncio.run(_conversations_read()) == ["conv-1", None, None]  # stats: no conversation


class _Replica:
    """What Serve's router reads of a running replica."""

    def __init__(self, name: str, queue: int):
        self.replica_id = ReplicaID(unique_id=name, deployment_id=DeploymentID("d", "a"))
        self.max_ongoing_requests, self.queue = 16, queue
        self.node_id, self.availability_zone, self.multiplexed_model_ids = "", None, set()

    async def get_queue_len(self, *, deadline_s: float) -> int:
        return self.queue


async def _choose(router, replicas, conversation: str | None) -> list[list[str]]:
    ranks = await router.choose_replicas(replicas, _request(conversation))
    return [[r.replica_id.unique_id for r in rank] for rank in ranks]


async def _serves_router_ranks() -> None:
    router = ConversationAffinityRouter(DeploymentID("d", "a"), DeploymentHandleSource.UNKNOWN)
    router.initialize_state(max_imbalance=2)
    replicas = [_Replica(name, 0) for name in REPLICAS]
    router.update_replicas(replicas)
    order = rendezvous_order("conv-7", REPLICAS)
    assert await _choose(router, replicas, "conv-7") == [[r] for r in order]
    # Serve's cached queue length of the home says it is busy: the next replica comes first
    home = next(r for r in replicas if r.replica_id.unique_id == order[0])
    router._replica_queue_len_cache.update(home.replica_id, 3)
    assert (await _choose(router, replicas, "conv-7"))[0] == [order[1]]
    # no conversation named: two random replicas, as Serve's default
    assert len((await _choose(router, replicas, None))[0]) == 2
    with pytest.raises(ValueError):
        router.initialize_state(max_imbalance=-1)


def test_serves_router_ranks_by_conversation_with_probed_and_cached_queues():
    asyncio.run(_serves_router_ranks())


async def _two_calls_of_one_http_request() -> list[str]:
    router = ConversationAffinityRouter(DeploymentID("d", "a"), DeploymentHandleSource.UNKNOWN)
    router.initialize_state()
    replicas = [_Replica(name, 0) for name in REPLICAS]
    router.update_replicas(replicas)
    # an answer and its conversation's prefetch, sent at once from one HTTP request: Serve
    # gives both its internal request id (the base router's matching rule hung the second)
    calls = [_request("conv-3"), _request("conv-3")]
    chosen = await asyncio.wait_for(
        asyncio.gather(*(router._choose_replica_for_request(c) for c in calls)), timeout=10)
    return [r.replica_id.unique_id for r in chosen]


def test_two_calls_sharing_serves_request_id_are_both_routed_to_the_home():
    home = rendezvous_order("conv-3", REPLICAS)[0]
    assert asyncio.run(_two_calls_of_one_http_request()) == [home, home]
