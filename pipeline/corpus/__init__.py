"""The corpus: conversations as data, read, validated and rendered.

    schema.py     Turn, Question, Conversation; CorpusError; check_safe_id (ids become keys)
    records.py    the project's JSONL schema: parse_record, CorpusLimits
    locomo.py     the LoCoMo reader: parse_locomo
    reader.py     reading a corpus lazily: CorpusObject, iter_corpus, CorpusStream, check_corpus,
                  skip mode (Skip, ReadStats), select_conversations, write_jsonl
    render.py     the text the model reads: render_turns, render_conversation, cut_at_session
    history.py    what a build covered of a record (turns_digest) and how a record differs from it
    synthetic.py  deterministic synthetic conversations with planted facts (data/synthetic.json)

The JSONL schema is documented in docs/corpus.md.
"""
