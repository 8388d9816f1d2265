"""The command line's shared parts: one parser style and the options made from the configurations.

    parser.py   make_parser: `--help` shows every default
    options.py  the build, corpus and store options, added and read back in one place each
"""
