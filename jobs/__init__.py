"""Entry points: `python -m jobs.<name>`; each parses arguments and wires pipeline stages."""
