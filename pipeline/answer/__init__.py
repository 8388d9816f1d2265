"""Answering: from a question to an answer decoded from its episode's cache.

    lookup.py         the manifest, the model check and the route to the nearest episode
    topup.py          the question-time top-up: its nearest turns, from the turn index
    plan.py           QuestionPlanner: manifest, embed, route, top-up, the one plan step of
                      the Answerer and the Serve router (the one cache of manifests, an LRU
                      bounded in bytes, their embeddings as numpy arrays)
    fetch.py          the cache a question reads through the LRU (the store verifies the read)
    lru.py            CacheLRU: loaded caches (or kept manifests) under a byte budget
    decode.py         one answer decoded from one cache, after its top-up and live tail;
                      AnswerPieces for a streamed one; the teacher-forced NLL of an answer
    answerer.py       Answerer: plan, load and decode in one process
    packed.py         several caches' rows packed into one decode step (DecodeRow, packed_step)
    batcher.py        DecodeBatcher: continuous batching on two threads (prefill, decode)

The limits on one answer (AnswerLimits, torch-free) are in pipeline.config.limits: checked once
at each entry (`Answerer.answer`, `jobs.answer`'s arguments, the server's request body), trusted
past it.
"""
