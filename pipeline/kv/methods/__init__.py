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

To add a method: one module here with a `Method` subclass, and one line in `REGISTRY`. The
registry names each method's module without importing it, so the command line offers the names
before torch loads; `method_class` imports the module on first use. Tri-state, D2O merging,
DapQ and compact positions are not methods: they wrap any method's eviction
(`pipeline.kv.compression`).
"""

from __future__ import annotations

import importlib

# name -> "module:class" in this package: a method's one registration line
REGISTRY: dict[str, str] = {
    "epicache": "epicache:EpiCache",
    "streamingllm": "streamingllm:StreamingLLM",
    "snapkv": "snapkv:SnapKV",
    "infinipot": "infinipot:InfiniPot",
    "kvzip": "kvzip:KVzip",
    "keydiff": "keydiff:KeyDiff",
    "knorm": "knorm:Knorm",
    "oldest": "oldest:Oldest",
    "random": "random_scores:Random",
    "question": "question:Question",
    "full": "full:Full",
}


def method_class(name: str) -> type:
    """The registered `Method` subclass called `name` (ValueError naming the known ones)."""
    if name not in REGISTRY:
        raise ValueError(f"unknown method {name!r}; known: {', '.join(sorted(REGISTRY))}")
    module, cls = REGISTRY[name].split(":")
    return getattr(importlib.import_module(f"{__name__}.{module}"), cls)


def create(name: str, **parameters):
    """The method `name` with `parameters` (its dataclass fields; the defaults otherwise)."""
    return method_class(name)(**parameters)
