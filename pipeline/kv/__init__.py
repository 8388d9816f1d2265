"""The KV method: models, the episodic cache, and block prefill under a budget.

    models.py     the model and encoder registry (packaged or local; GGUF converted once)
    errors.py     ModelNotFoundError, importable without torch
    fingerprint.py  fingerprints of model folders: which weights a cache was built with
    prompts.py    token ids of the context, a patched prompt and a question (the chat template)
    layout.py     where each turn's tokens sit in the rendered conversation
    attention.py  the episodic attention function (transformers' AttentionInterface)
    cache.py      EpisodicCache: a transformers Cache with per-head validity and positions
    methods/      the compression methods, one module each, and their registry: what
                  decides which entries stay
    budgets.py    layer budgets: sensitivity (EpiCache) and variance (D2O) allocators
    eviction.py   the Compression interface (how a layer is cut, where a patch sits, what
                  follows a cut), its wrappers' base, and top-k eviction
    tristate.py   ARKV's Original / Quantized / Evicted eviction
    merging.py    D2O's merging of evicted entries into kept ones (a wrapper)
    positions.py  original or compact positions (a wrapper re-rotates kept keys), DapQ's
                  decode positions (a wrapper)
    compression.py  a PrefillConfig composed into those strategies, in one place
    prefill.py    block_prefill: the loop that runs blocks, scores and evicts
    one_pass.py   one_pass_prefill: every episode of a conversation from one layer-by-layer
                  pass, each layer cut as block prefill cuts it
    shared_spans.py  one pass past the model's positions: each span read once over the
                  episodes' caches joined, then taken by each episode as a block

The loop knows no method and no strategy by name: both are swapped behind it.
"""
