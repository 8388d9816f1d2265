"""The evaluation's method language: a short table of named presets, plus field overrides.

A method is a preset's name, optionally followed by overrides of its configuration by field
path, as the build's options name them: `epicache`, `epicache-paper`,
`epicache+scoring.focus=0.5+routing.two_below=0`. A path is a field of the build configuration
(`pipeline.config.BuildConfig`: `alpha`, `scoring.pool`, `prefill.tristate.fp8`,
`episodes.episodes`, ...), of the routing (`routing.router`, `routing.two_below`) or of the
question-time top-up (`topup.enabled`, `topup.turns`, `topup.max_tokens`,
`topup.nearer_than_held`, `topup.read_once`); its text is
cast by the field's type (`none` for an optional field's None). `jobs.evaluate --set PATH=VALUE`
applies an override to every method.

A preset says which method scores (`pipeline.kv.methods`) and what it changes in the build it
starts from (the evaluation's `BuildConfig`, from the command's build options). The baselines
keep original positions, as their papers evaluate them; `epicache` is the default build. A
registered method with no preset of its own runs as the baselines do, so a new method is
evaluated by its name as soon as it is registered. The fair rows read what the answer path
reads: `rag` (no history, the question's top-up), `full+topup.enabled=true` (the full history
and the same top-up) and `<baseline>+topup.enabled=true`. An override a method does not read
is refused (`MethodSpec.refuses`), never ignored.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from pipeline.config import BuildConfig, RoutingConfig, ScoringConfig, TopUpConfig, registry
from pipeline.config.fields import field_hint, is_optional, parser_of, replace_path
from pipeline.kv.methods import REGISTRY, Registered, registered, sections

ORIGINAL = (("prefill.positions", "original"), ("prefill.compact_recent", 0))
UNIFORM = (("alpha", 0.0),)  # layer budgets: the same in every layer
# A baseline reads its cache alone unless topped up (`<method>+topup.enabled=true`: the question's
# nearest turns, nothing excluded, since its cache holds no whole turn)
BASELINE = ORIGINAL + UNIFORM + (("topup.enabled", False),)


@dataclass(frozen=True)
class Preset:
    """A named method: the registered method that scores, what it changes in the build, and
    whether it takes the sensitivity-aware layer budgets (EpiCache's allocation). `history`
    False: no cache of the conversation at all (the no-history reference and `rag`)."""
    scorer: str
    about: str
    changes: tuple[tuple[str, Any], ...] = ()
    allocated: bool = False
    history: bool = True


PAPER = (("scoring", ScoringConfig.paper()), ("alpha", 1.0), ("prefill.selection", "headwise"),
         ("prefill.head_floor", 0.0), ("episodes.episodes", 4), ("episodes.medoids", 4),
         ("episodes.n_init", 10), ("routing.router", "centroid"), ("routing.two_below", 0.0),
         ("topup.enabled", False)) + ORIGINAL

PRESETS: dict[str, Preset] = {
    "full": Preset("full", "the full cache, no eviction: the reference of every retention "
                   "(full+topup.enabled=true: the full history and the question's top-up, the "
                   "ceiling of retrieval)", BASELINE),
    "rag": Preset("full", "retrieval alone: no history, the question's top-up (its nearest "
                  "turns, nothing excluded) before it",
                  ORIGINAL + UNIFORM + (("topup.enabled", True),), history=False),
    "epicache": Preset("epicache", "the default: the default build, each question topped up "
                       "with its nearest turns", allocated=True),
    "epicache-episode": Preset("epicache", "the default build, each question answered from the "
                               "episode(s) it is routed to alone (no top-up)",
                               (("topup.enabled", False),), True),
    "epicache-orig": Preset("epicache", "the default at original positions (the former "
                            "default)", ORIGINAL, True),
    "epicache-paper": Preset("epicache", "the paper's recipe: max attention token by token over "
                             "the whole medoid patch, alpha 1, head-wise, nearest centroid",
                             PAPER, True),
    "epicache-tri": Preset("epicache", "ARKV tri-state (the budget M reads as the bytes of M "
                           "Original float16 entries per layer and KV head)",
                           (("prefill.tristate.enabled", True),), True),
    "epicache-dapq": Preset("epicache", "DapQ: the patch queries at the decode positions",
                            (("prefill.decode_positions", True),), True),
    "epicache-d2o": Preset("epicache", "D2O: evicted entries merged into kept ones, layer "
                           "budgets by attention variance",
                           (("prefill.merge.enabled", True), ("allocator", "variance"))),
    "streamingllm": Preset("streamingllm", "128 sink tokens and the most recent",
                           BASELINE),
    "snapkv": Preset("snapkv", "the block's last 64 tokens as the patch", BASELINE),
    "infinipot": Preset("infinipot", "a summarize instruction as the patch", BASELINE),
    "kvzip": Preset("kvzip", "a repeat instruction and the block as the patch", BASELINE),
    "keydiff": Preset("keydiff", "keys unlike the mean key", BASELINE),
    "question": Preset("question", "an upper bound: the question as the patch, one build per "
                       "question", ORIGINAL + (("topup.enabled", False),), True),
    "random": Preset("random", "a floor: seeded random scores", BASELINE),
    "oldest": Preset("oldest", "a floor: the first tokens", BASELINE),
}
# run when --methods is not given (the others only when named)
DEFAULT_METHODS = ("full", "streamingllm", "snapkv", "infinipot", "kvzip", "keydiff", "epicache",
                   "question")
NO_HISTORY = "none"  # the other reference: the same prompt with no turns (not a build)
REFERENCES = ("full", NO_HISTORY)  # the two ends of every retention
NONE = Preset("full", "no history: the same prompt with no turns", BASELINE, history=False)


@dataclass(frozen=True)
class MethodSpec:
    """A method as spelled: its preset and its own overrides (field path, value)."""
    preset: Preset
    overrides: tuple[tuple[str, Any], ...]

    @property
    def registration(self) -> Registered:
        """What its scoring method is (`pipeline.kv.methods.REGISTRY`)."""
        return registered(self.preset.scorer)

    @property
    def episodic(self) -> bool:
        """One cache per episode, each question routed (`Registered.per_episode`)."""
        return self.registration.per_episode

    @property
    def history(self) -> bool:
        """Whether it reads a cache of the conversation (not `none`, `rag`)."""
        return self.preset.history

    @property
    def takes_budget(self) -> bool:
        """Whether its cache is built under a budget (not the references, `rag` or a method
        that never evicts)."""
        return self.history and self.registration.evicts

    def reads_section(self, section: str) -> bool:
        """Whether its build reads a section of the configuration: the build's own rule
        (`pipeline.config.registry.reads`: `episodes` where it is built per episode, a method's
        own parameters where it is theirs), and the budget always (a cell's budget is its own
        column, `takes_budget`)."""
        return section == "budget" or registry.reads(self.preset.scorer, section)

    def refuses(self, path: str) -> str | None:
        """Why this method cannot take an override of `path` (None: it takes it): a field it
        never reads is refused, never ignored."""
        section = path.partition(".")[0]
        if self.preset == NONE:
            return "it takes no overrides (`rag` is no history with the question's top-up)"
        if not self.takes_budget:
            return None if section == "topup" else "it takes only topup.<field> overrides"
        if section == "routing" and not self.episodic or not self.reads_section(section):
            readers = (sections().get(section) or
                       [name for name, r in REGISTRY.items() if r.per_episode])
            return (f"{section}.<field> is read by {', '.join(readers)} only (this method reads "
                    f"one cache, unrouted, at its own parameters)")
        if self.episodic:
            return None
        if path == "alpha" and not self.preset.allocated:
            return "its layer budgets are uniform (alpha is the sensitivity allocation's)"
        return None


def parse_override(text: str) -> tuple[str, Any]:
    """`path=value` as (path, value cast by the field's type); ValueError naming what is wrong."""
    path, sep, value = text.partition("=")
    path = path.strip()
    if not sep or not path:
        raise ValueError(f"an override is PATH=VALUE, got {text!r}")
    if path in ("scorer", "budget", "model", "encoder"):
        raise ValueError(f"{path!r} is not an override: name a preset, and --budgets, "
                         "--model, --encoder")
    section = question_time(path)
    cls, rest = (BuildConfig, path) if section is None else (QUESTION_TIME[section[0]], section[1])
    try:
        hint = field_hint(cls, rest)
        parse = parser_of(cls, rest)
    except (KeyError, AttributeError, TypeError, StopIteration):
        raise ValueError(f"no configuration field {path!r}") from None
    if dataclasses.is_dataclass(hint):
        raise ValueError(f"{path!r} is a section: override one of its fields ({path}.<field>)")
    if is_optional(cls, rest) and value.strip().lower() == "none":
        return path, None
    try:
        return path, parse(value.strip())
    except ValueError as e:
        raise ValueError(f"{path}={value!r}: {e} ({getattr(hint, '__name__', hint)})") from None


# The question-time sections: they decide what a question reads, not what a cache holds, so the
# variants of one method that differ only in these share its cell (its caches).
QUESTION_TIME = {"routing": RoutingConfig, "topup": TopUpConfig}


def question_time(path: str) -> tuple[str, str] | None:
    """(section, field) when an override path names a question-time field (`routing.<field>`,
    `topup.<field>`), else None."""
    section, _, rest = path.partition(".")
    return (section, rest) if section in QUESTION_TIME and rest else None


def routing_field(path: str) -> str | None:
    """The `RoutingConfig` field an override path names (`routing.<field>`), else None."""
    section = question_time(path)
    return section[1] if section is not None and section[0] == "routing" else None


@functools.cache
def parse_method(name: str) -> MethodSpec:
    """`<preset>[+<path>=<value>]...` as a `MethodSpec`; ValueError naming the presets if
    unknown."""
    preset, *overrides = name.strip().split("+")
    if preset == NO_HISTORY:
        if overrides:
            raise ValueError(f"{NO_HISTORY!r} takes no overrides (`rag` is no history with "
                             "the question's top-up)")
        return MethodSpec(NONE, ())
    if preset in PRESETS:
        base = PRESETS[preset]
    elif preset in REGISTRY:  # a registered method without a preset runs as the baselines do
        base = Preset(preset, "a registered method", BASELINE)
    else:
        raise ValueError(f"unknown method {name!r} ({describe_methods()})")
    spec = MethodSpec(base, tuple(parse_override(o) for o in overrides))
    for path, _ in spec.overrides:
        reason = spec.refuses(path)
        if reason:
            raise ValueError(f"{name!r} cannot take {path}: {reason}")
    return spec


def describe_methods() -> str:
    """The presets and the override syntax, as `--methods` and its errors name them."""
    others = sorted(set(REGISTRY) - {p.scorer for p in PRESETS.values()})
    return (f"presets: {', '.join(PRESETS)}; any other registered method ({', '.join(others)}) "
            "as the baselines; each may take overrides +<path>=<value> (a field of the build "
            "configuration, or routing.<field> / topup.<field>)")


@dataclass(frozen=True)
class EvalConfig:
    """An evaluation: the build every method starts from (`build`: the model, the encoder and
    every stage's configuration; a method's preset and overrides change it, `build_config`), how
    questions pick their episodes, overrides for every method (`overrides`, from `--set`), and
    how the questions are measured."""
    build: BuildConfig = field(default_factory=BuildConfig)
    routing: RoutingConfig = field(default_factory=RoutingConfig)
    topup: TopUpConfig = field(default_factory=TopUpConfig)
    overrides: tuple[tuple[str, Any], ...] = ()
    questions_per_conversation: int | None = None
    generate: bool = False  # generate answers for F1 (slow; at the floor for a 135M model)
    generate_questions: int | None = None  # with `generate`: the first N questions only
    generate_methods: tuple[str, ...] | None = None  # with `generate`: these only (None: all)
    max_new_tokens: int = 32
    recall_words: int = 4
    recall_tokens: int = 32
    # whole conversations longer than the model: the full-history reference of a question is
    # the full cache of the window of at most this many tokens holding its evidence
    # (`pipeline.eval.window`); None: the full cache of the (cut) conversation
    reference_window: int | None = None

    @property
    def model(self) -> str:
        return self.build.model

    @property
    def encoder(self) -> str:
        return self.build.encoder

    @property
    def max_context_tokens(self) -> int | None:
        return self.build.max_context_tokens

    def generates(self, question: int) -> bool:
        """Whether the answer to a conversation's `question`-th question is generated (F1)."""
        return self.generate and (self.generate_questions is None or
                                  question < self.generate_questions)

    def answers(self, method: str) -> bool:
        """Whether `method`'s answers are generated (F1)."""
        return self.generate and (self.generate_methods is None or
                                  method in self.generate_methods)

    def changes(self, method: str) -> list[tuple[str, Any]]:
        """Every change a method makes, in order: its preset's, its own overrides, and those of
        `--set` (`overrides`) that it takes (`MethodSpec.refuses`)."""
        m = parse_method(method)
        return [*m.preset.changes, *m.overrides,
                *((path, value) for path, value in self.overrides if m.refuses(path) is None)]

    def build_config(self, method: str, budget: int | None) -> BuildConfig:
        """The build configuration of a cell (it decides the caches and the layer budgets)."""
        scorer = parse_method(method).preset.scorer
        config = replace(self.build, scorer=scorer,
                         budget=budget if registered(scorer).evicts else None)
        for path, value in self.changes(method):
            if question_time(path) is None:
                config = replace_path(config, path, value)
        return config

    def route_of(self, method: str) -> tuple[str, float]:
        """The router of an episodic method, and the score margin under which a question reads
        its best two episodes."""
        routing = self.routing
        for path, value in self.changes(method):
            if routing_field(path) is not None:
                routing = replace_path(routing, routing_field(path), value)
        return routing.router, routing.two_below

    def topup_of(self, method: str) -> TopUpConfig | None:
        """The question-time top-up a method reads (None: none): an episodic method's skips the
        turns its episodes hold, any other's is the question's nearest turns."""
        topup = self.topup
        for path, value in self.changes(method):
            section = question_time(path)
            if section is not None and section[0] == "topup":
                topup = replace_path(topup, section[1], value)
        return topup if topup.enabled else None

    def read_of(self, method: str) -> Read:
        """What a method's questions read besides its cache(s): the route of an episodic
        method, and the top-up of any (a cache of no episodes holds no turn to skip: one read
        whatever `skip_held` says)."""
        episodic = parse_method(method).episodic
        topup = self.topup_of(method)
        if topup is not None and not episodic:
            topup = replace(topup, skip_held=TOPUP_ADDED_LATER["skip_held"])
        return Read(self.route_of(method) if episodic else None, topup)

    def allocator_of(self, method: str) -> str | None:
        """The layer-budget allocator a method uses (None: uniform budgets)."""
        config = self.build_config(method, 1)
        if config.allocator == "variance":
            return "variance"
        return "sensitivity" if parse_method(method).preset.allocated else None

    def needs_profile(self, method: str) -> bool:
        """Whether a method's layer budgets come from a measured profile (not uniform)."""
        allocator = self.allocator_of(method)
        return allocator == "variance" or (
            allocator == "sensitivity" and self.build_config(method, 1).alpha > 0)

    def as_dict(self) -> dict:
        return asdict(self)


Route = tuple[str, float]  # (router, two_below): `RoutingConfig`'s fields
# top-up fields added after cells were kept, with the value every read had before them
TOPUP_ADDED_LATER = {"skip_held": True, "read_once": False}


@dataclass(frozen=True)
class Read:
    """What a method's question reads at question time: its route among the episodes (None:
    one cache, unrouted) and its top-up (None: none). The methods of one cell that differ only
    in these share its caches; each read's measures are fields of their own (`prefix`)."""
    route: Route | None = None
    topup: TopUpConfig | None = None

    @property
    def prefix(self) -> str:
        """The prefix of the cell record's fields this read measured: a digest of the read, a
        top-up field added later left out where it holds what reads had before it (cells kept
        by earlier runs stay found)."""
        topup = "None"
        if self.topup is not None:
            fields = [f"{k}={v!r}" for k, v in asdict(self.topup).items()
                      if TOPUP_ADDED_LATER.get(k, object()) != v]
            topup = f"TopUpConfig({', '.join(fields)})"  # the dataclass's repr, less those
        what = f"({topup}, {None if self.route is None else tuple(self.route)!r})"
        return f"read{hashlib.sha256(what.encode()).hexdigest()[:8]}_"
