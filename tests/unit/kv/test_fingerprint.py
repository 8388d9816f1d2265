"""Fingerprints of model folders: the same files give the same fingerprint wherever they lie;
other weights (anywhere in a tensor's sampled bytes), another tokenizer or config give another;
documentation does not count; a file rewritten in place is noticed by a long-lived process."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest
from safetensors.numpy import save_file

from pipeline.kv import fingerprint
from pipeline.kv.fingerprint import FingerprintError, compute_fingerprint, folder_fingerprint


def _model(folder, seed: int = 0, big: int = 0):
    """A model folder: two tensors (one of `big` floats when given), a config, a tokenizer."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    tensors = {"a.weight": rng.standard_normal((16, 8)).astype(np.float32),
               "b.weight": rng.standard_normal(big or 32).astype(np.float32)}
    save_file(tensors, str(folder / "model.safetensors"))
    (folder / "config.json").write_text('{"hidden_size": 8}')
    (folder / "tokenizer.json").write_text('{"vocab": {"a": 0, "b": 1}}')
    return folder


def test_same_files_anywhere_give_the_same_fingerprint(tmp_path):
    one = _model(tmp_path / "one")
    two = tmp_path / "elsewhere" / "two"
    shutil.copytree(one, two)
    (two / "README.md").write_text("docs do not change what the model computes")
    (two / ".cache").mkdir()
    (two / ".cache" / "lock").write_text("hidden files neither")
    assert folder_fingerprint(one) == folder_fingerprint(two) == compute_fingerprint(one)
    assert len(folder_fingerprint(one)) == fingerprint.FINGERPRINT_CHARS


@pytest.mark.parametrize("change", ["weights", "tokenizer", "config", "new file"])
def test_other_weights_tokenizer_or_config_give_another_fingerprint(tmp_path, change):
    folder = _model(tmp_path / "m")
    before = compute_fingerprint(folder)
    if change == "weights":
        _model(folder, seed=1)  # a fine-tune: same names, shapes and sizes, other values
    elif change == "tokenizer":
        (folder / "tokenizer.json").write_text('{"vocab": {"a": 1, "b": 0}}')
    elif change == "config":
        (folder / "config.json").write_text('{"hidden_size": 8, "rope_theta": 1e6}')
    else:
        (folder / "chat_template.jinja").write_text("{{ messages }}")
    assert compute_fingerprint(folder) != before


def test_a_large_tensor_is_sampled_at_start_middle_and_end(tmp_path):
    """A tensor larger than three samples is read in three places, not whole: a change there is
    seen, a change between them is not (the price of not reading GBs)."""
    n = 64 * 1024  # 256 KiB of float32
    folder = _model(tmp_path / "m", big=n)
    before = compute_fingerprint(folder)
    path = folder / "model.safetensors"
    data = bytearray(path.read_bytes())
    header = 8 + int.from_bytes(data[:8], "little")
    begin, end = json.loads(data[8:header])["b.weight"]["data_offsets"]
    middle = header + (begin + end) // 2
    quarter = header + begin + (end - begin) // 4
    for offset, seen in ((middle, True), (quarter, False), (header + end - 1, True)):
        changed = bytearray(data)
        changed[offset] ^= 0xFF
        path.write_bytes(bytes(changed))
        assert (compute_fingerprint(folder) != before) is seen, offset
    path.write_bytes(bytes(data))
    assert compute_fingerprint(folder) == before


def test_other_large_files_are_sampled_in_blocks(tmp_path, monkeypatch):
    monkeypatch.setattr(fingerprint, "WHOLE_FILE_BYTES", 1024)
    monkeypatch.setattr(fingerprint, "BLOCK_BYTES", 256)
    monkeypatch.setattr(fingerprint, "SAMPLED_BLOCKS", 4)
    folder = tmp_path / "m"
    folder.mkdir()
    blob = bytearray(os.urandom(64 * 1024))
    (folder / "model.gguf").write_bytes(bytes(blob))
    before = compute_fingerprint(folder)
    blob[0] ^= 1  # the first block is always read
    (folder / "model.gguf").write_bytes(bytes(blob))
    assert compute_fingerprint(folder) != before
    (folder / "model.gguf").write_bytes(bytes(blob) + b"x")  # the size counts
    assert compute_fingerprint(folder) != before


def test_a_file_rewritten_in_place_is_noticed_by_a_running_process(tmp_path):
    folder = _model(tmp_path / "m")
    first = folder_fingerprint(folder)
    assert folder_fingerprint(folder) == first  # cached: same sizes, times, inodes
    _model(folder, seed=7)
    assert folder_fingerprint(folder) != first


def test_an_empty_or_missing_folder_is_a_clear_error(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(FingerprintError, match="holds no files"):
        folder_fingerprint(tmp_path / "empty")
    with pytest.raises(FingerprintError, match="is not a folder"):
        folder_fingerprint(tmp_path / "missing")


def test_the_tokenizer_and_positions_are_read_again_when_the_files_change(tmp_path):
    """Not only the model: a process counting tokens (the build's driver) sees new files too."""
    from pipeline.kv import models
    from tests.support.model_folders import make_llm_folder

    folder = str(make_llm_folder(tmp_path / "llm"))
    first = models.load_tokenizer(folder)
    assert models.load_tokenizer(folder) is first and models.max_positions(folder) == 8192
    config = json.loads((tmp_path / "llm" / "config.json").read_text())
    (tmp_path / "llm" / "config.json").write_text(json.dumps(
        config | {"max_position_embeddings": 4096}))
    assert models.load_tokenizer(folder) is not first and models.max_positions(folder) == 4096
