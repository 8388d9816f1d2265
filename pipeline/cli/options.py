"""The command line's options, made from the configuration dataclasses.

Each option names the configuration field it sets (`FieldOption`: a flag and a dotted path such
as "prefill.tristate.window"); its type, choices and default are read from that field, and one
function reads a group of them back into the configuration. A default is never typed twice: the
dataclasses are the one place, and `jobs.build`, `jobs.evaluate`, the demo and the benchmarks
share the groups below.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, Callable, Sequence, TypeVar

from pipeline.cli.numbers import budget_list, count, finite, non_negative, positive_int
from pipeline.cli.parser import GIVEN
from pipeline.config import (
    ALLOCATOR_NAMES,
    STORE_DTYPES,
    BuildConfig,
    DriverOptions,
    MergeConfig,
    ScoringConfig,
    TopUpConfig,
    TriStateConfig,
    registry,
)
from pipeline.config.fields import (
    choices_of,
    field_hint,
    field_of,
    get_path,
    parser_of,
    replace_path,
)
from pipeline.corpus.records import CorpusLimits
from pipeline.kv import methods
from pipeline.serve.settings import ServeSettings

C = TypeVar("C")
_VALUED = object()  # FieldOption.const when the option takes a value


@dataclass(frozen=True)
class FieldOption:
    """A command-line option bound to the field at `path` of a configuration.

    A valued option takes the field's type, choices (a `Literal`) and default; over a bool
    field it is a pair, `--x` / `--no-x` (so a True default can be turned off). A flag
    (`const` given) sets `const` there when present, or `const(current value)` when `const` is
    callable. `zero_is_none`: the option's 0 stands for the field's None ("no cap"). `type`
    parses the text in place of the field's type, to refuse values the field's own checks let
    through (`pipeline.cli.numbers`); a float field is always refused NaN and infinity."""
    flag: str
    path: str
    help: str
    const: Any = _VALUED
    choices: Sequence | None = None
    metavar: str | None = None
    zero_is_none: bool = False
    type: Callable[[str], Any] | None = None

    @property
    def dest(self) -> str:
        return self.flag.lstrip("-").replace("-", "_")

    @property
    def is_flag(self) -> bool:
        return self.const is not _VALUED

    def add_to(self, p: argparse.ArgumentParser, base: Any, cls: type | None = None) -> None:
        """Add the option; its default is read from `base` (an instance, or the defaults of
        the dataclass `cls`: a field without one makes a required option)."""
        if self.is_flag:
            p.add_argument(self.flag, action="store_true", help=self.help)
            return
        cls = cls or type(base)
        default = get_path(base, self.path)
        if self.type is None and field_hint(cls, self.path) is bool:  # --x / --no-x
            p.add_argument(self.flag, action=argparse.BooleanOptionalAction, default=default,
                           help=f"{self.help} (default: {'on' if default else 'off'})")
            return
        if self.zero_is_none and default is None:
            default = 0
        choices = self.choices or choices_of(cls, self.path)
        extra = {"required": True} if default is dataclasses.MISSING else {"default": default}
        parse = self.type or parser_of(cls, self.path)
        p.add_argument(self.flag, type=finite if parse is float else parse,
                       choices=list(choices) if choices else None,
                       metavar=self.metavar or ("NAME" if choices and len(choices) > 6 else None),
                       help=self.help, **extra)

    def apply(self, config: C, a: argparse.Namespace) -> C:
        value = getattr(a, self.dest)
        if self.is_flag:
            if not value:
                return config
            value = self.const(get_path(config, self.path)) if callable(self.const) else self.const
        elif self.zero_is_none and value == 0:
            value = None
        return replace_path(config, self.path, value)


def add_options(p: argparse.ArgumentParser, options: Sequence[FieldOption], base: Any,
                cls: type | None = None) -> None:
    for option in options:
        option.add_to(p, base, cls)


def options_named(options: Sequence[FieldOption], *flags: str) -> tuple[FieldOption, ...]:
    """The options of a group with these flags, in the order given."""
    by_flag = {o.flag: o for o in options}
    return tuple(by_flag[f] for f in flags)


def apply_options(config: C, options: Sequence[FieldOption], a: argparse.Namespace) -> C:
    """`config` with every option of `options` read back from the parsed arguments, in order."""
    for option in options:
        config = option.apply(config, a)
    return config


# ---------------------------------------------------------------------------------------------
# The build configuration: the groups `jobs.build` and `jobs.evaluate` share, then the build's own
# ---------------------------------------------------------------------------------------------

# One cache's budget is `--budget N`, a list of them (one run each) `--budgets N,N,...`, in
# every command: the same words, the same parsing (`pipeline.cli.numbers`).
BUDGET_HELP = "mean entries kept per layer and KV head"


def add_budget_option(p: argparse.ArgumentParser, default: int, help: str = BUDGET_HELP) -> None:
    """`--budget N`: the one budget of a command that builds one cache size."""
    p.add_argument("--budget", type=positive_int, default=default, help=help)


def add_budgets_option(p: argparse.ArgumentParser, default: str,
                       help: str = f"comma-separated budgets, one run each: {BUDGET_HELP}") -> None:
    """`--budgets N,N,...`: the budgets of a command that runs each of them (a list of positive
    integers once parsed, the default too)."""
    p.add_argument("--budgets", type=budget_list, default=default, metavar="N,N,...", help=help)


MODEL_OPTIONS = (
    FieldOption("--model", "model", "LLM: packaged name or local HF folder"),
    FieldOption("--encoder", "encoder", "sentence encoder (episodes and routing)"),
)
EPISODE_OPTIONS = (
    FieldOption("--episodes", "episodes.episodes", "episodes (K-Means clusters) per conversation"),
    FieldOption("--medoids", "episodes.medoids", "medoid windows in an episode's patch"),
    FieldOption("--window", "episodes.window", "utterances per clustering window"),
    FieldOption("--seed", "episodes.seed", "K-Means seed", type=count),
)
PREFILL_OPTIONS = (
    FieldOption("--block", "prefill.block", "block-prefill block size (tokens)"),
    FieldOption("--selection", "prefill.selection",
                "top-k across a layer's heads (AdaKV) or per head"),
    FieldOption("--max-context-tokens", "max_context_tokens",
                "cut each conversation at a session boundary to fit this many tokens "
                "(default: whole)", type=positive_int),
)
ALLOCATION_OPTIONS = (
    FieldOption("--alpha", "alpha",
                "sensitivity-aware layer allocation sharpness (0: uniform budgets)"),
    FieldOption("--variance-temperature", "variance_temperature",
                "D2O inverse-variance softmax temperature (--allocator variance, or the d2o "
                "variant)"),
    FieldOption("--calibration-tokens", "calibration.tokens",
                "calibration text length (layer profiles, with --alpha > 0 or the variance "
                "allocator)", type=positive_int),
    FieldOption("--calibration-window", "calibration.window",
                "calibration: the simulated budget (sink + recent tokens)", type=positive_int),
)
TRISTATE_OPTIONS = (
    FieldOption("--tri-window", "prefill.tristate.window",
                "tri-state: the recent tokens always kept Original"),
    FieldOption("--tri-gamma", "prefill.tristate.gamma", "tri-state heavy-hitter gamma"),
    FieldOption("--tri-original-scale", "prefill.tristate.original_scale",
                "scales the OQ ratio (share of a layer's bytes spent on Original entries)"),
    FieldOption("--tri-slack", "prefill.tristate.slack", "tri-state slack factor"),
    FieldOption("--merge-beta", "prefill.merge.beta", "D2O merging's EMA beta"),
)
# What `jobs.evaluate` takes too: there a method's name and variants decide the rest.
SHARED_BUILD_OPTIONS = (MODEL_OPTIONS + EPISODE_OPTIONS + PREFILL_OPTIONS + ALLOCATION_OPTIONS
                        + TRISTATE_OPTIONS)

BUILD_OPTIONS = SHARED_BUILD_OPTIONS + (
    FieldOption("--scorer", "scorer",
                "how entries are scored for eviction, one of %(choices)s (docs/building.md, "
                "'Scorers'); epicache builds one cache per episode, the others one per "
                "conversation", choices=methods.buildable(),
                metavar="SCORER"),
    FieldOption("--budget", "budget",
                f"{BUDGET_HELP} (--tristate: the bytes of that many Original entries; a method "
                "that does not evict takes none)", type=positive_int),
    FieldOption("--full", "budget", "no eviction: store the full cache", const=None),
    FieldOption("--focus", "scoring.focus",
                "weight the episode's own turns' scores by 1 + FOCUS (0: off)"),
    FieldOption("--patch-tokens", "scoring.patch_tokens",
                "cap on the patched prompt's tokens (0: the whole medoid text)",
                zero_is_none=True),
    FieldOption("--paper", "scoring",
                "EpiCache scored as the paper describes it (max patch attention, token by "
                "token, whole patch); add --alpha 1 for its layer budgets",
                const=ScoringConfig.paper()),
    FieldOption("--positions", "prefill.positions",
                "auto: compact, or original where entries cannot be re-rotated (DapQ; the "
                "manifest's positions_note says so); original: entries keep their "
                "token positions, so a conversation must fit the model's positions; compact: "
                "kept entries are re-rotated to positions 0, 1, 2, ... after every eviction, "
                "for histories of any length"),
    FieldOption("--compact-recent", "prefill.compact_recent",
                "compact positions: the last N tokens keep their original spacing, only the "
                "older entries are packed (0: all packed)"),
    FieldOption("--one-pass", "prefill.one_pass",
                "build every episode of a conversation in one layer-by-layer pass (about one "
                "prefill) instead of a block prefill per episode (not with --tristate)",
                const=True),
    FieldOption("--one-pass-beyond", "prefill.one_pass_beyond",
                "with --one-pass, past what one reading of the model's positions holds: blocks: "
                "each episode goes on by block prefill from the pass's cache (block prefill's "
                "evidence whole); shared: the rest read once over the episodes' caches joined; "
                "window: the pass slides a window (about one prefill, less evidence whole)"),
    FieldOption("--pass-focus", "prefill.pass_focus",
                "with --one-pass: weight the episode's own turns by (1 + this) in the cut of "
                "the pass's first span, made at once (default: --focus, as every later cut)"),
    FieldOption("--shared-span", "prefill.shared_span",
                "with --one-pass-beyond shared: the fewest tokens a span takes where the "
                "episodes' joined caches would fill more of the positions, the shared context "
                "keeping the rest (0: half the positions, the context the other half)"),
    FieldOption("--shared-span-most", "prefill.shared_span_most",
                "with --one-pass-beyond shared: the most tokens a span takes, each episode "
                "cutting it to its budget at once (0: half the positions)"),
    FieldOption("--store-dtype", "store_dtype", "dtype of the stored keys and values",
                choices=STORE_DTYPES),
    FieldOption("--code-bits", "code.bits",
                "store the keys and values in KIVI's low-bit codes of this many bits (2, 3, "
                "4, 5, 6 or 8; 0: floats at --store-dtype); not with --tristate"),
    FieldOption("--code-value-bits", "code.value_bits",
                "low-bit codes: the values at this many bits (2, 3, 4, 5, 6 or 8), the keys at "
                "--code-bits (default: the same)"),
    FieldOption("--code-rotate", "code.rotate",
                "low-bit codes: turn the keys by a Hadamard matrix over each head's channels "
                "before coding them, and back when read (QuaRot): the error of the few wide "
                "channels the queries read spread over all, at the same bytes",
                const=True),
    FieldOption("--code-rotate-values", "code.rotate_values",
                "low-bit codes: turn the values too before coding them (QuaRot): a value's few "
                "wide channels no longer set its group's step, at the same bytes",
                const=True),
    FieldOption("--code-key-axis", "code.key_axis",
                "low-bit codes: the keys coded per channel over --code-group entries (KIVI), or "
                "per token over --code-group channels as the values are (with --code-rotate: "
                "QuaRot's, the same bytes)"),
    FieldOption("--code-double-quant", "code.double_quant",
                "low-bit codes: store each group's step and minimum as an 8-bit code in blocks "
                "of 256 groups (QLoRA's double quantization): half the scales' bytes",
                const=True),
    FieldOption("--zstd", "code.zstd",
                "compress each stored cache object whole at this zstd level (1-22; lossless: "
                "about 11%% fewer bytes for float16 entries, 15-20%% for codes, decompressed when "
                "read; default: not compressed); not in the build's hash, so a store built "
                "without it keeps its objects as they are (--force writes them again)"),
    FieldOption("--code-group", "code.group",
                "low-bit codes: numbers sharing a minimum and a step (keys: a channel over this "
                "many entries; values: this many channels of an entry)"),
    FieldOption("--code-float-sinks", "code.float_sinks",
                "low-bit codes: each head's first N entries (the attention sinks) kept as floats "
                "beside the codes"),
    FieldOption("--code-float-recent", "code.float_recent",
                "low-bit codes: each head's last N entries (the most recent) kept as floats "
                "beside the codes"),
    FieldOption("--code-equal-bytes", "code.bytes_budget",
                "low-bit codes: --budget M reads as the bytes of M float entries, and the build "
                "keeps as many coded entries as they hold", const=True),
    FieldOption("--allocator", "allocator",
                "layer budgets: EpiCache sensitivity or D2O attention variance",
                choices=sorted(ALLOCATOR_NAMES)),
    FieldOption("--tristate", "prefill.tristate.enabled",
                "ARKV tri-state compression: --budget M = the bytes of M Original tokens per "
                "layer and KV head; entries Original, Quantized (int8) or Evicted", const=True),
    FieldOption("--fp8", "prefill.tristate",
                "tri-state with fp8 e4m3 codes instead of int8 (implies --tristate)",
                const=lambda t: dataclasses.replace(t, enabled=True, fp8=True)),
    FieldOption("--dapq", "prefill.decode_positions",
                "DapQ: patch queries at the decode positions (after the conversation)",
                const=True),
    FieldOption("--merge", "prefill.merge.enabled",
                "D2O: merge evicted entries into kept ones", const=True),
)


def _calibration_sink(config: BuildConfig) -> BuildConfig:
    """The calibration's sink follows its window: a quarter of it, at most 128 tokens."""
    cal = config.calibration
    return dataclasses.replace(config, calibration=dataclasses.replace(
        cal, sink=min(128, cal.window // 4)))


def build_config_from_args(a: argparse.Namespace, options: Sequence[FieldOption] = BUILD_OPTIONS,
                           base: BuildConfig | None = None) -> BuildConfig:
    """The build configuration the options say, what its method does not read refused
    (`refuse_unread`). The parameters of a strategy left off (tri-state, merging) are dropped,
    and a method that does not evict is built without a budget, so neither changes the
    configuration's hash."""
    base = base or BuildConfig()
    config = _calibration_sink(apply_options(base, options, a))
    refuse_unread(config, given_options(a, options, base))
    prefill = config.prefill
    if not prefill.tristate.enabled:
        prefill = dataclasses.replace(prefill, tristate=TriStateConfig())
    if not prefill.merge.enabled:
        prefill = dataclasses.replace(prefill, merge=MergeConfig())
    budget = config.budget if registry.reads(config.scorer, "budget") else None
    return dataclasses.replace(config, prefill=prefill, budget=budget)


def given_options(a: argparse.Namespace, options: Sequence[FieldOption],
                  base: Any) -> list[FieldOption]:
    """The options of `options` the command line gave: as noted by
    `pipeline.cli.parser.parse_noting_given`, else (a namespace made otherwise) those set or
    holding another value than `base`'s."""
    given = getattr(a, GIVEN, None)
    if given is not None:
        return [o for o in options if o.dest in given]
    return [o for o in options if (getattr(a, o.dest) if o.is_flag else
                                   o.apply(base, a) != base)]


def refuse_unread(config: BuildConfig, given: Sequence[FieldOption]) -> None:
    """ValueError naming the first option given that the configured method does not read
    (`pipeline.config.registry.reads`: a section only other methods read, or a budget where
    it does not evict): such an option would change nothing in the caches, so it is refused
    rather than ignored. `--full` says what a method that does not evict is, so it passes."""
    method = config.scorer
    for option in given:
        if registry.reads(method, option.path) or (option.path == "budget" and option.is_flag):
            continue
        section = option.path.partition(".")[0]
        readers = ", ".join(registry.readers(section)) or "no registered method"
        if section == "budget":
            why = "it does not evict (its cache is the full cache, built without a budget)"
        elif section == registry.EPISODES:
            why = (f"it builds one cache per conversation (the episodes' options are read by "
                   f"the methods built per episode: {readers})")
        else:
            why = f"it runs at its own parameters (the {section} options are read by {readers})"
        raise ValueError(f"{option.flag} is not read by --scorer {method}: {why}")


def eval_build_config_from_args(a: argparse.Namespace) -> BuildConfig:
    """The build an evaluation's methods start from (`EvalConfig.build`): the shared options,
    the tri-state and merging parameters kept (a method's `tri` and `merge` variants use them)."""
    return _calibration_sink(apply_options(BuildConfig(), SHARED_BUILD_OPTIONS, a))


# ---------------------------------------------------------------------------------------------
# How the build runs on Ray (not hashed), the corpus and the store
# ---------------------------------------------------------------------------------------------

DRIVER_OPTIONS = (
    FieldOption("--force", "force", "rebuild conversations already built", const=True),
    FieldOption("--verify", "verify",
                "read every object a built conversation's manifest names and check its SHA-256 "
                "(each is always checked to exist at its recorded size); rebuild what fails",
                const=True),
    FieldOption("--max-in-flight", "max_in_flight", "tasks submitted at most"),
    FieldOption("--cpus-per-task", "cpus_per_task", "Ray CPUs per task", type=non_negative),
    FieldOption("--gpus-per-task", "gpus_per_task",
                "Ray GPUs per task (default: 1 when the cluster has GPUs now, else 0; give 1 on "
                "an autoscaling cluster whose GPU workers start at zero)", type=non_negative),
    FieldOption("--max-retries", "max_retries", "Ray retries per task on worker death"),
    FieldOption("--no-progress", "progress", "no progress bar (e.g. in a job's log)",
                const=False),
    FieldOption("--no-append", "growth.append",
                "rebuild a grown conversation from its first turn instead of appending its new "
                "turns to the stored caches", const=False),
    FieldOption("--max-growth", "growth.max_growth",
                "re-cluster and rebuild a grown conversation once it holds more than this many "
                "times the turns it had when last clustered"),
    FieldOption("--far-similarity", "growth.far_similarity",
                "a new window is far from the episodes below this cosine to every centroid"),
    FieldOption("--far-share", "growth.far_share",
                "re-cluster and rebuild when more than this share of the new windows are far"),
)

LIMIT_OPTIONS = (
    FieldOption("--max-record-bytes", "max_record_bytes",
                "largest JSONL line (or .json file) accepted, in bytes"),
    FieldOption("--max-turn-chars", "max_turn_chars",
                "longest turn text (or caption) accepted, in characters"),
)


def add_driver_options(p: argparse.ArgumentParser) -> None:
    add_options(p, DRIVER_OPTIONS, DriverOptions())


def driver_options_from_args(a: argparse.Namespace,
                             options: Sequence[FieldOption] = DRIVER_OPTIONS,
                             base: DriverOptions = DriverOptions()) -> DriverOptions:
    return apply_options(base, options, a)


def add_corpus_options(p: argparse.ArgumentParser) -> None:
    """The corpus options `jobs.build` and `jobs.evaluate` share."""
    p.add_argument("--on-bad-record", default="fail", choices=["fail", "skip"],
                   help="a malformed record (or question) stops the run, or is skipped (a "
                        "question: dropped, its conversation kept) and listed in skipped.jsonl")
    add_options(p, LIMIT_OPTIONS, CorpusLimits())


def limits_from_args(a: argparse.Namespace) -> CorpusLimits:
    return apply_options(CorpusLimits(), LIMIT_OPTIONS, a)


# ---------------------------------------------------------------------------------------------
# The Serve endpoint: one option per ServeSettings field (its help is the field's metadata)
# ---------------------------------------------------------------------------------------------

SERVE_OPTIONS = tuple(
    FieldOption(f.metadata.get("flag") or "--" + f.name.replace("_", "-"), f.name,
                f.metadata["help"], metavar=f.metadata.get("metavar"),
                zero_is_none=f.metadata.get("zero_is_none", False))
    for f in dataclasses.fields(ServeSettings) if f.metadata.get("cli", True))
# The fields' own defaults, not an instance's: an instance would resolve the token and the
# endpoint from the environment, and --help would print them.
_SERVE_DEFAULTS = SimpleNamespace(**{f.name: f.default for f in dataclasses.fields(ServeSettings)})


def add_serve_options(p: argparse.ArgumentParser) -> None:
    add_options(p, SERVE_OPTIONS, _SERVE_DEFAULTS, ServeSettings)


def settings_from_args(a: argparse.Namespace) -> ServeSettings:
    return ServeSettings(**{o.path: getattr(a, o.dest) for o in SERVE_OPTIONS})


def _serve_help(name: str) -> str:
    return field_of(ServeSettings, name).metadata["help"]


# `jobs.answer`'s top-up: the options `jobs.serve` has, said once (ServeSettings' help)
TOPUP_OPTIONS = (
    FieldOption("--topup", "enabled", _serve_help("topup")),
    FieldOption("--topup-turns", "turns", _serve_help("topup_turns"), type=non_negative,
                zero_is_none=True),
    FieldOption("--topup-max-tokens", "max_tokens", _serve_help("topup_max_tokens"),
                type=positive_int),
    FieldOption("--topup-skip-held", "skip_held", _serve_help("topup_skip_held")),
    FieldOption("--topup-nearer-than-held", "nearer_than_held",
                _serve_help("topup_nearer_than_held")),
    FieldOption("--topup-read-once", "read_once", _serve_help("topup_read_once")),
)


def add_topup_options(p: argparse.ArgumentParser) -> None:
    add_options(p, TOPUP_OPTIONS, TopUpConfig())


def topup_config_from_args(a: argparse.Namespace) -> TopUpConfig:
    return apply_options(TopUpConfig(), TOPUP_OPTIONS, a)


# ---------------------------------------------------------------------------------------------
# The benchmarks'
# ---------------------------------------------------------------------------------------------

def add_threads_option(p: argparse.ArgumentParser) -> None:
    """`--threads`: pinning torch's threads gives steadier timings on a busy machine."""
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")


def add_model_options(p: argparse.ArgumentParser) -> None:
    """`--model` and `--threads`, as every benchmark that loads the model takes them."""
    add_options(p, MODEL_OPTIONS[:1], BuildConfig())
    add_threads_option(p)


PREFILL_BENCH_OPTIONS = (
    FieldOption("--budget", "budget", BUDGET_HELP, type=positive_int),
    FieldOption("--block", "prefill.block", "block-prefill block size (tokens)"),
)


def add_prefill_options(p: argparse.ArgumentParser, lengths: str) -> None:
    """The options of one episode's block prefill at growing lengths (jobs.bench.memory,
    jobs.bench.build_speed), `lengths` being the default lengths."""
    p.add_argument("--lengths", default=lengths,
                   help="comma-separated conversation lengths (tokens)")
    add_options(p, PREFILL_BENCH_OPTIONS, BuildConfig())
    p.add_argument("--layers", type=int, default=None,
                   help="run the first N decoder layers only (default: all)")
