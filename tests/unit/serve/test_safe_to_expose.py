"""Safe to expose: error bodies never carry a server path, a store URI or an object key (each
branch of `classify`, the library's detail going to the log instead), and `jobs.serve` refuses
to bind anything but loopback without a bearer token unless told `--insecure-no-auth`."""

from __future__ import annotations

import logging

import pytest

import jobs.serve
from pipeline.answer.lookup import ConversationNotFound, ModelMismatchError
from pipeline.config.limits import LimitError
from pipeline.corpus.schema import UnsafeIdError
from pipeline.serve.errors import classify
from pipeline.serve.ingress import public_name
from pipeline.serve.settings import AUTH_ENV, ServeSettings
from pipeline.store.backends.base import ObjectNotFound, StoreError
from pipeline.store.catalogue.manifest import ManifestError
from pipeline.store.objects.cache_format import CacheCorruptError, ChecksumError

SECRET_PLACES = ("/srv/private/store", "s3://private-bucket/prefix",
                 "caches/synth-0000/abc/ep0.safetensors", "/srv/models/llama")
DETAIL = " ".join(SECRET_PLACES)

ERRORS = [
    (ConversationNotFound("synth-0000", "/srv/private/store s3://private-bucket/prefix"), 404),
    (ModelMismatchError(f"built with model {DETAIL}"), 409),
    (ChecksumError(f"cache object {DETAIL} failed its checksum"), 503),
    (CacheCorruptError(f"cache object {DETAIL} cannot be parsed"), 503),
    (ObjectNotFound(f"no object in store {DETAIL}"), 503),
    (ManifestError("manifests/synth-0000.parquet", DETAIL, "truncated"), 503),
    (StoreError(f"cannot reach {DETAIL}"), 503),
    (RuntimeError(f"boom at {DETAIL}"), 500),
]


@pytest.mark.parametrize("error, status", ERRORS, ids=lambda v: type(v).__name__)
def test_no_error_body_carries_a_server_path_or_a_store_uri(error, status, caplog):
    with caplog.at_level(logging.WARNING, logger="epicache.serve"):
        got, message = classify(error)
    assert got == status and message
    assert not [place for place in SECRET_PLACES if place in message], message
    if status in (409, 503):  # the operator still gets the detail
        assert "/srv/private/store" in caplog.text or "/srv/models/llama" in caplog.text


def test_what_the_client_sent_is_named_back():
    assert classify(ConversationNotFound("synth-0000", "/srv/x"))[1].startswith(
        "conversation 'synth-0000' has no manifest in this store")
    assert classify(LimitError("the question is 9 tokens long"))[0] == 422
    assert classify(UnsafeIdError("unsafe conversation_id 'a/b'"))[0] == 400


def test_a_model_folder_is_shown_by_its_name_only():
    assert public_name("/srv/models/llama-3-8b/") == "llama-3-8b"
    assert public_name("./models/qwen") == "qwen" and public_name("~/m/mistral") == "mistral"
    assert public_name("SmolLM2-135M-Instruct") == "SmolLM2-135M-Instruct"
    assert public_name("HuggingFaceTB/SmolLM2-135M") == "HuggingFaceTB/SmolLM2-135M"


@pytest.mark.parametrize("host, loopback", [
    ("127.0.0.1", True), ("127.3.2.1", True), ("::1", True), ("[::1]", True),
    ("localhost", True), ("0.0.0.0", False), ("::", False), ("", False), ("10.0.0.5", False),
    ("example.org", False)])
def test_only_loopback_is_loopback(host, loopback):
    assert jobs.serve.is_loopback(host) is loopback


def test_serve_refuses_an_open_interface_without_a_token(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv(AUTH_ENV, raising=False)
    assert jobs.serve.main(["--store", str(tmp_path), "--host", "0.0.0.0"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--auth-token" in err and "--insecure-no-auth" in err


def test_a_token_or_the_explicit_flag_lets_it_bind_and_the_flag_warns(tmp_path, monkeypatch,
                                                                       caplog):
    monkeypatch.delenv(AUTH_ENV, raising=False)
    open_settings = ServeSettings(store=str(tmp_path))
    assert jobs.serve.exposure_error("127.0.0.1", open_settings, False) is None
    assert jobs.serve.exposure_error("0.0.0.0", open_settings, False)
    with_token = ServeSettings(store=str(tmp_path), auth_token="t")
    assert jobs.serve.exposure_error("0.0.0.0", with_token, False) is None
    with caplog.at_level(logging.WARNING, logger="epicache.serve"):
        assert jobs.serve.exposure_error("0.0.0.0", open_settings, True) is None
    assert "no bearer token" in caplog.text
    monkeypatch.setenv(AUTH_ENV, "from-the-env")
    assert jobs.serve.exposure_error("0.0.0.0", ServeSettings(store=str(tmp_path)), False) is None
