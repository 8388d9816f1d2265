"""Commands: `python -m jobs.<name>` (or `epicache <name>`), each parsing arguments and wiring
library stages; benchmarks are under `jobs/bench/`. Nothing imports from a command."""
