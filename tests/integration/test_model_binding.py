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
from pipeline.answer.lookup import ModelMismatchError, NeedsRebuildError
from pipeline.builder.driver import run_build
from pipeline.config import DriverOptions
from pipeline.corpus.reader import write_jsonl
from pipeline.corpus.synthetic import make_corpus
from pipeline.kv import models
from pipeline.serve.errors import classify
from pipeline.store.backends.local import LocalStore
from pipeline.store.catalogue.manifest import read_manifest, write_manifest
from pipeline.store.objects import cache_format
from tests.support.model_folders import make_encoder_folder, make_llm_folder, save_weights
from tests.support.stores import put_conversation

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
    from pipeline.serve.settings import ServeSettings

    gc.freeze, real = (lambda: None), gc.freeze  # a replica's process, not pytest's
    try:
        decoder = Decoder.func_or_class(ServeSettings(store=str(store), cache_bytes=10**8), model)
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
    assert reply["error"]["status"] == 409 and "other files of them" in reply["error"]["message"]
    assert str(llm) not in reply["error"]["message"]  # a client is not shown the server's paths

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


def test_manifests_show_fingerprints_and_flag_missing_and_stale_ones(tmp_path, capsys):
    """`jobs.manifests` shows each episode's model files; episodes without a fingerprint are
    "none" (a warning says to rebuild); --check-models flags those built with other files."""
    from jobs import manifests

    llm = make_llm_folder(tmp_path / "llm")
    encoder = make_encoder_folder(tmp_path / "encoder")
    now = models.llm_fingerprint(str(llm)), models.encoder_fingerprint(str(encoder))
    store = LocalStore(tmp_path / "store")
    write_manifest(store, "conv-old", [  # written as before fingerprints
        dataclasses.replace(r, model_fingerprint=None, encoder_fingerprint=None)
        for r in put_conversation(store, "conv-old")])
    for cid, model_fp in (("conv-now", now[0]), ("conv-other", "0123456789abcdef")):
        write_manifest(store, cid, [
            dataclasses.replace(r, model_id=str(llm), encoder_id=str(encoder),
                                model_fingerprint=model_fp, encoder_fingerprint=now[1])
            for r in put_conversation(store, cid)])

    for args in (["--manifests"], []):  # the manifests, then the table
        if not args:
            manifests.main(["--store", store.uri, "--rebuild"])
            capsys.readouterr()
        assert manifests.main(["--store", store.uri, *args]) == 0
        out, err = capsys.readouterr()
        lines = {ln.split()[0]: ln for ln in out.splitlines()[1:] if not ln.startswith("total")}
        assert " none " in lines["conv-old"] and now[0] in lines["conv-now"]
        assert "0123456789abcdef" in lines["conv-other"] and " stale" not in out
        assert "warning: 2 episode(s) have no model fingerprint" in err and "rebuild" in err
        assert manifests.main(["--store", store.uri, "--check-models", *args]) == 0
        out, err = capsys.readouterr()
        lines = {ln.split()[0]: ln for ln in out.splitlines()[1:] if not ln.startswith("total")}
        assert "0123456789abcdef stale" in lines["conv-other"]
        assert " stale" not in lines["conv-now"] and " none " in lines["conv-old"]
        assert "warning: 2 episode(s) were built with other files" in err
    from jobs import gc as gc_job

    assert gc_job.main(["--store", store.uri]) == 0  # not a fault of the store: reported
    out = capsys.readouterr().out
    assert "needs rebuild: 1 conversation(s) of model 'synthetic' have no model fingerprint" in out
    assert f"files {now[0]}, encoder {str(encoder)!r} files {now[1]}: 1 conversation(s)" in out


def test_a_table_written_before_fingerprints_is_read_then_gains_them(tmp_path, capsys):
    """The manifest table of an older store lacks the fingerprint columns: read, they are
    null (shown as "none"); the next append adds them (the older rows stay null)."""
    from deltalake import write_deltalake

    from jobs import manifests
    from pipeline.store.catalogue.table import ManifestTable, table_row, table_rows

    store = LocalStore(tmp_path / "store")
    table = ManifestTable(store)
    unbound = [dataclasses.replace(r, model_fingerprint=None, encoder_fingerprint=None)
               for r in put_conversation(store, "conv-a")]
    write_manifest(store, "conv-a", unbound)  # as a build before fingerprints wrote it
    older = table_rows([table_row(r) for r in unbound])
    write_deltalake(table.uri, older.drop_columns(["model_fingerprint", "encoder_fingerprint"]))
    assert manifests.main(["--store", store.uri]) == 0
    assert " none " in capsys.readouterr().out.splitlines()[1]
    assert manifests.main(["--store", store.uri, "--json", "--conversation", "conv-a"]) == 0
    assert '"model_fingerprint": null' in capsys.readouterr().out
    newer = [dataclasses.replace(r, model_fingerprint="m" * 16, encoder_fingerprint="e" * 16)
             for r in put_conversation(store, "conv-b")]
    table.replace(["conv-b"], [table_row(r) for r in newer])
    got = {r["conversation_id"]: r["model_fingerprint"]
           for r in table.dataset().to_table().to_pylist()}
    assert got == {"conv-a": None, "conv-b": "m" * 16}
