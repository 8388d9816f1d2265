"""The embedded default, end to end: a synthetic corpus, a Ray build into a local store, answers.

    python -m jobs.demo [--out demo-out] [--conversations 2] [--target-tokens 3000]

Everything runs here: a local Ray, a local directory store, the packaged SmolLM2-135M-Instruct
and all-MiniLM-L6-v2. The budget is set below the conversations' length so eviction happens.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from jobs import build
from jobs.cli import make_parser
from pipeline.answer import Answerer
from pipeline.corpus import read_corpus, write_jsonl
from pipeline.store import open_store
from pipeline.synthetic import make_corpus


def build_parser() -> argparse.ArgumentParser:
    p = make_parser("jobs.demo", __doc__)
    p.add_argument("--out", default="demo-out", help="folder for the corpus and the store")
    p.add_argument("--conversations", type=int, default=2, help="synthetic conversations")
    p.add_argument("--target-tokens", type=int, default=3000,
                   help="length of each conversation (estimated tokens)")
    p.add_argument("--budget", type=int, default=512,
                   help="mean entries kept per layer and KV head")
    p.add_argument("--block", type=int, default=256, help="block-prefill block size (tokens)")
    p.add_argument("--questions", type=int, default=3, help="questions answered per conversation")
    return p


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    corpus, store = out / "corpus.jsonl", out / "store"
    write_jsonl(make_corpus(a.conversations, a.target_tokens, seed=0), corpus)
    print(f"corpus: {corpus} ({a.conversations} synthetic conversations of ~{a.target_tokens} tokens)")
    code = build.main(["--corpus", str(corpus), "--store", str(store), "--budget", str(a.budget),
                       "--block", str(a.block), "--medoids", "2", "--calibration-tokens", "2048",
                       "--calibration-window", "512"])
    if code != 0:
        return code
    answerer = Answerer(open_store(str(store)))
    conversations, _ = read_corpus(corpus)
    for conv in conversations:
        for q in conv.questions[:a.questions]:
            r = answerer.answer(conv.conversation_id, q.question, max_new_tokens=24)
            print(json.dumps({"conversation": conv.conversation_id, "question": q.question,
                              "gold": q.answer, "answer": r.answer, "episode": r.episode,
                              "similarity": round(r.similarity, 3), "timings_ms": r.timings_ms}))
    print(f"store: {store}  (answer more with: python -m jobs.answer --store {store} "
          f"--conversation {conversations[0].conversation_id} --question '...')")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
