"""Caches bound to the model files that made them: the real build on a local Ray with tiny
random model folders (no packaged model, no GPU). Built, the conversation is skipped on a
re-run; with other weights written into the same folder, its caches are refused by the library,
`jobs.answer` and the Serve decoder (409) instead of decoded, and the next build rebuilds it
(new objects, the old ones left for gc). A manifest from before fingerprints needs a rebuild."""

from __future__ import annotations

import asyncio
import dataclasses
import gc

import pytest

from jobs import answer as answer_job
from jobs import build
from pipeline.answer.answerer import Answerer
from pipeline.answer.routing import ModelMismatchError, NeedsRebuildError
from pipeline.build.config import DriverOptions
from pipeline.build.driver import run_build
from pipeline.corpus.reader import write_jsonl
from pipeline.corpus.synthetic import make_corpus
from pipeline.kv import models
from pipeline.serve.errors import classify
from pipeline.store import cache_format
from pipeline.store.local import LocalStore
from pipeline.store.manifest import read_manifest, write_manifest
from tests.support.model_folders import make_encoder_folder, make_llm_folder, save_weights

CID = "synth-0000"
SMALL = ["--budget", "32", "--block", "64", "--medoids", "1", "--episodes", "2",
         "--no-progress"]


@pytest.fixture
def setup(tmp_path):
    """A one-conversation corpus, a tiny LLM folder and encoder folder, the build's config."""
    corpus = tmp_path / "corpus.jsonl"
    write_jsonl(make_corpus(1, 300, seed=3), corpus)
    llm = make_llm_folder(tmp_path / "llm", seed=0)
    encoder = make_encoder_folder(tmp_path / "encoder")
    store = tmp_path / "store"
    args = ["--corpus", str(corpus), "--store", str(store), "--model", str(llm),
            "--encoder", str(encoder), *SMALL]
    return corpus, store, llm, build.config_from_args(build.parse_args(args))


def _build(corpus, store, config):
    return run_build(str(corpus), str(store), config, DriverOptions(progress=False))


def _ask(store) -> str:
    return Answerer(LocalStore(store)).answer(CID, "What did they talk about?", 4).answer


def _decoder_answer(store, model: str) -> dict:
    from pipeline.serve.decoder import Decoder

    gc.freeze, real = (lambda: None), gc.freeze  # a replica's process, not pytest's
    try:
        decoder = Decoder.func_or_class(str(store), None, model, 10**8)
    finally:
        gc.freeze = real
    ref = read_manifest(LocalStore(store), CID)[0].ref
    return asyncio.run(decoder.answer(ref, "What did they talk about?", 4, 0.0))


def test_other_weights_in_the_folder_are_refused_then_rebuilt(ray_local, setup, capsys):
    corpus, store_dir, llm, config = setup
    first = _build(corpus, store_dir, config)
    assert first.built == 1 and not first.failed
    assert _build(corpus, store_dir, config).skipped == 1  # same files: up to date
    store = LocalStore(store_dir)
    old = read_manifest(store, CID)
    fingerprint = models.llm_fingerprint(str(llm))
    assert {r.model_fingerprint for r in old} == {fingerprint}
    assert {r.encoder_fingerprint for r in old} == {models.encoder_fingerprint(config.encoder)}
    header = cache_format.read_header(store.get(old[0].object_key))
    assert header["model_fingerprint"] == fingerprint
    assert _ask(store_dir) is not None  # served to the files that made it

    save_weights(llm, seed=1)  # a fine-tune written over the folder's weights
    assert models.llm_fingerprint(str(llm)) != fingerprint
    with pytest.raises(ModelMismatchError, match="other files of model") as refused:
        _ask(store_dir)
    assert classify(refused.value)[0] == 409
    assert answer_job.main(["--store", str(store_dir), "--conversation", CID,
                            "--question", "What did they talk about?"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "other files of model" in err and "rebuild" in err
    reply = _decoder_answer(store_dir, str(llm))
    assert reply["error"]["status"] == 409 and fingerprint in reply["error"]["message"]

    again = _build(corpus, store_dir, config)
    assert (again.built, again.skipped) == (1, 0)  # rebuilt, not skipped
    new = read_manifest(store, CID)
    assert {r.model_fingerprint for r in new} == {models.llm_fingerprint(str(llm))}
    assert not {r.object_key for r in new} & {r.object_key for r in old}  # old ones: gc's
    assert all(store.exists(r.object_key) for r in old)
    assert _ask(store_dir) is not None


def test_a_manifest_without_fingerprints_needs_a_rebuild(ray_local, setup):
    corpus, store_dir, _, config = setup
    assert _build(corpus, store_dir, config).built == 1
    store = LocalStore(store_dir)
    write_manifest(store, CID, [dataclasses.replace(r, model_fingerprint=None,
                                                    encoder_fingerprint=None)
                                for r in read_manifest(store, CID)])
    with pytest.raises(NeedsRebuildError, match="needs a rebuild: python -m jobs.build") as e:
        _ask(store_dir)
    assert classify(e.value)[0] == 409
    again = _build(corpus, store_dir, config)
    assert (again.built, again.skipped) == (1, 0)
    assert _ask(store_dir) is not None
