"""Every command that opens a store takes the same S3 options, `--s3-endpoint` and
`--s3-region`, and hands them to the store as one `StoreOptions`: `jobs.serve` (and `serve run`)
through its settings' fields of the same names, which every replica opens the store with."""

from __future__ import annotations

import pytest

from jobs import answer, build, gc, manifests, serve
from pipeline.cli.options import settings_from_args
from pipeline.cli.parser import store_options
from pipeline.serve.settings import ServeSettings
from pipeline.store.backends.base import StoreOptions

S3 = ["--s3-endpoint", "http://127.0.0.1:9", "--s3-region", "eu-west-3"]
WANTED = StoreOptions(endpoint="http://127.0.0.1:9", region="eu-west-3")
NEEDS = {build: ["--corpus", "c.jsonl"], answer: ["--conversation", "c", "--question", "q?"],
         manifests: [], gc: []}


@pytest.mark.parametrize("command", list(NEEDS), ids=lambda c: c.__name__)
def test_every_store_command_takes_the_region(command):
    a = command.build_parser().parse_args(["--store", "s3://bucket/p", *NEEDS[command], *S3])
    assert store_options(a) == WANTED
    a = command.build_parser().parse_args(["--store", "s3://bucket/p", *NEEDS[command]])
    assert store_options(a).region is None  # the AWS chain's


def test_serve_takes_the_region_for_every_replica(monkeypatch):
    for name in ("EPICACHE_S3_ENDPOINT", "AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL"):
        monkeypatch.delenv(name, raising=False)
    settings = settings_from_args(serve.parse_args(["--store", "s3://bucket/p", *S3]))
    assert settings.store_options == WANTED
    assert settings_from_args(serve.parse_args(["--store", "s3://b/p"])).store_options == \
        StoreOptions()
    built = ServeSettings.from_strings({"store": "s3://bucket/p", "s3_region": "eu-west-3",
                                        "s3_endpoint": "http://127.0.0.1:9"})
    assert built.store_options == WANTED
