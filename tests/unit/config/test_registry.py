"""Routers and layer allocators are registered as the methods are (`pipeline.config.registry`):
a new one is its class and one registry line, and the configuration, the answer path and the
build take it by name; an unknown name is refused naming the known ones."""

from __future__ import annotations

import sys
import types
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import pytest

from pipeline.answer.lookup import route_records
from pipeline.builder.profile import allocator, layer_budgets
from pipeline.config import BuildConfig, RoutingConfig, registry
from pipeline.kv.budgets import Allocator, SensitivityAllocator, VarianceAllocator
from pipeline.routers import ROUTERS, RouteIndex, WindowRouter, router
from pipeline.store.catalogue.manifest import ManifestRecord


@dataclass(frozen=True)
class LastRouter:
    """A stand-in router: always the last episode."""

    def scores(self, question: np.ndarray, index: RouteIndex) -> np.ndarray:
        return np.arange(index.n_episodes, dtype=np.float64)


@dataclass(frozen=True)
class FlatAllocator(Allocator):
    """A stand-in allocator: the same budget in every layer, no profile."""
    name: ClassVar[str] = "flat"

    @classmethod
    def from_config(cls, config):
        return cls()

    @property
    def needs_profile(self) -> bool:
        return False

    def measure(self, model, input_ids, config):
        raise AssertionError("no profile is measured")

    def allocate(self, profile, mean_budget):
        raise AssertionError("no profile is read")


@pytest.fixture
def registered(monkeypatch):
    """One router and one allocator, registered as a new one's module and line would be."""
    module = types.ModuleType("pipeline.toy_parts")
    module.LastRouter, module.FlatAllocator = LastRouter, FlatAllocator
    monkeypatch.setitem(sys.modules, module.__name__, module)
    monkeypatch.setitem(registry.ROUTERS, "last", registry.Entry("toy_parts:LastRouter"))
    # the allocators' package is pipeline.kv: the same module under that name too
    monkeypatch.setitem(sys.modules, "pipeline.kv.toy_parts", module)
    monkeypatch.setitem(registry.ALLOCATORS, "flat", registry.Entry("toy_parts:FlatAllocator"))


def test_a_new_router_is_one_registry_line(registered):
    assert isinstance(router("last"), LastRouter) and "last" in ROUTERS
    assert isinstance(ROUTERS["window"], WindowRouter) and set(ROUTERS) >= {"centroid", "window"}
    records = [ManifestRecord.from_row({"conversation_id": "c", "episode": e, "centroid": c,
                                        "window_embeddings": [c]})
               for e, c in enumerate([[1.0, 0.0], [0.0, 1.0], [0.6, 0.8]])]
    read, _ = route_records(np.array([1.0, 0.0]), records, RoutingConfig("last", 0.0))
    assert [r.episode for r in read] == [2]


def test_a_new_allocator_is_one_registry_line(registered):
    config = BuildConfig(allocator="flat", budget=64)
    assert isinstance(allocator(config), FlatAllocator)
    assert layer_budgets(store=None, config=config, n_layers=3) == [64, 64, 64]


def test_the_registered_allocators_take_their_parameters_from_the_build():
    assert allocator(BuildConfig(alpha=1.5)) == SensitivityAllocator(alpha=1.5)
    assert not allocator(BuildConfig()).needs_profile  # alpha 0: uniform, no profile
    assert allocator(BuildConfig(allocator="variance", variance_temperature=2.0)) == \
        VarianceAllocator(temperature=2.0)


def test_an_unknown_name_names_the_known_ones():
    with pytest.raises(ValueError, match="unknown router 'nearest'; known: centroid, window"):
        router("nearest")
    with pytest.raises(ValueError, match="unknown allocator 'h2o'; known: sensitivity, variance"):
        allocator(BuildConfig(allocator="h2o"))
    with pytest.raises(ValueError, match="router must be one of"):
        RoutingConfig("nearest")
    with pytest.raises(KeyError):
        ROUTERS["nearest"]
