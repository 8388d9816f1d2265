"""The KV method: models, the episodic cache, and block prefill under a budget.

    models.py     the model and encoder registry (packaged or local; GGUF converted once)
    errors.py     ModelNotFoundError, importable without torch
    prompts.py    token ids of the context, a patched prompt and a question (the chat template)
    layout.py     where each turn's tokens sit in the rendered conversation
    attention.py  the episodic attention function (transformers' AttentionInterface)
    cache.py      EpisodicCache: a transformers Cache with per-head validity and positions
    positions.py  original or compact positions (keys re-rotated after eviction)
    scorers.py    what decides which entries stay: one small class per method
    budgets.py    layer budgets: sensitivity (EpiCache) and variance (D2O) allocators
    eviction.py   the eviction strategy interface and top-k eviction
    tristate.py   ARKV's Original / Quantized / Evicted strategy
    merging.py    D2O's merging of evicted entries into kept ones
    prefill.py    block_prefill: the loop that runs blocks, scores and evicts

The loop knows no method by name: scorers and eviction strategies are swapped behind it.
"""
