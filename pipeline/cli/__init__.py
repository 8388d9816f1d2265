"""The command line's shared parts: one parser style and the options made from the configurations.

    parser.py   make_parser: `--help` shows every default
    options.py  the options made from the configurations' fields (build, driver, corpus,
                store, serve, benchmarks), each group added and read back in one place
    tables.py   fixed-width tables, as the benchmarks print them
"""
