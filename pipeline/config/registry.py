"""The pluggable parts by name: the compression methods, the routers and the layer allocators,
one registry line each, readable before torch loads.

A line says where the part's class is ("module:Class" in its registry's package) and, for a
method, what the method is (`Registered`). Nothing here imports a part: `Registry.load` imports
its module on first use. They live with the configuration, the lowest layer, because the
configuration checks names against them (a router), the command lines offer them as choices,
and the build's hash asks which sections of the configuration a method reads (`reads`).
Adding a part is its class in its package and one line here; the methods' table is also
`pipeline.kv.methods.REGISTRY`, the routers' `pipeline.routers.ROUTERS`.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass


@dataclass(frozen=True)
class Entry:
    """A registry line: where the part's class is, "module:Class" in its registry's package."""
    where: str


@dataclass(frozen=True)
class Registered(Entry):
    """A compression method's line: where its class is, and what it is."""
    # one cache per episode, each question routed to its episode(s); else one per conversation
    per_episode: bool = False
    # one build per question (the question is its patch): an upper bound the evaluation
    # measures, never built ahead of its questions (`jobs.build` does not offer it)
    per_question: bool = False
    evicts: bool = True  # False: the full cache, built without a budget
    # the `BuildConfig` section its parameters are (its fields by name; `Method.from_config`);
    # None: it runs at its dataclass defaults
    section: str | None = None


class Registry(dict):
    """Name -> `Entry` of one kind of part (a plain dict, so a test may register a part with
    `monkeypatch.setitem`); `entry` and `load` name the known ones when a name is not one."""

    def __init__(self, kind: str, package: str, entries: dict[str, Entry]):
        super().__init__(entries)
        self.kind, self.package = kind, package

    def entry(self, name: str) -> Entry:
        """The line of the part called `name` (ValueError naming the known ones); imports
        nothing."""
        if name not in self:
            raise ValueError(f"unknown {self.kind} {name!r}; known: {', '.join(sorted(self))}")
        return self[name]

    def load(self, name: str) -> type:
        """The class of the part called `name`, its module imported on first use."""
        module, cls = self.entry(name).where.split(":")
        return getattr(importlib.import_module(f"{self.package}.{module}"), cls)


METHODS = Registry("method", "pipeline.kv.methods", {
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
})

# which episode's cache answers a question (`RoutingConfig.router`)
ROUTERS = Registry("router", "pipeline", {
    "centroid": Entry("routers:CentroidRouter"),
    "window": Entry("routers:WindowRouter"),
})

# the layer budgets (`BuildConfig.allocator`; each class an `pipeline.kv.budgets.Allocator`)
ALLOCATORS = Registry("allocator", "pipeline.kv", {
    "sensitivity": Entry("budgets:SensitivityAllocator"),
    "variance": Entry("budgets:VarianceAllocator"),
})

EPISODES = "episodes"  # the clustering's section: read by the methods built per episode


def sections() -> dict[str, list[str]]:
    """The build configuration's method sections and the methods that read each."""
    readers: dict[str, list[str]] = {}
    for name, entry in METHODS.items():
        if entry.section is not None:
            readers.setdefault(entry.section, []).append(name)
    return readers


def method_sections() -> tuple[str, ...]:
    """The sections of the build configuration only some methods read: the clustering's and
    the methods' own parameters. Every build reads every other field."""
    return (EPISODES, *sorted(sections()))


def readers(section: str) -> list[str]:
    """The methods that read a method section (`method_sections`)."""
    if section == EPISODES:
        return [name for name, entry in METHODS.items() if entry.per_episode]
    return sections().get(section, [])


def reads(method: str, path: str) -> bool:
    """Whether a build of `method` reads the configuration field at `path` ("scoring.focus",
    "budget"): a budget where it evicts, a method section where its line names it (the
    episodes where it is built per episode), anything else always. The rule the evaluation's
    overrides follow too (`pipeline.eval.methods.MethodSpec.refuses`)."""
    entry = METHODS.entry(method)
    section = path.partition(".")[0]
    if section == "budget":
        return entry.evicts
    if section in method_sections():
        return method in readers(section)
    return True
