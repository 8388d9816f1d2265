"""Write a synthetic corpus as JSONL: `python -m jobs.make_corpus --out corpus.jsonl
--conversations 8 --target-tokens 8000 --seed 0 [--topics 4]`.

The corpus has known topics and planted facts with questions (see pipeline/corpus/synthetic.py), so
builds, benchmarks and evaluations can run at any scale without a real data set.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path

from pipeline.cli.numbers import number, positive_int
from pipeline.cli.parser import make_parser
from pipeline.corpus.reader import write_jsonl
from pipeline.corpus.render import render_conversation
from pipeline.corpus.schema import Conversation
from pipeline.corpus.synthetic import TOPICS, estimate_tokens, iter_corpus

# The sizes accepted (larger: an argument error at once): a conversation far past any model's
# positions, and a corpus past the 1,000,000 conversations the scale rehearsal runs.
MAX_TARGET_TOKENS = 1_000_000
MAX_CONVERSATIONS = 10_000_000


def build_parser() -> argparse.ArgumentParser:
    p = make_parser("jobs.make_corpus", __doc__)
    p.add_argument("--out", type=Path, required=True, help="the JSONL file to write")
    p.add_argument("--conversations", type=number(int, at_least=1, at_most=MAX_CONVERSATIONS),
                   required=True, metavar="N",
                   help=f"how many conversations, at most {MAX_CONVERSATIONS:,}")
    p.add_argument("--target-tokens", type=number(int, at_least=1, at_most=MAX_TARGET_TOKENS),
                   required=True, metavar="T",
                   help="length of each conversation, in estimated tokens (chars/4), at most "
                        f"{MAX_TARGET_TOKENS:,}")
    p.add_argument("--seed", type=int, default=0, metavar="S",
                   help="the same seed always writes the same corpus")
    p.add_argument("--topics", type=positive_int, default=4, metavar="K",
                   help=f"topics per conversation, 1-{len(TOPICS)}")
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.topics > len(TOPICS):
        parser.error(f"--topics must be between 1 and {len(TOPICS)}")

    totals = {"conversations": 0, "tokens": 0, "questions": 0}

    def counted(conversations: Iterable[Conversation]) -> Iterator[Conversation]:
        for c in conversations:  # streamed to the file as made: memory of one conversation
            totals["conversations"] += 1
            totals["tokens"] += estimate_tokens(render_conversation(c).text)
            totals["questions"] += len(c.questions)
            yield c

    try:  # whole or not at all: a full disk leaves no half-written corpus
        args.out.parent.mkdir(parents=True, exist_ok=True)
        write_jsonl(counted(iter_corpus(args.conversations, args.target_tokens, args.seed,
                                        args.topics)), args.out)
    except OSError as e:
        where = f" ({e.filename})" if e.filename and str(e.filename) != str(args.out) else ""
        print(f"error: cannot write {args.out}: {e.strerror or e}{where}", file=sys.stderr)
        return 2

    print(f"wrote {totals['conversations']} conversations to {args.out}: "
          f"~{totals['tokens'] // totals['conversations']} tokens each (estimated, chars/4), "
          f"{args.topics} topics each, {totals['questions']} questions")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
