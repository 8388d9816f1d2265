"""The configurations of the method's stages: plain frozen dataclasses, no torch.

    EpisodeConfig      stage 1: windows of turns clustered into episodes (pipeline.episodes)
    ScoringConfig      how an episode's patch attention scores entries
                       (pipeline.kv.methods.epicache)
    TriStateConfig     ARKV's Original / Quantized / Evicted eviction (pipeline.kv.tristate)
    MergeConfig        D2O's merging of evicted entries (pipeline.kv.merging)
    CodeConfig         how the stored keys and values are coded (pipeline.store.objects.low_bit)
    PrefillConfig      stage 2: block prefill under a budget (pipeline.kv.prefill)
    CalibrationConfig  the layer profile's calibration (pipeline.kv.budgets)
    GrowthConfig       when a grown conversation is appended to, or re-clustered and rebuilt
                       (pipeline.builder.growth)
    RoutingConfig      how a question picks its episode (pipeline.routers; not hashed)

with the default models and the names of the layer allocators and routers (as registered in
`pipeline.config.registry`). They live apart from the code that runs them (as transformers
keeps a model's configuration apart from its modelling code) so that a command parses its
options and checks its input before torch, transformers or Ray load:
`pipeline.config.build.BuildConfig` nests them, and the command line (`pipeline.cli.options`)
reads their fields.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Literal, get_args

from pipeline.config.registry import ALLOCATORS, ROUTERS

DEFAULT_LLM = "SmolLM2-135M-Instruct"
DEFAULT_ENCODER = "all-MiniLM-L6-v2"

# The layer allocators' and the routers' names, as registered (`pipeline.config.registry`, which
# imports none of them), for the command line's choices before torch loads.
ALLOCATOR_NAMES = tuple(ALLOCATORS)
ROUTER_NAMES = tuple(ROUTERS)

PositionMode = Literal["auto", "original", "compact"]
POSITION_MODES: tuple[str, ...] = get_args(PositionMode)
OnePassBeyond = Literal["blocks", "shared", "window"]  # PrefillConfig.one_pass_beyond
ONE_PASS_BEYOND: tuple[str, ...] = get_args(OnePassBeyond)
KeyAxis = Literal["channel", "token"]  # CodeConfig.key_axis
KEY_AXES: tuple[str, ...] = get_args(KeyAxis)


@dataclass(frozen=True)
class EpisodeConfig:
    window: int = 4  # utterances per window
    episodes: int = 4  # K-Means clusters requested
    medoids: int = 4  # windows per patched prompt
    seed: int = 0
    n_init: int = 10

    def __post_init__(self):
        for name in ("window", "episodes", "medoids", "n_init"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class ScoringConfig:
    """How an episode's patch attention becomes the scores its eviction ranks by (hashed into
    the build configuration). `paper()` is EpiCache as the paper describes it: max attention
    over the patch queries (and the query heads of a KV group), the patch's own keys in the
    softmax, token by token, the whole medoid patch. The default keeps the episode's own turns
    first (`focus`), whole (`utterance`), ranked by the attention of the patch's first 256
    tokens, with the first 4 tokens (the attention sinks) always kept: measured in
    docs/quality.md and docs/changelog.md."""
    pool: int = 0  # max-pool the scores over this many neighbouring entries (SnapKV); 0: off
    utterance: bool = True  # score whole lines (turns): keep or evict utterances whole
    focus: float = 10.0  # weight the episode's own turns' scores by (1 + focus)
    # always keep the first `sink` tokens: without them most heads of a small budget hold no
    # attention sink (StreamingLLM), and at full length the answers lose (docs/changelog.md)
    sink: int = 4
    recent: int = 0  # always keep the `recent` most recent tokens
    patch_tokens: int | None = 256  # cap on the patched prompt's length (its first tokens)

    def __post_init__(self):
        if self.pool < 0 or self.pool % 2 == 0 and self.pool:
            raise ValueError(f"pool must be 0 or an odd width, got {self.pool}")
        if min(self.focus, self.sink, self.recent) < 0:
            raise ValueError("focus, sink and recent must be non-negative")
        if self.patch_tokens is not None and self.patch_tokens < 1:
            raise ValueError(f"patch_tokens must be positive, got {self.patch_tokens}")

    @classmethod
    def paper(cls) -> "ScoringConfig":
        return cls(pool=0, utterance=False, focus=0.0, sink=0, recent=0, patch_tokens=None)


@dataclass(frozen=True)
class TriStateConfig:
    """ARKV tri-state compression (paper §IV-C..F; defaults from §V-E)."""
    enabled: bool = False
    fp8: bool = False  # quantized tier: fp8 e4m3 instead of int8 (same bytes, per-row scale)
    window: int = 32  # W: the most recent tokens, always Original (§V-E)
    gamma: float = 263.81  # heavy-hitter score mean + gamma * variance (eq. 9, §V-E)
    tau_entropy: float = 7.774  # OQ score temperatures (eq. 6, §V-E)
    tau_variance: float = 5.407
    tau_kurtosis: float = 5.528
    original_scale: float = 1.0  # rho_l = min(1, original_scale * q_l / max q) (eq. 7 at 1.0)
    slack: float = 0.75  # between blocks a layer may hold budget / slack bytes before it is cut
    heavy_hitter: bool = True  # rank by the heavy-hitter score; False: by the scorer's scores

    def __post_init__(self):
        if self.window < 0:
            raise ValueError(f"tri-state window must be non-negative, got {self.window}")
        if min(self.tau_entropy, self.tau_variance, self.tau_kurtosis) <= 0:
            raise ValueError("OQ temperatures must be positive")
        if self.original_scale < 0 or self.gamma < 0:
            raise ValueError("original_scale and gamma must be non-negative")
        if self.slack <= 0:
            raise ValueError(f"slack must be positive, got {self.slack}")


@dataclass(frozen=True)
class MergeConfig:
    """D2O dynamic token merging (paper §4.2.2; beta = 0.7 from §5.1 / A.3)."""
    enabled: bool = False
    beta: float = 0.7  # EMA weight of the current step's mean best similarity (eq. 10)
    min_threshold: float = -1.0  # the threshold used is max(EMA, min_threshold)

    def __post_init__(self):
        if not 0 < self.beta <= 1:  # an EMA weight
            raise ValueError(f"merge beta must be in (0, 1], got {self.beta}")


CODE_BITS = (2, 3, 4, 5, 6, 8)  # the low-bit codes' widths (`kernels.quant_reference.GROUP_BITS`)


@dataclass(frozen=True)
class CodeConfig:
    """How the stored keys and values are coded (`pipeline.store.objects.low_bit`): as floats at
    `BuildConfig.store_dtype` (bits 0), or in KIVI's asymmetric low-bit codes (arXiv
    2402.02750): keys per channel over `group` tokens of a head, values per token over `group`
    channels, each group with a float16 minimum and step. Coded after the build, so the caches
    keep every position mode; the reader decodes them to floats."""
    bits: int = 0  # 0: floats; 2, 3, 4, 5, 6 or 8 bits a number
    group: int = 32  # numbers sharing a minimum and a step (KIVI: 32)
    # the budget M reads as the bytes of M entries at the store dtype: the build keeps as many
    # coded entries as those bytes hold (`BuildConfig.entry_budget`), as tri-state's does
    bytes_budget: bool = False
    # entries of each head kept as floats beside the codes: its first (the attention sinks,
    # which every query reads) and its last (the most recent turns: KIVI's float residual)
    float_sinks: int = 0
    float_recent: int = 0
    # the values' code width where it differs from the keys' (None: `bits`): a value's error
    # moves its share of the output alone, a key's moves every weight of the softmax
    value_bits: int | None = None
    # the stored object compressed losslessly at this zstd level (None: as safetensors writes
    # it): 11% fewer bytes stored and fetched for float16 entries, 15-20% for codes, for about
    # a parse's time again to decompress on a CPU (docs/benchmarks.md, "Stored bytes"). Not in
    # the build's hash: the same caches in fewer bytes; a reader reads either
    zstd: int | None = None
    # the keys turned by an orthonormal Hadamard matrix over each head's channels before they
    # are coded, and back when read (QuaRot, arXiv 2404.00456): the code's error, which the
    # keys' few wide channels (those the queries read) would take, is spread over all of them
    rotate: bool = False
    # the values turned the same way (QuaRot turns both): coded per token, a value's few wide
    # channels set its group's step; turned, SmolLM2's values' error falls by a quarter and the
    # attention output's by 14% at 4 + 4 bits, yet answers lose a point @512 on the tuning cuts
    # (docs/changelog.md), so not the default
    rotate_values: bool = False
    # the keys coded per channel over `group` entries (KIVI: their few wide channels each get
    # their own step), or per token over `group` channels as the values are (QuaRot's choice
    # once they are turned, which leaves no wide channel): the same bytes; measured turned, it
    # loses copy-free evidence @1,024 on the tuning cuts (docs/changelog.md), so not the default
    key_axis: KeyAxis = "channel"
    # each group's float16 step and minimum stored as an 8-bit code, in blocks of 256 groups
    # sharing a float16 step and minimum (QLoRA's double quantization, arXiv 2305.14314): half
    # the scales' bytes, 4-5% of a coded object, for a small error in every group's scales
    double_quant: bool = False

    @property
    def keeps_floats(self) -> bool:
        """Whether some entries of each head are kept as floats beside the codes."""
        return bool(self.float_sinks or self.float_recent)

    @property
    def value_width(self) -> int:
        """The values' code width: `value_bits`, or the keys' `bits`."""
        return self.bits if self.value_bits is None else self.value_bits

    @property
    def mixed_bits(self) -> bool:
        """Whether the values are coded at another width than the keys."""
        return self.value_width != self.bits

    @property
    def bytes_per_number(self) -> float:
        """Stored bytes per key or value number (their mean): its code, and its share of its
        group's step and minimum (float16, or 8-bit where double quantized)."""
        return (self.bits + self.value_width) / 16 + (2 if self.double_quant else 4) / self.group

    def __post_init__(self):
        if self.bits not in (0, *CODE_BITS):
            raise ValueError(f"code bits must be 0 (floats) or one of {CODE_BITS}, got "
                             f"{self.bits}")
        if self.group < 8 or self.group & (self.group - 1):
            raise ValueError(f"code group must be a power of two >= 8, got {self.group}")
        if self.float_sinks < 0 or self.float_recent < 0:
            raise ValueError(f"code float_sinks and float_recent must be >= 0, got "
                             f"{self.float_sinks} and {self.float_recent}")
        if self.keeps_floats and not self.bits:
            raise ValueError("entries kept as floats beside the codes (code.float_sinks, "
                             "code.float_recent) need a low-bit code (code.bits)")
        if self.value_bits is not None and (not self.bits or self.value_bits not in CODE_BITS):
            raise ValueError(f"code value_bits must be one of {CODE_BITS} and needs a low-bit "
                             f"code for the keys (code.bits), got {self.value_bits} with bits "
                             f"{self.bits}")
        if self.rotate and not self.bits:
            raise ValueError("keys turned before coding (code.rotate) need a low-bit code "
                             "(code.bits)")
        if self.rotate_values and not self.bits:
            raise ValueError("values turned before coding (code.rotate_values) need a low-bit "
                             "code (code.bits)")
        if self.key_axis not in KEY_AXES:
            raise ValueError(f"code key_axis must be one of {KEY_AXES}, got {self.key_axis!r}")
        if self.double_quant and not self.bits:
            raise ValueError("scales double quantized (code.double_quant) need a low-bit code "
                             "(code.bits)")
        if self.key_axis == "token" and not self.bits:
            raise ValueError("keys coded per token (code.key_axis) need a low-bit code "
                             "(code.bits)")
        if self.zstd is not None and not 1 <= self.zstd <= 22:
            raise ValueError(f"code zstd is a zstd level from 1 to 22 (or None), got {self.zstd}")
        if self.bytes_budget and not self.bits:
            raise ValueError("a budget in bytes (code.bytes_budget) needs a low-bit code "
                             "(code.bits)")


Selection = Literal["headwise", "perhead"]


ONE_PASS_NOT_TRISTATE = ("one pass cannot build tri-state caches (their byte split reads every "
                         "layer's attention at once): build them block by block")


@dataclass(frozen=True)
class PrefillConfig:
    block: int = 512  # tokens fed per step
    # AdaKV head-wise non-uniform top-k, or a uniform per-head top-k
    selection: Selection = "headwise"
    head_floor: float = 0.0  # head-wise: each head keeps at least this share of the budget (AdaKV)
    decode_positions: bool = False  # DapQ: patch queries at the decode positions (after the text)
    tristate: TriStateConfig = field(default_factory=TriStateConfig)  # ARKV
    merge: MergeConfig = field(default_factory=MergeConfig)  # D2O token merging
    # "compact": kept entries re-rotated to 0, 1, 2, ... after every eviction; "original": each
    # at its token's position; "auto" (the default): compact where the entries can be
    # re-rotated, else original, with the reason in the manifest (`positions_note`)
    positions: PositionMode = "auto"
    # compact positions: the last this-many tokens keep their original spacing (only the
    # older entries are packed), so recent evidence is read at the distances it was written at
    compact_recent: int = 2048
    # build every episode of a conversation in one layer-by-layer pass (`pipeline.kv.one_pass`)
    # instead of a block prefill per episode
    one_pass: bool = False
    # one pass: each patch scores the keys in spans of this many, each span read as if the
    # patch followed it (as a block's patch reads a budget-sized cache); 0: every key the
    # model's positions reach at once
    score_span: int = 0
    # with `score_span`: the spans' share of a key's score, the rest the plain pass's (each
    # summed to 1 over the layer first), so a key either reading finds important can be kept
    score_span_share: float = 1.0
    # one pass: the episode's own turns weighted by (1 + this) in the pass's cut, where each
    # episode cuts its first span (up to the model's positions) to its budget at once; None:
    # the scorer's own `ScoringConfig.focus`, which the cuts past it (spans, blocks, appends)
    # keep either way. A cut at once has found too few of the episode's own turns at block
    # prefill's focus (docs/changelog.md)
    pass_focus: float | None = None
    # one pass: every forward past the model's positions also reads the first this-many tokens,
    # moved to sit just before its window (StreamingLLM's attention sinks); without them each
    # token past the first window is computed with no sink, and a whole conversation's caches
    # lost half their copy-free evidence (docs/changelog.md). Block prefill keeps its sinks in
    # the cache (`ScoringConfig.sink`) and never reads this
    pass_sinks: int = 4
    # one pass past its first span (what one reading of the model's positions holds): "blocks",
    # each episode goes on from the pass's cache by block prefill, as an append does (every
    # token read with its episode's cache: whole conversations keep block prefill's copy-free
    # evidence); "shared", the rest goes through once, span by span over a context the episodes
    # share, each taking a span as a block (`pipeline.kv.shared_spans`); "window", the pass slides a
    # window of the model's positions over the rest, at about one prefill's cost but with less
    # copy-free evidence whole (docs/changelog.md)
    one_pass_beyond: OnePassBeyond = "blocks"
    # "shared": the fewest tokens a span takes where the episodes' joined caches would fill more
    # of the model's positions (the shared context keeps the rest of them, less the patch); the
    # spans themselves take at most half the positions. 0: half (the context capped at the other
    # half, less the patch)
    shared_span: int = 0
    # "shared": the most tokens a span takes (at most half the positions; 0: half). Each episode
    # cuts a span to its budget at once, so a shorter span is a gentler cut, at a patch more per
    # span and episode
    shared_span_most: int = 0

    @property
    def cannot_compact(self) -> str | None:
        """Why this configuration's entries cannot be re-rotated (None: they can)."""
        if self.decode_positions:
            return "DapQ's decode positions are not known before the end"
        return None

    @property
    def position_mode(self) -> Literal["original", "compact"]:
        """The positions the caches keep: `positions`, with "auto" resolved."""
        if self.positions != "auto":
            return self.positions
        return "original" if self.cannot_compact else "compact"

    @property
    def positions_note(self) -> str | None:
        """Why "auto" kept original positions, for the manifest (None: it did not)."""
        if self.positions == "auto" and self.cannot_compact:
            return f"original positions: {self.cannot_compact}"
        return None

    def __post_init__(self):
        if self.block < 1:
            raise ValueError(f"block must be positive, got {self.block}")
        if self.selection not in ("headwise", "perhead"):
            raise ValueError(f"selection must be 'headwise' or 'perhead', got {self.selection!r}")
        if not 0 <= self.head_floor <= 1:
            raise ValueError(f"head_floor must be in [0, 1], got {self.head_floor}")
        if self.positions not in POSITION_MODES:
            raise ValueError(f"positions must be one of {POSITION_MODES}, got {self.positions!r}")
        if self.compact_recent < 0:
            raise ValueError(f"compact_recent must be >= 0, got {self.compact_recent}")
        if self.score_span < 0 or (self.score_span and not self.one_pass):
            raise ValueError(f"score_span must be >= 0 and needs one_pass, got {self.score_span}")
        if not 0 <= self.score_span_share <= 1 or (self.score_span_share < 1 and
                                                    not self.score_span):
            raise ValueError(f"score_span_share must be in [0, 1] and, below 1, needs score_span, "
                             f"got {self.score_span_share}")
        if self.one_pass_beyond not in ONE_PASS_BEYOND:
            raise ValueError(f"one_pass_beyond must be one of {ONE_PASS_BEYOND}, "
                             f"got {self.one_pass_beyond!r}")
        if self.shared_span < 0 or (self.shared_span and self.one_pass_beyond != "shared"):
            raise ValueError(f"shared_span must be >= 0 and needs one_pass_beyond='shared', "
                             f"got {self.shared_span}")
        if self.shared_span_most < 0 or (self.shared_span_most and (
                self.one_pass_beyond != "shared" or self.shared_span_most < self.block)):
            raise ValueError(f"shared_span_most must be 0 or at least a block ({self.block}) and "
                             f"needs one_pass_beyond='shared', got {self.shared_span_most}")
        if self.pass_focus is not None and (self.pass_focus < 0 or not self.one_pass):
            raise ValueError(f"pass_focus must be >= 0 and needs one_pass, got {self.pass_focus}")
        if self.pass_sinks < 0:
            raise ValueError(f"pass_sinks must be >= 0, got {self.pass_sinks}")
        if self.one_pass and self.tristate.enabled:
            raise ValueError(ONE_PASS_NOT_TRISTATE)
        if self.positions == "compact" and self.cannot_compact:
            raise ValueError(f"compact positions work with token eviction only: "
                             f"{self.cannot_compact} (--positions auto falls back to original)")


@dataclass(frozen=True)
class RoutingConfig:
    """How a question picks the episode it is answered from (`pipeline.routers`). Not in the
    build's hash: it decides which cache is read, not what a cache holds. The defaults are
    measured on LoCoMo 26, 30 and 41 and checked on 42, 43 and 44 (docs/quality.md): the
    nearest window's episode, and the best two episodes read together when their scores are
    within 0.02 (about one question in six, about 1.1x the bytes read)."""
    router: str = "window"  # a name in pipeline.config.registry.ROUTERS
    two_below: float = 0.02  # read the best two episodes when their scores differ less; 0: never

    def __post_init__(self):
        if self.router not in ROUTERS:
            raise ValueError(f"router must be one of {tuple(ROUTERS)}, got {self.router!r}")
        if self.two_below < 0:
            raise ValueError(f"two_below must be >= 0, got {self.two_below}")


@dataclass(frozen=True)
class TopUpConfig:
    """The question-time top-up (`pipeline.answer.topup`): after routing, the question's
    nearest turns in the whole conversation (its turn index, stored beside the manifest) are
    prefilled after the cache, right before the question. It answers what the routed episode
    lacks (a misrouted question's evidence) from outside the episode's budget, and puts the
    evidence the cache holds far back next to the question. Not in the build's hash: every
    build stores the turn index; this decides what a question reads. On by default, nothing
    skipped, with 8 turns and 256 tokens: on the whole LoCoMo conversations (oracle-window
    reference) it answers better than 4 turns and 128 tokens at equal decode-time entries, on
    the tuning set (26, 30, 41) and on the untouched ones measured (docs/quality.md, "At full
    length: the larger top-up"); the smaller top-up was chosen on the 7,600-token cuts."""
    enabled: bool = True
    # the question's nearest turns searched; None: every turn, nearest first, as many as
    # `max_tokens` holds (retrieval sized by its tokens: `rag` at a row's decode-time entries)
    turns: int | None = 8
    max_tokens: int = 256  # the top-up's tokens at most (turns past it are left out)
    # only the turns nearer the question than every turn the episodes read hold: a question
    # whose episode holds its nearest turn (routed right, most likely) reads no top-up
    nearer_than_held: bool = False
    # skip the nearest turns the episodes read hold (their windows): the top-up then only adds
    # what the episodes lack (a question routed right reads little); off, the default, every
    # question reads its nearest turns right before it, whatever its cache holds
    skip_held: bool = False
    # each top-up turn read once, as the text next to the question: the entries the cache(s)
    # read hold of the top-up's turns are hidden for that question (a far, compacted copy of
    # the same words otherwise competes with the text for attention; the stored cache is
    # unchanged). Needs the turns' token spans, which turn indexes hold from format 2 on.
    read_once: bool = False

    def __post_init__(self):
        if self.nearer_than_held and not self.skip_held:
            raise ValueError("nearer_than_held compares with the turns skipped: it needs skip_held")
        if self.turns is not None and self.turns < 1:
            raise ValueError(f"turns must be >= 1, got {self.turns}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")


@dataclass(frozen=True)
class GrowthConfig:
    """When a conversation that gained turns since its build is appended to (the new turns
    block-prefilled into each episode's stored cache) and when it is re-clustered and rebuilt.
    Not in the build's hash: it decides how new turns arrive, not what a cache is built with;
    the manifest records when each conversation was last clustered and how many appends
    followed. The similarity default is measured on LoCoMo 26, 30 and 41 (docs/building.md)."""
    append: bool = True  # False: a grown conversation is rebuilt from its first turn
    # re-cluster once the conversation holds more than this many times the turns it had when
    # it was last clustered (its episodes were drawn from too little of it)
    max_growth: float = 2.0
    # a new window is far from the episodes when its best cosine to their centroids is below
    # `far_similarity` (0.65: the 1st percentile of windows' cosine to their own episode's
    # centroid); re-cluster when more than `far_share` of the new windows are
    far_similarity: float = 0.65
    far_share: float = 0.5

    def __post_init__(self):
        if not self.max_growth >= 1:
            raise ValueError(f"max_growth must be at least 1, got {self.max_growth}")
        if not -1 <= self.far_similarity <= 1:
            raise ValueError(f"far_similarity must be in [-1, 1], got {self.far_similarity}")
        if not 0 <= self.far_share <= 1:
            raise ValueError(f"far_share must be in [0, 1], got {self.far_share}")


@dataclass(frozen=True)
class CalibrationConfig:
    tokens: int = 4096  # length of the calibration text
    sink: int = 128  # tokens every query may always see
    window: int = 1024  # the simulated budget: sink + most recent tokens
    seed: int = 0  # the synthetic calibration text's seed

    def as_dict(self) -> dict:
        return asdict(self)
