"""A method is what its registry line says it is (`pipeline.kv.methods.Registered`), never what
it is called: a new per-episode method with its own configuration section is its module and its
registry line, and the build, the evaluation and the command line take it as they take EpiCache."""

from __future__ import annotations

import sys
import types
from dataclasses import dataclass
from typing import ClassVar

import pytest

from pipeline.builder.cluster import is_episodic
from pipeline.builder.episode import build_method
from pipeline.config import BuildConfig, ScoringConfig
from pipeline.eval.methods import EvalConfig, parse_method
from pipeline.kv import methods
from pipeline.kv.methods.base import PatchMethod


@dataclass(frozen=True)
class Toy(ScoringConfig, PatchMethod):
    """A stand-in per-episode method reading the `scoring` section."""
    name: ClassVar[str] = "toy"


@dataclass(frozen=True)
class ToyPerQuestion(PatchMethod):
    name: ClassVar[str] = "toyq"


@pytest.fixture
def toys(monkeypatch):
    """Two methods registered as a new method's module and registry line would register them."""
    module = types.ModuleType("pipeline.kv.methods.toy")
    module.Toy, module.ToyPerQuestion = Toy, ToyPerQuestion
    monkeypatch.setitem(sys.modules, module.__name__, module)
    monkeypatch.setitem(methods.REGISTRY, "toy",
                        methods.Registered("toy:Toy", per_episode=True, section="scoring"))
    monkeypatch.setitem(methods.REGISTRY, "toyq",
                        methods.Registered("toy:ToyPerQuestion", per_question=True))
    parse_method.cache_clear()
    yield
    parse_method.cache_clear()


def test_the_build_takes_a_new_per_episode_method_with_its_own_section(toys):
    config = BuildConfig(scorer="toy", scoring=ScoringConfig(focus=2.5, pool=3))
    assert is_episodic(config)
    method = build_method(config)
    assert isinstance(method, Toy) and (method.focus, method.pool) == (2.5, 3)
    assert build_method(BuildConfig(scorer="snapkv", scoring=ScoringConfig(focus=2.5))) == \
        methods.create("snapkv")  # no section: its defaults, whatever the others' say
    assert "toy" in methods.buildable() and "toyq" not in methods.buildable()


def test_the_evaluation_takes_it_as_it_takes_epicache(toys):
    config = EvalConfig()
    spec = parse_method("toy+scoring.focus=0.5+routing.two_below=0")
    assert spec.episodic and spec.takes_budget
    assert config.build_config("toy+scoring.focus=0.5", 512).scoring.focus == 0.5
    assert config.read_of("toy").route is not None  # routed among its episodes
    assert parse_method("toyq").registration.per_question and not parse_method("toyq").episodic
    with pytest.raises(ValueError, match="scoring.<field> is read by epicache, toy only"):
        parse_method("snapkv+scoring.focus=0.5")
