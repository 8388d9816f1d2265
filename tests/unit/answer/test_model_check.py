"""The model check of every reader (`check_models`): names, then the fingerprints of the files
loaded; a manifest without fingerprints needs a rebuild; both are 409s over HTTP."""

from __future__ import annotations

import pytest

from pipeline.answer.lookup import ModelMismatchError, NeedsRebuildError, check_models
from pipeline.builder.conversation import ModelFilesDifferError, check_same_files
from pipeline.config import ModelFingerprints
from pipeline.serve.errors import classify
from pipeline.store.catalogue.manifest import ManifestRecord
from pipeline.store.objects.cache_ref import CacheRef


def _ref(model_fp: str | None = "m-files", encoder_fp: str | None = "e-files") -> CacheRef:
    return CacheRef(conversation_id="conv-1", episode=0, object_key="caches/conv-1/h/episode-0",
                    sha256="0" * 64, object_bytes=1, model_id="llm", encoder_id="enc",
                    model_fingerprint=model_fp, encoder_fingerprint=encoder_fp)


def test_matching_names_and_files_pass():
    check_models([_ref()], "llm", "enc", model_fingerprint="m-files",
                 encoder_fingerprint="e-files")
    check_models([_ref()], None, None)  # nothing asked: only that fingerprints exist


@pytest.mark.parametrize("kwargs, says", [
    ({"model_fingerprint": "other"}, "other files of model 'llm' (fingerprint m-files)"),
    ({"encoder_fingerprint": "other"}, "other files of encoder 'enc' (fingerprint e-files)"),
    ({"model": "another-llm"}, "was built with model 'llm', not 'another-llm'"),
])
def test_other_files_or_names_are_refused(kwargs, says):
    args = {"model": None, "encoder": None} | kwargs
    with pytest.raises(ModelMismatchError) as e:
        check_models([_ref()], args.pop("model"), args.pop("encoder"), **args)
    assert says in str(e.value) and not isinstance(e.value, NeedsRebuildError)
    status, message = classify(e.value)  # over HTTP: a fixed message, no model paths
    assert status == 409 and "another model or encoder, or other files of them" in message


@pytest.mark.parametrize("missing", ["model", "encoder"])
def test_a_manifest_without_fingerprints_needs_a_rebuild(missing):
    ref = _ref(**{f"{missing}_fp": None})
    with pytest.raises(NeedsRebuildError) as e:
        check_models([ref], "llm", "enc", model_fingerprint="m-files")
    assert "needs a rebuild: python -m jobs.build --force" in str(e.value)
    status, message = classify(e.value)
    assert status == 409 and "needs a rebuild" in message


def test_a_commit_of_episodes_built_with_other_files_fails():
    """A node whose copy of the model differs fails the conversation at its commit."""
    files = ModelFingerprints("m-files", "e-files")
    record = ManifestRecord.from_row({"episode": 1, "worker": "host:7",
                                      "model_fingerprint": "m-files",
                                      "encoder_fingerprint": "e-files"})
    check_same_files([record], files)
    other = ManifestRecord.from_row(record.to_row() | {"model_fingerprint": "x"})
    with pytest.raises(ModelFilesDifferError, match="episode 1 was built by host:7 with model "
                                                    "files x/e-files"):
        check_same_files([record, other], files)


def test_the_bound_hash_changes_with_the_files():
    a = ModelFingerprints("m", "e").bound_hash("cfg")
    assert a == ModelFingerprints("m", "e").bound_hash("cfg") and len(a) == 16
    assert len({a, ModelFingerprints("m2", "e").bound_hash("cfg"),
                ModelFingerprints("m", "e2").bound_hash("cfg"),
                ModelFingerprints("m", "e").bound_hash("cfg2")}) == 4
