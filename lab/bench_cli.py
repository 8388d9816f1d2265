"""The benchmarks' common opening (`jobs/bench/`): each one's parser, its arguments read with
torch's threads pinned, and the conversations it reads from a corpus, written once here rather
than at the top of every benchmark's `main`.

torch is imported only where `--threads` is given, so a benchmark without the option
(`jobs.bench.serve`, an HTTP client; the scale rehearsal) does not load it.
"""

from __future__ import annotations

import argparse

from pipeline.cli.parser import make_parser
from pipeline.corpus.reader import iter_corpus, select_conversations
from pipeline.corpus.schema import Conversation, CorpusError


def bench_parser(name: str, doc: str, conversations: str | None = None) -> argparse.ArgumentParser:
    """The parser of `python -m jobs.bench.<name>`; given `conversations` (the default ids), it
    opens with the `--corpus` and `--conversations` of a benchmark that reads LoCoMo."""
    p = make_parser(f"jobs.bench.{name}", doc)
    if conversations is not None:
        p.add_argument("--corpus", required=True, help="LoCoMo folder or file (or project JSONL)")
        p.add_argument("--conversations", default=conversations,
                       help="conversation ids, comma-separated (matches locomo-<id>)")
    return p


def start_bench(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """The arguments, with torch's threads set to `--threads` where the benchmark has the option
    and it is given: pinned threads give steadier timings on a busy machine."""
    args = parser.parse_args(argv)
    if getattr(args, "threads", None):
        import torch  # only here: a benchmark without --threads need not load torch

        torch.set_num_threads(args.threads)
    return args


def bench_conversations(parser: argparse.ArgumentParser,
                        args: argparse.Namespace) -> list[Conversation]:
    """The `--conversations` of `--corpus`; a corpus that cannot be read, or an id it lacks,
    ends the command as a bad argument does (`error: ...` on stderr, exit status 2)."""
    try:
        return select_conversations(iter_corpus(args.corpus), args.conversations, args.corpus)
    except CorpusError as e:
        parser.exit(2, f"error: {e}\n")
