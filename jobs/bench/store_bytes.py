"""Bytes a conversation's caches take in the store, per object format, and what reading them costs.

    python -m jobs.bench.store_bytes --corpus ../shared/data/locomo --conversations 30 \\
        [--max-context-tokens 7600] [--budget 1024] [--threads 2]

Builds the conversation as `jobs.build` does (the default method, in memory), then writes each
episode's cache in every object format side by side in one run: float16 (the default) and the
low-bit codes (`BuildConfig.code`: 8 to 2 bits, KIVI's groups of 32; and the codes measured
since, in groups of 64 with each head's first 4 and last 16 entries as floats, the values at 4 or 2
bits, the keys turned, with those floats or the first 4 alone ("sinks"), coded per channel or per
token, or at 3 bits with the values at 5, each group's step and minimum at 16 or 8 bits (QLoRA's
double quantization); and nine of them compressed as the store writes them with `code.zstd`).
Per format: the conversation's bytes and their ratio to float16, the object compressed
losslessly (zstd at levels 1 and 3, lz4: pyarrow's codecs) as a share of itself, and the seconds
to write (encode) and to parse (decode) one episode, against float16's. Quality at these bytes is
the scorecard's (docs/scorecard-bytes.md, docs/scorecard-turned.md); this is the bytes and the
read path's cost.
"""

from __future__ import annotations

import argparse
import sys
import time

import pyarrow as pa

from lab.bench_cli import bench_conversations, bench_parser, start_bench
from pipeline.builder.conversation import build_conversation
from pipeline.builder.episode import build_episode_caches
from pipeline.cli.options import add_budget_option, add_threads_option
from pipeline.config import BuildConfig, CodeConfig
from pipeline.config.stages import CODE_BITS
from pipeline.eval.window import CUT_TOKENS
from pipeline.store.backends.memory import MemoryStore
from pipeline.store.objects import cache_format

FLOATS = {"group": 64, "float_sinks": 4, "float_recent": 16}
SINKS = {"group": 64, "float_sinks": 4}
FORMATS = (("float16", CodeConfig()),
           *((f"int{bits}", CodeConfig(bits=bits)) for bits in sorted(CODE_BITS, reverse=True)),
           ("int4 g64 floats", CodeConfig(bits=4, **FLOATS)),
           ("k4 v2 g64 floats", CodeConfig(bits=4, value_bits=2, **FLOATS)),
           ("int4 g64 floats turned", CodeConfig(bits=4, rotate=True, **FLOATS)),
           ("int4 g64 sinks turned", CodeConfig(bits=4, rotate=True, **SINKS)),
           ("int4 g64 sinks turned per token", CodeConfig(bits=4, rotate=True, key_axis="token",
                                                          **SINKS)),
           ("k3 v5 g64 sinks turned", CodeConfig(bits=3, value_bits=5, rotate=True, **SINKS)),
           ("k3 v5 g64 sinks turned scales 8-bit",
            CodeConfig(bits=3, value_bits=5, rotate=True, double_quant=True, **SINKS)),
           # the objects as the store holds them compressed (`code.zstd`), read back through it
           ("float16 zstd1", CodeConfig(zstd=1)),
           ("int4 g64 floats zstd3", CodeConfig(bits=4, zstd=3, **FLOATS)),
           ("k4 v2 g64 floats zstd3", CodeConfig(bits=4, value_bits=2, zstd=3, **FLOATS)),
           ("int4 g64 floats turned zstd3", CodeConfig(bits=4, rotate=True, zstd=3, **FLOATS)),
           ("int4 g64 sinks turned zstd3", CodeConfig(bits=4, rotate=True, zstd=3, **SINKS)),
           ("int4 g64 sinks turned per token zstd3",
            CodeConfig(bits=4, rotate=True, key_axis="token", zstd=3, **SINKS)),
           ("k3 v5 g64 sinks turned zstd3",
            CodeConfig(bits=3, value_bits=5, rotate=True, zstd=3, **SINKS)),
           ("int4 g64 sinks turned scales 8-bit zstd3",
            CodeConfig(bits=4, rotate=True, double_quant=True, zstd=3, **SINKS)),
           ("k3 v5 g64 sinks turned scales 8-bit zstd3",
            CodeConfig(bits=3, value_bits=5, rotate=True, double_quant=True, zstd=3, **SINKS)))
CODECS = (("zstd1", "zstd", 1), ("zstd3", "zstd", 3), ("lz4", "lz4", None))


def measure(conv, config: BuildConfig) -> list[dict]:
    """One row per format: the conversation's episodes written in it, compressed, read back."""
    store = MemoryStore(f"bench-{conv.conversation_id}")
    try:
        built = build_conversation(conv, config, store, prefill=build_episode_caches).built
    finally:
        store.drop()
    caches = [b.cache for b in built]
    rows = []
    for name, code in FORMATS:
        start = time.perf_counter()
        objects = [cache_format.serialize(c, {}, code=code) for c in caches]
        encode = (time.perf_counter() - start) / len(objects)
        start = time.perf_counter()
        for data in objects:
            cache_format.parse(data)
        decode = (time.perf_counter() - start) / len(objects)
        size = sum(len(d) for d in objects)
        row = {"conversation": conv.conversation_id, "format": name, "bytes": size,
               "encode_s": encode, "decode_s": decode, "entries": caches[0].entries_per_layer()[0]}
        for label, codec, level in CODECS:
            packer = pa.Codec(codec, compression_level=level) if level else pa.Codec(codec)
            row[label] = sum(len(packer.compress(d, asbytes=True)) for d in objects) / size
        rows.append(row)
        print(row, file=sys.stderr, flush=True)
    return rows


def build_parser() -> argparse.ArgumentParser:
    p = bench_parser("store_bytes", __doc__, conversations="30")
    p.add_argument("--max-context-tokens", type=int, default=CUT_TOKENS,
                   help="cut each conversation at a session boundary (0: whole)")
    add_budget_option(p, BuildConfig().budget)
    add_threads_option(p)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    a = start_bench(parser, argv)
    config = BuildConfig(budget=a.budget, max_context_tokens=a.max_context_tokens or None)
    rows = [row for conv in bench_conversations(parser, a) for row in measure(conv, config)]
    print(f"\nbudget {a.budget}; bytes of all the conversation's episodes; lossless: the "
          "compressed object's share of itself; seconds per episode\n")
    print("| conversation | format | MiB | x float16 | zstd1 | zstd3 | lz4 | encode s | "
          "decode s | decode x float16 |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        base = next(b for b in rows if b["conversation"] == r["conversation"]
                    and b["format"] == "float16")
        print(f"| {r['conversation']} | {r['format']} | {r['bytes'] / 2 ** 20:.1f} | "
              f"{r['bytes'] / base['bytes']:.3f} | {r['zstd1']:.3f} | {r['zstd3']:.3f} | "
              f"{r['lz4']:.3f} | {r['encode_s']:.3f} | {r['decode_s']:.3f} | "
              f"{r['decode_s'] / base['decode_s']:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
