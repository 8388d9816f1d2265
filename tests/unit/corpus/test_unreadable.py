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


@pytest.mark.parametrize("name,first_line_only", [("corpus.txt", False), ("corpus.json", True)])
def test_jsonl_under_another_name_says_how_the_format_is_chosen(tmp_path, name, first_line_only):
    """JSONL saved as .txt (or piped on stdin), or one JSONL record saved as .json, is read as
    a LoCoMo document (the name decides): the error says so and how to name it, instead of a
    JSON parse error or a LoCoMo field that is missing."""
    jsonl = tmp_path / "c.jsonl"
    write_jsonl(make_corpus(2, 150, seed=3), jsonl)
    text = jsonl.read_text(encoding="utf-8")
    other = tmp_path / name
    other.write_text(text.splitlines(keepends=True)[0] if first_line_only else text,
                     encoding="utf-8")
    with pytest.raises(CorpusError) as e:
        read_corpus(other)
    message = str(e.value)
    assert message.startswith(f"{name}: ") and "a .jsonl file is the project's JSONL" in message
    assert "speaker_a" not in message
    assert len(read_corpus(jsonl)[0]) == 2  # the same lines named .jsonl read


def test_a_broken_json_document_is_not_called_jsonl(tmp_path):
    """A LoCoMo file that is simply broken keeps the plain parse error."""
    broken = tmp_path / "locomo.json"
    broken.write_text('{"conversation": {"speaker_a": "A",', encoding="utf-8")
    with pytest.raises(CorpusError, match="not valid JSON") as e:
        read_corpus(broken)
    assert ".jsonl" not in str(e.value)
