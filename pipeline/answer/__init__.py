"""Answering: from a question to an answer decoded from its episode's cache.

    lookup.py         the manifest, the model check and the route to the nearest episode
    topup.py          the question-time top-up: its nearest turns, from the turn index
    fetch.py          the read path: the verified cache the store hands over, through the LRU
    lru.py            CacheLRU: loaded caches under a byte budget
    decode.py         one answer decoded from one cache; AnswerPieces for a streamed one
    answerer.py       Answerer: all of the above in one process
    packed.py         several caches' rows packed into one decode step (DecodeRow, packed_step)
    batcher.py        DecodeBatcher: continuous batching on two threads (prefill, decode)
    malloc_tuning.py  glibc malloc thresholds so freed cache memory is reused, not returned

The limits on one answer (AnswerLimits, torch-free) are in pipeline.config.limits.
"""
