"""Fingerprints of model folders: which weights and tokenizer a cache was built with.

A cache holds keys and values only the weights that computed them can use: a fine-tune, a
re-quantisation or a new revision under the same name or folder changes them all. So a build
records the fingerprint of the model's files, and a reader refuses a cache whose fingerprint is
not the loaded model's. The fingerprint is a SHA-256 over the folder's files, by their paths
inside the folder (the same files copied to another node or path give the same fingerprint),
and cheap (GBs of weights are sampled, not read):

- a safetensors file: its size, its JSON header (tensor names, dtypes, shapes, offsets) and a
  few KiB at the start, middle and end of every tensor's data: a fine-tune or re-quantisation
  rewrites every element of the tensors it touches, so their sampled bytes change too;
- any other file over `WHOLE_FILE_BYTES` (a `.bin`, `.gguf`, ...): its size and
  `SAMPLED_BLOCKS` evenly spaced blocks;
- every other file (config, tokenizer, chat template, sentence-transformers modules): whole.

Hidden files and folders and documentation (`*.md`) are left out. Torch-free: the standard
library only. A fingerprint is computed once per process for a folder whose files keep their
size, times and inode (`os.stat`), and again when any of them changes.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import threading
from pathlib import Path

FINGERPRINT_CHARS = 16  # hex digits kept (64 bits: accidental equality is not a concern)
TENSOR_SAMPLE_BYTES = 4096  # read at the start, middle and end of each safetensors tensor
WHOLE_FILE_BYTES = 64 * 2**20  # other files up to this size are hashed whole
SAMPLED_BLOCKS, BLOCK_BYTES = 64, 64 * 2**10  # larger ones: this many blocks of this size
_MAX_HEADER_BYTES = 100 * 2**20  # a safetensors header larger than this is not one

_lock = threading.Lock()
_known: dict[str, tuple[tuple, str]] = {}  # folder -> (stat signature, fingerprint)


class FingerprintError(OSError):
    """A model folder whose files cannot be read to fingerprint them; names the folder."""


def _files(folder: Path) -> list[tuple[str, Path]]:
    """(path inside the folder, path) of every file that identifies the model, sorted."""
    out = []
    for root, dirs, names in os.walk(folder, followlinks=True):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for name in names:
            if name.startswith(".") or name.lower().endswith(".md"):
                continue
            path = Path(root) / name
            out.append((path.relative_to(folder).as_posix(), path))
    return sorted(out)


def _signature(files: list[tuple[str, Path]]) -> tuple:
    """What changes when any file is replaced or rewritten: sizes, times, inodes."""
    stats = [(rel, os.stat(path)) for rel, path in files]
    return tuple((rel, s.st_size, s.st_mtime_ns, s.st_ctime_ns, s.st_ino) for rel, s in stats)


def _safetensors_header(f, size: int) -> tuple[bytes, dict] | None:
    """(raw header bytes, parsed header) of a safetensors file, or None if it is not one."""
    if size < 8:
        return None
    (length,) = struct.unpack("<Q", f.read(8))
    if length > min(size - 8, _MAX_HEADER_BYTES):
        return None
    raw = f.read(length)
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, ValueError):
        return None
    return (raw, header) if isinstance(header, dict) else None


def _sample(f, digest, start: int, end: int, block: int) -> None:
    """Feed the bytes at the start, middle and end of [start, end) (all of it when small)."""
    if end - start <= 3 * block:
        f.seek(start)
        digest.update(f.read(end - start))
        return
    for offset in (start, (start + end - block) // 2, end - block):
        f.seek(offset)
        digest.update(f.read(block))


def _digest_safetensors(f, digest, size: int, raw: bytes, header: dict) -> None:
    digest.update(raw)
    base = 8 + len(raw)
    for name in sorted(k for k in header if k != "__metadata__"):
        offsets = header[name].get("data_offsets") if isinstance(header[name], dict) else None
        if not (isinstance(offsets, list) and len(offsets) == 2):
            continue
        begin, end = (min(max(int(o), 0), size - base) for o in offsets)
        _sample(f, digest, base + begin, base + max(begin, end), TENSOR_SAMPLE_BYTES)


def _digest_file(path: Path, digest) -> None:
    size = path.stat().st_size
    digest.update(f"{size}\0".encode())
    with open(path, "rb") as f:
        if path.suffix == ".safetensors" and (parsed := _safetensors_header(f, size)):
            _digest_safetensors(f, digest, size, *parsed)
        elif size <= WHOLE_FILE_BYTES:
            f.seek(0)
            digest.update(f.read())
        else:
            step = (size - BLOCK_BYTES) / (SAMPLED_BLOCKS - 1)
            for i in range(SAMPLED_BLOCKS):
                f.seek(int(i * step))
                digest.update(f.read(BLOCK_BYTES))


def compute_fingerprint(folder: Path) -> str:
    """The fingerprint of a model folder's files, computed now (see the module docstring)."""
    digest = hashlib.sha256()
    files = _files(folder)
    if not files:
        raise FingerprintError(f"model folder {folder} holds no files to fingerprint")
    for rel, path in files:
        digest.update(f"{rel}\0".encode())
        _digest_file(path, digest)
    return digest.hexdigest()[:FINGERPRINT_CHARS]


def folder_fingerprint(folder: str | Path) -> str:
    """The fingerprint of a model folder: computed once, and again when any file changed."""
    folder = Path(folder).resolve()
    if not folder.is_dir():
        raise FingerprintError(f"model folder {folder} is not a folder (or does not exist)")
    try:
        files = _files(folder)
        signature = _signature(files)
        with _lock:
            known = _known.get(str(folder))
        if known is not None and known[0] == signature:
            return known[1]
        fingerprint = compute_fingerprint(folder)
    except OSError as e:
        if isinstance(e, FingerprintError):
            raise
        raise FingerprintError(f"cannot read model folder {folder} to fingerprint it: "
                               f"{e.strerror or e}") from None
    with _lock:
        _known[str(folder)] = (signature, fingerprint)
    return fingerprint
