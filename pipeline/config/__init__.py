"""The configurations, in one place and without torch: a command parses its options and checks
its input with these before torch, transformers or Ray load. Lowest in the layers: nothing here
imports another part of the pipeline.

    registry.py        the pluggable parts by name, one line each: the compression methods
                       (what each is and which sections it reads), the routers, the layer
                       allocators; readable before torch (nothing imported until used)
    stages.py          each stage's frozen dataclass (episodes, scoring, tri-state, merging,
                       stored codes, prefill, calibration, routing, top-up, growth), the default
                       models, the names of the layer allocators and routers
    build.py           BuildConfig (the stages nested, hashed into every manifest),
                       ModelFingerprints (the model files a build is bound to), DriverOptions
    hashing.py         what the build hash covers (what the method reads), and how earlier
                       builds' configurations read back (the compatibility rules: ADDED_LATER,
                       PREFILL_BEFORE, RETIRED, UNREAD_AS)
    format_version.py  the cache object format's versions (hashed; the store writes them)
    fields.py          fields by dotted path: type, value, a changed copy, text cast to a value
    limits.py          AnswerLimits: the bounds on one question and answer, wherever it is asked

The server's settings (`pipeline.serve.settings.ServeSettings`) stay with the server: they
resolve the S3 endpoint through the store, which sits above this package.
"""

from pipeline.config.build import STORE_DTYPES, BuildConfig, DriverOptions, ModelFingerprints
from pipeline.config.limits import AnswerLimits, LimitError
from pipeline.config.stages import (
    ALLOCATOR_NAMES,
    DEFAULT_ENCODER,
    DEFAULT_LLM,
    POSITION_MODES,
    ROUTER_NAMES,
    CalibrationConfig,
    CodeConfig,
    EpisodeConfig,
    GrowthConfig,
    MergeConfig,
    PositionMode,
    PrefillConfig,
    RoutingConfig,
    ScoringConfig,
    Selection,
    TopUpConfig,
    TriStateConfig,
)

__all__ = ["ALLOCATOR_NAMES", "DEFAULT_ENCODER", "DEFAULT_LLM", "POSITION_MODES", "ROUTER_NAMES",
           "STORE_DTYPES", "AnswerLimits", "BuildConfig", "CalibrationConfig", "CodeConfig",
           "DriverOptions", "EpisodeConfig", "GrowthConfig", "LimitError", "MergeConfig",
           "ModelFingerprints", "PositionMode", "PrefillConfig", "RoutingConfig",
           "ScoringConfig", "Selection", "TopUpConfig", "TriStateConfig"]
