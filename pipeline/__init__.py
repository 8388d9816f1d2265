"""The library of episodic KV caches for long conversations (EpiCache), one subsystem a package.

Offline, a corpus is turned into a few small, topic-specific caches per conversation; online, a
question is routed to its episode's cache and decoded from it. Data flows down this list, and a
package imports only from packages above it:

    config/        the configurations, without torch: every stage's, the build's (hashed into
                   the manifests), the answer's limits
    corpus/        conversations as data: the JSONL schema, LoCoMo, streaming reads, rendering
    kv/            the KV method: models, the episodic cache, scorers, budgets, block prefill
    episodes.py    conversations clustered into episodes; a question routed to one
    routers.py     the routing strategies: which episode(s) a question's embedding reads
    store/         where caches live: local and S3 backends, the cache format, the manifests
                   and the manifest table
    builder/       the build: per-conversation and per-episode stages, and their Ray driver
    answer/        answering: routing, the read path, decoding, continuous batching
    eval/          evaluation: methods and variants, retention on LoCoMo
    serve/         the Ray Serve endpoint over answer/
    cli/           the command line's shared parser and options
    ray_runtime.py the Ray worker environment and joining or starting Ray
    telemetry.py   the metrics the Serve replicas and the build driver export through Ray
    allocator.py   glibc's allocator: freed memory kept by a server, handed back by a build

`jobs/` holds the commands that wire these together; `kernels/` the Triton kernels; `lab/`
what the benchmarks, the screen, the demo and the tests run the library with (no part of it).
"""
