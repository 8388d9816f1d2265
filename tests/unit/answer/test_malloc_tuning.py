"""`retain_freed_memory`: the memory of a dropped cache is reused by the next load instead of
being handed back to the kernel and faulted in again. Each case runs in its own process (the
setting is process-wide)."""

from __future__ import annotations

import platform
import resource
import subprocess
import sys

import pytest

from tests.support.paths import REPO as ROOT

# Parse a small and a large cache object (8 layers; 3 heads of ~1,000 and of 7,000 entries)
# in turn, six times, as a replica answering about several conversations does; print the page
# faults the parses took after the first round.
SCRIPT = """
import json, resource, sys
import torch
from safetensors.torch import save
from pipeline.store.objects import cache_format as cache_io
from pipeline.answer.malloc_tuning import retain_freed_memory
if sys.argv[1] == "retain":
    assert retain_freed_memory()
else:  # glibc's initial thresholds, pinned
    assert retain_freed_memory(mmap_threshold=128 << 10, trim_threshold=128 << 10)
def cache_object(counts, layers=8, dim=64):
    tensors = {}
    for i in range(layers):
        n = sum(counts)
        tensors[f"layers.{i}.keys"] = torch.randn(n, dim).half()
        tensors[f"layers.{i}.values"] = torch.randn(n, dim).half()
        tensors[f"layers.{i}.lengths"] = torch.tensor(counts, dtype=torch.int32)
        tensors[f"layers.{i}.positions"] = torch.cat([torch.arange(c) for c in counts])
    header = {"format": cache_io.FORMAT, "num_layers": layers, "tokens_seen": 7000,
              "next_position": 7000, "positions": "original"}
    return save(tensors, metadata={"header": json.dumps(header)})
objects = cache_object([1400, 700, 900]), cache_object([7000, 7000, 7000])
faults = 0
for round in range(6):
    for data in objects:
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        cache = cache_io.parse(data, "obj")
        faults += (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) * (round > 0)
        del cache
print(faults)
"""


def _faults(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", SCRIPT, mode], cwd=ROOT, capture_output=True,
                         text=True, timeout=120, check=True)
    return int(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc",
                    reason="malloc thresholds are a glibc setting")
def test_freed_memory_is_reused_without_page_faults():
    returned, retained = _faults("return"), _faults("retain")
    # With glibc's initial thresholds pinned, the parses' memory goes back each round and is
    # faulted in again (~120 MiB of pages a round). Left at its defaults, glibc may raise them
    # after a large free, depending on the order of frees, so that baseline is not fixed.
    # Kept, the next round writes into the same pages.
    assert returned > 5 * (16 << 20) // resource.getpagesize(), returned
    assert retained < returned // 10, (retained, returned)


def test_elsewhere_it_is_a_no_op(monkeypatch):
    from pipeline.answer import malloc_tuning

    monkeypatch.setattr(malloc_tuning.platform, "libc_ver", lambda: ("musl", "1.2"))
    assert malloc_tuning.retain_freed_memory() is False
