"""The compression methods, one module each, and their registry.

    base.py           Method (a frozen dataclass of parameters + one scoring function),
                      PatchMethod (scored by a bound patch's attention), the inputs a build
                      binds a method to, and what the prefill loop shows it
    shaping.py        wrappers that reshape any scorer's scores (pooling, whole utterances,
                      focus on the episode's turns, protected sink and recent tokens)
    epicache.py       EpiCache: the episode's medoid patch attention, shaped
    snapkv.py, streamingllm.py, infinipot.py, kvzip.py, keydiff.py, knorm.py: the baselines
    oldest.py, random_scores.py: diagnostic floors
    question.py       the question as the patch: an upper bound (one build per question)
    full.py           the full cache (no eviction)

To add a method: one module here with a `Method` subclass, and one registry line naming its
class and saying what it is (`Registered`: one cache per episode or per conversation, one build
per question, whether it evicts, the build configuration's section holding its parameters). The
lines are `pipeline.config.registry.METHODS` (here `REGISTRY`): beside the configuration, so
that the build's hash can ask which sections a method reads (`pipeline.config.registry.reads`)
and a command line can check a method before torch loads. A line names its method's module
without importing it; `method_class` imports it on first use. The build, the evaluation and the
command lines ask the registry what a method is, never its name.
Tri-state, D2O merging, DapQ and compact positions are not methods: they wrap any method's
eviction (`pipeline.kv.compression`).
"""

from __future__ import annotations

from pipeline.config.registry import METHODS, Registered, sections

__all__ = ["REGISTRY", "Registered", "buildable", "create", "method_class", "registered",
           "sections"]

# name -> its registration: a method's one registry line (`pipeline.config.registry.METHODS`)
REGISTRY = METHODS


def registered(name: str) -> Registered:
    """What the method called `name` is (ValueError naming the known ones); imports nothing."""
    return REGISTRY.entry(name)


def buildable() -> list[str]:
    """The methods `jobs.build` builds: every registered one but those built per question."""
    return sorted(name for name, entry in REGISTRY.items() if not entry.per_question)


def method_class(name: str) -> type:
    """The registered `Method` subclass called `name` (ValueError naming the known ones)."""
    return REGISTRY.load(name)


def create(name: str, **parameters):
    """The method `name` with `parameters` (its dataclass fields; the defaults otherwise)."""
    return method_class(name)(**parameters)
