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

To add a method: one module here with a `Method` subclass, and one line in `REGISTRY` naming
its class and saying what it is (`Registered`: one cache per episode or per conversation, one
build per question, whether it evicts, the build configuration's section holding its
parameters). The build, the evaluation and the command lines ask the registry what a method is,
never its name; the registry names each method's module without importing it, so the command
line checks a method before torch loads, and `method_class` imports the module on first use.
Tri-state, D2O merging, DapQ and compact positions are not methods: they wrap any method's
eviction (`pipeline.kv.compression`).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass


@dataclass(frozen=True)
class Registered:
    """A method's registration: where its class is ("module:class" in this package) and what it
    is, readable before torch loads (the command lines check a method with it)."""
    where: str
    # one cache per episode, each question routed to its episode(s); else one per conversation
    per_episode: bool = False
    # one build per question (the question is its patch): an upper bound the evaluation
    # measures, never built ahead of its questions (`jobs.build` does not offer it)
    per_question: bool = False
    evicts: bool = True  # False: the full cache, built without a budget
    # the `BuildConfig` section its parameters are (its fields by name; `Method.from_config`);
    # None: it runs at its dataclass defaults
    section: str | None = None


# name -> its registration: a method's one registry line
REGISTRY: dict[str, Registered] = {
    "epicache": Registered("epicache:EpiCache", per_episode=True, section="scoring"),
    "streamingllm": Registered("streamingllm:StreamingLLM"),
    "snapkv": Registered("snapkv:SnapKV"),
    "infinipot": Registered("infinipot:InfiniPot"),
    "kvzip": Registered("kvzip:KVzip"),
    "keydiff": Registered("keydiff:KeyDiff"),
    "knorm": Registered("knorm:Knorm"),
    "oldest": Registered("oldest:Oldest"),
    "random": Registered("random_scores:Random"),
    "question": Registered("question:Question", per_question=True),
    "full": Registered("full:Full", evicts=False),
}


def registered(name: str) -> Registered:
    """What the method called `name` is (ValueError naming the known ones); imports nothing."""
    if name not in REGISTRY:
        raise ValueError(f"unknown method {name!r}; known: {', '.join(sorted(REGISTRY))}")
    return REGISTRY[name]


def buildable() -> list[str]:
    """The methods `jobs.build` builds: every registered one but those built per question."""
    return sorted(name for name, entry in REGISTRY.items() if not entry.per_question)


def sections() -> dict[str, list[str]]:
    """The build configuration's method sections and the methods that read each."""
    readers: dict[str, list[str]] = {}
    for name, entry in REGISTRY.items():
        if entry.section is not None:
            readers.setdefault(entry.section, []).append(name)
    return readers


def method_class(name: str) -> type:
    """The registered `Method` subclass called `name` (ValueError naming the known ones)."""
    module, cls = registered(name).where.split(":")
    return getattr(importlib.import_module(f"{__name__}.{module}"), cls)


def create(name: str, **parameters):
    """The method `name` with `parameters` (its dataclass fields; the defaults otherwise)."""
    return method_class(name)(**parameters)
