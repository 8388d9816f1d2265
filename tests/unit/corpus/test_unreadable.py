"""A corpus that cannot be read is one `CorpusError` line naming the path, never a traceback:
a folder named like a corpus file, a file that cannot be opened, a folder that cannot be listed."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipeline.corpus.reader import read_corpus, write_jsonl
from pipeline.corpus.schema import CorpusError
from pipeline.corpus.synthetic import make_corpus


@pytest.fixture
def corpus_dir(tmp_path) -> Path:
    write_jsonl(make_corpus(1, 300, 0), tmp_path / "a.jsonl")
    return tmp_path


def test_a_folder_named_like_a_corpus_file_is_named(corpus_dir):
    (corpus_dir / "b.jsonl").mkdir()
    with pytest.raises(CorpusError, match=r"b\.jsonl: a folder named like a corpus file"):
        read_corpus(corpus_dir)


def test_a_file_that_cannot_be_opened_is_named(corpus_dir, monkeypatch):
    # root reads any file whatever its mode, so the refusal is the kernel's error, raised here
    def refused(self, *args, **kwargs):
        raise PermissionError(13, "Permission denied", str(self))
    monkeypatch.setattr(Path, "open", refused)
    with pytest.raises(CorpusError, match=r"a\.jsonl: cannot be read \(Permission denied\)"):
        read_corpus(corpus_dir / "a.jsonl")


def test_a_folder_that_cannot_be_listed_is_named(corpus_dir, monkeypatch):
    def refused(self):
        raise PermissionError(13, "Permission denied", str(self))
    monkeypatch.setattr(Path, "iterdir", refused)
    with pytest.raises(CorpusError, match=r"cannot be listed \(Permission denied\)"):
        read_corpus(corpus_dir)
