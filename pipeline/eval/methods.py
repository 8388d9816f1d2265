"""The evaluation's method language: methods, variants, and the configuration each one builds.

A method may carry variants: `<method>+<variant>+...` (or `<method>-<variant>` for one), e.g.
`epicache-tri`, `epicache+tri+dapq`. Variants: `tri` (ARKV tri-state; the cell's budget M
reads as the bytes of M Original entries per layer and KV head), `fp8` (tri-state with fp8
codes), `max` (tri-state ranked by the scorer's max attention instead of the heavy-hitter
score), `oq<P>` (tri-state with the OQ ratio scaled by P/100), `dapq` (patch queries at the
decode positions), `merge` (D2O merging of evicted entries), `d2o` (D2O variance-based layer
budgets instead of the method's own), `compact` (compact positions: kept entries re-rotated to
0, 1, 2, ...), `orig` (original positions), and EpiCache's recipe knobs one at a time
(docs/quality.md).

Positions: `epicache` keeps the library's default (compact, the last 2,048 tokens at their
spacing; original where the entries cannot be re-rotated); the baselines and `epicache-paper`
keep original positions, as their papers evaluate them, unless `+compact` or `+span<n>`.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field, replace

from pipeline.builder.config import BuildConfig
from pipeline.configs import (EpisodeConfig, MergeConfig, PositionMode, PrefillConfig,
                              RoutingConfig, ScoringConfig, TriStateConfig)

METHODS = ("full", "streamingllm", "snapkv", "infinipot", "kvzip", "keydiff", "epicache", "question")

# Known, not run by default: `epicache-paper` (the paper's recipe, for an honest comparison with
# the default), `keydiff-block` (KeyDiff anchored on the block's mean key only) and two floors
# for diagnosing the others, `random` and `oldest` (keep the first tokens).
EXTRA_METHODS = ("epicache-paper", "keydiff-block", "random", "oldest")
EPISODIC = ("epicache", "epicache-paper")  # one cache per episode, routed per question
ALLOCATED = EPISODIC + ("question",)  # methods that use the sensitivity-aware layer budgets
VARIANTS = ("tri", "fp8", "max", "dapq", "merge", "d2o", "compact", "orig", "adopt",
            # EpiCache diagnosis knobs (docs/quality.md): one factor at a time
            "pastonly", "withpatch", "qmean", "qmax", "utt", "tok", "perhead", "headwise",
            # routing (pipeline.routers): how a question picks its episode
            "rcen", "rwin", "rknn", "rexp", "rexw")
ROUTING_VARIANTS = {"rcen": "centroid", "rwin": "window", "rknn": "knn", "rexp": "expand",
                    "rexw": "expandwin"}

# Variants with a number: `oq25`, `alpha0.5`, `pool7`, `focus100` (weight 1.0), `sink16`,
# `recent64`, `cap256` (patch tokens), `floor20` (head floor 20% of the budget), `med2`
# (medoid windows), `ep8` (episodes), `two20` (read the best two episodes when the router's
# two best scores are closer than 20/1000), `span2048` (compact positions but the last 2,048
# tokens at their original spacing; `span0` all packed, as `compact`), `shared25` (25% of each
# layer's budget held for the other episodes' turns the patch attends to most).
NUMBERED_VARIANTS = ("oq<P>", "alpha<x>", "pool<k>", "focus<P>", "sink<n>", "recent<n>", "cap<n>",
                     "floor<P>", "med<n>", "ep<n>", "two<P>", "span<n>", "shared<P>")
_NUMBERED = re.compile(rf"^({'|'.join(v.split('<')[0] for v in NUMBERED_VARIANTS)})"
                       r"(\d+(?:\.\d+)?)$")


def _numbered(variant: str) -> tuple[str, float] | None:
    match = _NUMBERED.match(variant)
    return (match.group(1), float(match.group(2))) if match else None


def _numbers(variants: frozenset[str]) -> dict[str, float]:
    """The numbered variants' values by name: {"ep": 8.0, "two": 20.0, ...}."""
    return dict(n for n in map(_numbered, sorted(variants)) if n is not None)


def parse_method(name: str) -> tuple[str, frozenset[str]]:
    """(base method, variants) of `epicache+tri+dapq` or `epicache-tri`; ValueError if unknown."""
    parts = name.split("+")
    base, variants = parts[0], parts[1:]
    known = METHODS + EXTRA_METHODS + ("none",)
    if base not in known and "-" in base:
        base, variant = base.rsplit("-", 1)
        variants.insert(0, variant)
    unknown = [v for v in variants if v not in VARIANTS and _numbered(v) is None]
    if base not in known or unknown or (variants and base == "full"):
        raise ValueError(f"unknown method {name!r} ({describe_methods()})")
    return base, frozenset(variants)


def describe_methods() -> str:
    """The methods and variants `parse_method` accepts, as its error and `--methods` name them."""
    return (f"methods: {', '.join(METHODS + EXTRA_METHODS)}; variants: {', '.join(VARIANTS)}, "
            f"or numbered: {' '.join(NUMBERED_VARIANTS)}")


def _oq_scale(variant: str) -> float | None:
    """`oq25` -> 0.25 (the OQ-ratio scale variant), else None."""
    n = _numbered(variant)
    return n[1] / 100 if n is not None and n[0] == "oq" else None


def allocator_of(method: str) -> str | None:
    """The layer-budget allocator a method uses (None: uniform budgets)."""
    base, variants = parse_method(method)
    if "d2o" in variants:
        return "variance"
    return "sensitivity" if base in ALLOCATED else None


@dataclass(frozen=True)
class Recipe:
    """Everything that decides an EpiCache cell's caches, after the method's variants."""
    scoring: ScoringConfig
    alpha: float
    selection: str
    head_floor: float
    episodes: EpisodeConfig


@dataclass(frozen=True)
class EvalConfig:
    """An evaluation: the build every method starts from (`build`: the model, the encoder and
    every stage's configuration; a method's name and variants change it, `build_config`), and how
    the questions are measured. `build.prefill.tristate` and `build.prefill.merge` hold the
    parameters the `tri` and `merge` variants switch on."""
    build: BuildConfig = field(default_factory=BuildConfig)
    # how EpiCache's questions pick their episodes (a method's routing variants override it)
    routing: RoutingConfig = field(default_factory=RoutingConfig)
    questions_per_conversation: int | None = None
    generate: bool = False  # generate answers for F1 (slow; at the floor for a 135M model)
    max_new_tokens: int = 32
    recall_words: int = 4
    recall_tokens: int = 32

    @property
    def model(self) -> str:
        return self.build.model

    @property
    def encoder(self) -> str:
        return self.build.encoder

    @property
    def max_context_tokens(self) -> int | None:
        return self.build.max_context_tokens

    def recipe(self, method: str) -> Recipe:
        """The scoring, layer allocation, selection and episodes of a method and its variants.
        `epicache` starts from this configuration; `epicache-paper` from the paper's recipe
        (alpha 1, head-wise, max attention token by token, 4 episodes of 4 medoid windows)."""
        base, v = parse_method(method)
        if base == "epicache-paper":
            scoring, alpha, selection, floor = ScoringConfig.paper(), 1.0, "headwise", 0.0
            episodes = EpisodeConfig(window=self.build.episodes.window,
                                     seed=self.build.episodes.seed)
        else:
            b = self.build
            scoring, alpha, selection = b.scoring, b.alpha, b.prefill.selection
            floor, episodes = b.prefill.head_floor, b.episodes
        flags = {"pastonly": ("include_patch", False), "withpatch": ("include_patch", True),
                 "qmean": ("reduce", "mean"), "qmax": ("reduce", "max"),
                 "utt": ("utterance", True), "tok": ("utterance", False)}
        changes = dict(flags[x] for x in v if x in flags)
        numbers = _numbers(v)
        changes |= {key: int(numbers[key]) for key in ("pool", "sink", "recent") if key in numbers}
        changes |= {key: numbers[key] / 100 for key in ("focus", "shared") if key in numbers}
        if "cap" in numbers:
            changes["patch_tokens"] = int(numbers["cap"]) or None
        scoring = replace(scoring, **changes)
        alpha = numbers.get("alpha", alpha)
        selection = "perhead" if "perhead" in v else "headwise" if "headwise" in v else selection
        floor = numbers["floor"] / 100 if "floor" in numbers else floor
        ep_changes = {field_: int(numbers[key]) for key, field_ in
                      (("med", "medoids"), ("ep", "episodes")) if key in numbers}
        if "adopt" in v:
            ep_changes["adopt"] = True
        return Recipe(scoring, alpha, selection, floor, replace(episodes, **ep_changes))

    def route_of(self, method: str) -> tuple[str, float]:
        """The router of an episodic method (a variant `rwin`, ...; else `routing`'s, or the
        paper's nearest centroid for `epicache-paper`), and the score margin under which a
        question reads its best two episodes (`two<P>`: P/1000; `two0`: never)."""
        base, v = parse_method(method)
        named = [ROUTING_VARIANTS[x] for x in sorted(v) if x in ROUTING_VARIANTS]
        if len(named) > 1:
            raise ValueError(f"{method!r} names more than one router")
        numbers = _numbers(v)
        default = RoutingConfig("centroid", 0.0) if base == "epicache-paper" else self.routing
        two = numbers["two"] / 1000 if "two" in numbers else default.two_below
        return (named[0] if named else default.router), two

    def positions_of(self, method: str) -> tuple[PositionMode, int]:
        """Where a method's kept entries sit, and how many recent tokens keep their spacing
        under compact positions (see the module's docstring)."""
        base, v = parse_method(method)
        numbers = _numbers(v)
        if "orig" in v:
            if "compact" in v or "span" in numbers:
                raise ValueError(f"{method!r} names both original and compact positions")
            return "original", 0
        if "compact" in v or "span" in numbers:
            return "compact", int(numbers.get("span", 0))
        if base == "epicache":
            return self.build.prefill.positions, self.build.prefill.compact_recent
        return "original", 0

    def prefill_config(self, method: str) -> PrefillConfig:
        """The block-prefill configuration of a method and its variants."""
        _, v = parse_method(method)
        recipe = self.recipe(method)
        positions, recent = self.positions_of(method)
        scales = [_oq_scale(x) for x in v if _oq_scale(x) is not None]
        tri = bool(v & {"tri", "fp8", "max"}) or bool(scales)
        base = self.build.prefill
        tristate = replace(base.tristate, enabled=True, fp8=base.tristate.fp8 or "fp8" in v,
                           original_scale=scales[0] if scales else base.tristate.original_scale,
                           heavy_hitter=base.tristate.heavy_hitter and "max" not in v) \
            if tri else TriStateConfig()
        return PrefillConfig(block=base.block, selection=recipe.selection,
                             head_floor=recipe.head_floor,
                             decode_positions="dapq" in v, tristate=tristate,
                             merge=replace(base.merge, enabled=True) if "merge" in v
                             else MergeConfig(),
                             positions=positions, compact_recent=recent)

    def build_config(self, method: str, budget: int | None) -> BuildConfig:
        """The build configuration of a cell (it decides the layer budgets)."""
        allocator = allocator_of(method)
        recipe = self.recipe(method)
        base, _ = parse_method(method)
        scorer = "epicache" if base in EPISODIC else "full" if base == "none" else base
        return BuildConfig(model=self.model, encoder=self.encoder, scorer=scorer,
                           budget=budget, alpha=recipe.alpha if allocator == "sensitivity" else 0.0,
                           allocator=allocator or "sensitivity",
                           variance_temperature=self.build.variance_temperature,
                           episodes=recipe.episodes, calibration=self.build.calibration,
                           scoring=recipe.scoring, prefill=self.prefill_config(method))

    def needs_profile(self, method: str) -> bool:
        """Whether a method's layer budgets come from a measured profile (not uniform)."""
        allocator = allocator_of(method)
        return allocator == "variance" or (allocator == "sensitivity" and self.recipe(method).alpha > 0)

    def as_dict(self) -> dict:
        return asdict(self)
