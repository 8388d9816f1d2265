"""Answering: from a question to an answer decoded from its episode's cache.

    limits.py         AnswerLimits: question, answer length, temperature, positions (torch-free)
    lookup.py         the manifest, the model check and the route to the nearest episode
    fetch.py          the read path: disk tier or store, SHA-256 checked while parsed
    lru.py            CacheLRU: loaded caches under a byte budget
    decode.py         one answer decoded from one cache (whole, or streamed in pieces)
    answerer.py       Answerer: all of the above in one process
    packed.py         several caches' rows packed into one decode step (DecodeRow, packed_step)
    batcher.py        DecodeBatcher: continuous batching on two threads (prefill, decode)
    malloc_tuning.py  glibc malloc thresholds so freed cache memory is reused, not returned
"""
