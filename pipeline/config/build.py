"""The build configuration: one frozen object per stage, hashed into every manifest; the model
files' fingerprints it is bound to; and how a build runs on Ray (not hashed).

Two builds with the same hash produce the same caches, so a re-run skips conversations whose
manifest carries the current hash and rebuilds those that do not. What the hash covers (what
the build's method reads), and how earlier builds' configurations read back, is
`pipeline.config.hashing`.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field

from pipeline.config import hashing, registry
from pipeline.config.stages import (
    DEFAULT_ENCODER,
    DEFAULT_LLM,
    CalibrationConfig,
    CodeConfig,
    EpisodeConfig,
    GrowthConfig,
    PrefillConfig,
    ScoringConfig,
)

STORE_ELEMENT_BYTES = {"float16": 2, "bfloat16": 2, "float32": 4}
STORE_DTYPES = tuple(STORE_ELEMENT_BYTES)


@dataclass(frozen=True)
class BuildConfig:
    model: str = DEFAULT_LLM
    encoder: str = DEFAULT_ENCODER
    scorer: str = "epicache"  # a method's name in pipeline.config.registry.METHODS
    budget: int | None = 1024  # mean entries per layer and KV head; None = full cache
    # Sharpness of the sensitivity-aware layer allocation; 0 = uniform budgets, the default:
    # with SmolLM2 uniform budgets beat the allocation (docs/quality.md). The paper used ~1-2.
    alpha: float = 0.0
    allocator: str = "sensitivity"  # layer budgets: "sensitivity" (EpiCache) or "variance" (D2O)
    variance_temperature: float = 1.0  # D2O inverse-variance softmax temperature
    store_dtype: str = "float16"  # dtype of the stored keys and values
    code: CodeConfig = field(default_factory=CodeConfig)  # or their low-bit codes
    max_context_tokens: int | None = None  # cut conversations at a session boundary to fit
    episodes: EpisodeConfig = field(default_factory=EpisodeConfig)
    scoring: ScoringConfig = field(default_factory=ScoringConfig)  # EpiCache's scores
    prefill: PrefillConfig = field(default_factory=PrefillConfig)
    calibration: CalibrationConfig = field(default_factory=CalibrationConfig)

    def __post_init__(self):
        if self.budget is not None and self.budget < 1:
            raise ValueError(f"budget must be positive, got {self.budget}")
        if self.alpha < 0:
            raise ValueError(f"alpha must be non-negative, got {self.alpha}")
        if self.variance_temperature <= 0:
            raise ValueError(
                f"variance_temperature must be positive, got {self.variance_temperature}")
        if self.store_dtype not in STORE_DTYPES:
            raise ValueError(f"store_dtype must be one of {STORE_DTYPES}, got {self.store_dtype!r}")
        if self.prefill.pass_focus is not None and not (
                self.scoring.focus and registry.reads(self.scorer, "scoring.focus")):
            raise ValueError("prefill.pass_focus weights the episode's own turns in the one "
                             "pass's cut: it needs a method that focuses on them (epicache with "
                             f"scoring.focus > 0), not {self.scorer}")
        if self.code.bits and self.prefill.tristate.enabled:
            raise ValueError("a low-bit code (code.bits) codes every stored entry, tri-state "
                             "quantizes some of them: choose one")

    @property
    def entry_budget(self) -> int | None:
        """The entries a build keeps per layer and KV head: `budget`, or, where the code reads
        it as bytes (`code.bytes_budget`), as many entries as `budget` entries at the store
        dtype take: the code's float entries at that dtype, the rest coded."""
        if self.budget is None or not self.code.bytes_budget:
            return self.budget
        element = STORE_ELEMENT_BYTES[self.store_dtype]
        floats = min(self.code.float_sinks + self.code.float_recent, self.budget)
        return floats + int((self.budget - floats) * element / self.code.bytes_per_number)

    def as_dict(self) -> dict:
        """The configuration as hashed (`hashing.hashed_fields`)."""
        return hashing.hashed_fields(self)

    def to_json(self) -> str:
        """Every field as set: `from_json` gives this configuration back."""
        return json.dumps(hashing.stored_fields(self), sort_keys=True)

    @property
    def hash(self) -> str:
        return hashing.config_hash(self)

    @classmethod
    def from_json(cls, text: str) -> "BuildConfig":
        """A configuration `to_json` wrote, this build's or an earlier one's."""
        return cls(**hashing.stage_fields(json.loads(text)))

    def matches(self, stored_hash: str, stored_json: str | None) -> bool:
        """Whether a manifest's configuration (its `config_hash` and `config_json`) is this
        build (`hashing.is_current`): what the skip check asks of a stored conversation."""
        return hashing.is_current(self, stored_hash, stored_json)


@dataclass(frozen=True)
class ModelFingerprints:
    """The fingerprints of the model's and the encoder's files (`pipeline.kv.fingerprint`).
    `BuildConfig.hash` names the models, not their files: a stored conversation is current when
    its manifest carries both this configuration's hash and the fingerprints of the files the
    build runs with, so other weights or another tokenizer in the same folder rebuild it."""
    model: str
    encoder: str

    def bound_hash(self, config_hash: str) -> str:
        """The configuration hash bound to these files: the folder of the build's cache
        objects, so a rebuild with other files never overwrites objects still served."""
        text = f"{config_hash}:{self.model}:{self.encoder}"
        return hashlib.sha256(text.encode()).hexdigest()[:16]


@dataclass(frozen=True)
class DriverOptions:
    """How a build runs on Ray. Not hashed: none of it changes what a cache is built with."""
    force: bool = False  # rebuild conversations already built
    # the skip check also reads each built conversation's objects and checks their SHA-256
    # (it always confirms they exist at their recorded size); what fails is repaired
    verify: bool = False
    growth: GrowthConfig = field(default_factory=GrowthConfig)  # grown conversations
    max_in_flight: int = 16  # tasks submitted at most
    cpus_per_task: float = 1.0
    gpus_per_task: float | None = None  # None: 1 when the cluster has GPUs when the build starts
    max_retries: int = 2  # Ray retries per task on worker death
    progress: bool = True  # the driver's progress bar
    index_flush_rows: int = 10_000  # manifest-table rows appended per commit (or every minute)

    def __post_init__(self):
        if self.max_in_flight < 1 or self.max_retries < 0:
            raise ValueError("--max-in-flight must be at least 1 and --max-retries at least 0")
