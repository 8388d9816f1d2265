"""The lab: what the benchmarks, the screen, the demo and the tests run the library with. A user
of the library never calls it; `pipeline/` is the product, and nothing there imports this
package (it sits above `pipeline.cli`, below the commands).

    bench_cli.py      the benchmarks' common opening: their parser, `--threads`, `--corpus`
    bench_support.py  what the build benchmarks measure with: an exact-length synthetic
                      conversation, a model cut to its first layers, a stock full prefill
    tables.py         fixed-width tables, as the benchmarks print them
    routing_rules.py  routing rules scored from reads made once, two oracles among them
                      (`jobs.bench.routing`)
    command_steps.py  commands run as a report's steps (`jobs.bench.gpu`)
    load_client.py    the load-test client the serving benchmarks share: a timed request, the
                      fault run's rule
    rehearsal.py      synthetic stages, corpora and caches with no model (the scale rehearsal
                      and the tests), and an S3 request counter
    synthetic_manifests.py  a read-only store of synthetic manifests made on demand (the
                      router's soak, `jobs.bench.router_soak`, and the plan's tests)
    seaweedfs.py      a local S3 server (SeaweedFS) for trying the S3 path and for the tests
    screen.py         a fast one-prefill proxy for ranking EpiCache recipes (`jobs.screen`)
    compare.py        the demo's comparison: episodic against full-history answers (`jobs.demo`)

The benchmarks themselves are commands, in `jobs/bench/` (docs/benchmarks.md).
"""
