"""The command line's shared parts: one parser style and the options made from the configurations.

    parser.py   make_parser: `--help` shows every default
    numbers.py  argparse types for numbers with a range (finite, at least / above a bound)
    options.py  the options made from the configurations' fields (build, driver, corpus,
                store, serve, benchmarks), each group added and read back in one place
    evaluation.py  what `jobs.evaluate` and `jobs.scorecard` share: options, checks, the run
"""
