"""Benchmarks: `python -m jobs.bench.<name>`, each printing ratios measured side by side in one
run. Nothing imports from them; what they share lives in the library (docs/benchmarks.md).
"""
