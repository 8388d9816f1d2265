"""The S3 store: AWS S3 or any S3-compatible server, through boto3.

Credentials and region come from boto3's standard chain and are never stored, logged or pickled;
`s3_endpoint` is the one place the endpoint is resolved (given, else $EPICACHE_S3_ENDPOINT, else
boto3's own variables), for the store and for the manifest table's Delta writer alike.
"""

from __future__ import annotations

import io
import os
import re
import time
from collections.abc import Iterable
from pathlib import Path
from typing import BinaryIO

from pipeline.store.backends.base import (
    ObjectInfo,
    ObjectNotFound,
    Partial,
    Store,
    StoreError,
    StoreOptions,
    check_key,
)

S3_ENDPOINT_ENV = "EPICACHE_S3_ENDPOINT"
# boto3's own endpoint variables, read here too so that the store's client and the manifest
# table's Delta writer (which does not read them) use the same endpoint
_AWS_ENDPOINT_ENVS = ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL")
_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")
_DENIED = {"403", "AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "Forbidden",
           "InvalidToken", "ExpiredToken", "AuthorizationHeaderMalformed"}
_NO_BUCKET = {"NoSuchBucket"}
_NO_KEY = {"404", "NoSuchKey", "NotFound"}


def s3_endpoint(given: str | None = None) -> str | None:
    """The S3 endpoint, resolved in this one place: `given`, else $EPICACHE_S3_ENDPOINT, else
    boto3's $AWS_ENDPOINT_URL_S3 / $AWS_ENDPOINT_URL, else None (AWS itself)."""
    for value in (given, os.environ.get(S3_ENDPOINT_ENV), *map(os.environ.get, _AWS_ENDPOINT_ENVS)):
        if value:
            return value
    return None


def _public(url: str) -> str:
    """A URL without any user:password@ part, for messages."""
    return re.sub(r"//[^/@]*@", "//", url)


def parse_s3_uri(uri: str) -> tuple[str, str]:
    """(bucket, prefix) of `s3://bucket/prefix`; the prefix has no leading or trailing '/'."""
    rest = uri.removeprefix("s3://")
    bucket, _, prefix = rest.partition("/")
    prefix = prefix.strip("/")
    if not _BUCKET.match(bucket) or ".." in bucket:
        raise StoreError(f"invalid S3 URI {uri!r}: {bucket!r} is not a bucket name "
                         "(3-63 of a-z 0-9 . -)")
    if prefix:
        check_key(prefix)
    return bucket, prefix


class S3Store(Store):
    """Objects under `s3://bucket/prefix/` on AWS S3 or any S3-compatible server.

    Credentials and region come from boto3's standard chain (environment, shared profile,
    instance role) and are never stored on this object, logged, or pickled: a Ray task that
    receives the store builds its own client from its node's chain. Large objects go up in
    parallel multipart uploads; throttling and transient errors are retried with backoff by
    botocore (`retry_mode`). A PUT is atomic: the object appears only once complete.
    """

    def __init__(self, bucket: str, prefix: str = "", *, endpoint_url: str | None = None,
                 region: str | None = None, profile: str | None = None,
                 retry_mode: str | None = None, max_attempts: int | None = None,
                 multipart_threshold: int = 8 * 2**20, multipart_chunksize: int = 8 * 2**20,
                 max_concurrency: int = 8, connect_timeout: float = 5.0,
                 read_timeout: float = 60.0, check: bool = True):
        self.bucket, self.prefix = bucket, prefix.strip("/")
        if self.prefix:
            check_key(self.prefix)
        self.endpoint_url, self.region, self.profile = s3_endpoint(endpoint_url), region, profile
        # botocore's own variables, read here because an explicit retry config overrides them
        self.retry_mode = retry_mode or os.environ.get("AWS_RETRY_MODE") or "adaptive"
        self.max_attempts = max_attempts or int(os.environ.get("AWS_MAX_ATTEMPTS") or 5)
        self.multipart_threshold = multipart_threshold
        self.multipart_chunksize = multipart_chunksize
        self.max_concurrency = max_concurrency
        self.connect_timeout, self.read_timeout = connect_timeout, read_timeout
        self.uri = f"s3://{bucket}/{self.prefix}" if self.prefix else f"s3://{bucket}"
        self._client = self._session = None
        if check:
            self.check()

    @classmethod
    def from_uri(cls, uri: str, options: StoreOptions, *, create: bool = True) -> S3Store:
        """`s3://bucket/prefix`, its bucket checked now (never created: `create` does not
        apply; an empty prefix is an empty store)."""
        bucket, prefix = parse_s3_uri(uri)
        return cls(bucket, prefix, endpoint_url=options.endpoint, region=options.region)

    @property
    def options(self) -> StoreOptions:
        return StoreOptions(endpoint=self.endpoint_url, region=self.region)

    # -- pickling: everything but the session and client (credentials, sockets) ---------------
    def __getstate__(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k not in ("_client", "_session")}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._client = self._session = None

    def __repr__(self) -> str:
        where = f", endpoint={_public(self.endpoint_url)}" if self.endpoint_url else ""
        return f"S3Store({self.uri}{where})"

    @property
    def where(self) -> str:
        return self.uri + (f" (endpoint {_public(self.endpoint_url)})" if self.endpoint_url else "")

    @property
    def session(self):
        """boto3's session of this store (kept: it refreshes expiring credentials itself)."""
        if self._session is None:
            import boto3

            try:
                self._session = boto3.session.Session(profile_name=self.profile,
                                                      region_name=self.region)
            except Exception as e:
                raise self._error(e, "open") from None
        return self._session

    @property
    def client(self):
        if self._client is None:
            from botocore.config import Config

            session = self.session
            try:
                region = session.region_name or ("us-east-1" if self.endpoint_url else None)
                config = Config(
                    retries={"mode": self.retry_mode, "total_max_attempts": self.max_attempts},
                    connect_timeout=self.connect_timeout, read_timeout=self.read_timeout,
                    max_pool_connections=max(10, self.max_concurrency * 2),
                    # S3-compatible servers rarely do virtual-hosted buckets
                    s3={"addressing_style": "path"} if self.endpoint_url else None)
                self._client = session.client("s3", endpoint_url=self.endpoint_url,
                                              region_name=region, config=config)
            except Exception as e:
                raise self._error(e, "open") from None
        return self._client

    def location(self, key: str) -> str:
        return f"{self.uri}/{check_key(key)}"

    def storage_options(self, what: str) -> dict[str, str]:
        """delta-rs storage options for this store's bucket, from boto3's chain now (never
        stored): the same credentials, region and endpoint as the store's own client. `what`
        names the reader in the error when there are no credentials."""
        credentials = self.session.get_credentials()
        if credentials is None:
            raise StoreError(f"no usable AWS credentials for {what}: set AWS_ACCESS_KEY_ID and "
                             "AWS_SECRET_ACCESS_KEY, AWS_PROFILE, or run with an instance role")
        frozen = credentials.get_frozen_credentials()
        options = {"AWS_ACCESS_KEY_ID": frozen.access_key,
                   "AWS_SECRET_ACCESS_KEY": frozen.secret_key,
                   "AWS_REGION": self.session.region_name or "us-east-1",
                   "AWS_CONDITIONAL_PUT": "etag"}  # commits are put-if-absent
        if frozen.token:
            options["AWS_SESSION_TOKEN"] = frozen.token
        if self.endpoint_url:  # an S3-compatible server: path-style, http allowed for a local one
            options |= {"AWS_ENDPOINT_URL": self.endpoint_url,
                        "AWS_VIRTUAL_HOSTED_STYLE_REQUEST": "false",
                        "AWS_ALLOW_HTTP": str(self.endpoint_url.startswith("http://")).lower()}
        return options

    def _transfer_config(self):
        from boto3.s3.transfer import TransferConfig

        return TransferConfig(multipart_threshold=self.multipart_threshold,
                              multipart_chunksize=self.multipart_chunksize,
                              max_concurrency=self.max_concurrency)

    def _key(self, key: str) -> str:
        check_key(key)
        return f"{self.prefix}/{key}" if self.prefix else key

    def _error(self, e: Exception, what: str, key: str | None = None) -> StoreError:
        """One clear line for a boto error: never the credentials, never a traceback."""
        from botocore import exceptions as bx

        target = f"{self.where}" + (f", object {key!r}" if key else "")
        if isinstance(e, (bx.NoCredentialsError, bx.PartialCredentialsError,
                          bx.CredentialRetrievalError)):
            return StoreError(f"no usable AWS credentials for {self.uri}: set AWS_ACCESS_KEY_ID "
                              "and AWS_SECRET_ACCESS_KEY, AWS_PROFILE, or run with an instance "
                              "role")
        if isinstance(e, bx.ProfileNotFound):
            return StoreError(f"AWS profile {self.profile or os.environ.get('AWS_PROFILE')!r} "
                              f"not found (needed for {self.uri})")
        if isinstance(e, (bx.EndpointConnectionError, bx.ConnectTimeoutError,
                          bx.ConnectionClosedError, bx.ReadTimeoutError, bx.SSLError,
                          bx.ProxyConnectionError)):
            endpoint = _public(self.endpoint_url) if self.endpoint_url else "the AWS S3 endpoint"
            return StoreError(f"cannot reach S3 at {endpoint} ({what} {target}) after "
                              f"{self.max_attempts} attempts: {type(e).__name__}")
        if isinstance(e, bx.ClientError):
            code = str(e.response.get("Error", {}).get("Code", ""))
            status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            if code in _NO_BUCKET or (what == "open" and code in _NO_KEY):
                return StoreError(f"S3 bucket {self.bucket!r} does not exist ({self.where})")
            if code in _NO_KEY:
                return ObjectNotFound(f"no object {key!r} in store {self.where}")
            if code in _DENIED:
                return StoreError(f"access denied to {self.where} ({code}): check the AWS "
                                  "credentials and the bucket policy")
            message = str(e.response.get("Error", {}).get("Message", ""))[:200]
            return StoreError(f"S3 {what} of {target} failed: {code or status} {message}".rstrip())
        if isinstance(e, bx.BotoCoreError):
            return StoreError(f"S3 {what} of {target} failed: {type(e).__name__}: {e}")
        return StoreError(f"S3 {what} of {target} failed: {type(e).__name__}: {e}")

    def _call(self, what: str, key: str | None, fn, *args, **kwargs):
        from botocore import exceptions as bx

        try:
            return fn(*args, **kwargs)
        except (bx.BotoCoreError, bx.ClientError) as e:
            raise self._error(e, what, key) from None

    def check(self) -> None:
        """Fail now, with one clear line, if the bucket cannot be reached, is missing or denied."""
        self._call("open", None, self.client.head_bucket, Bucket=self.bucket)

    def put(self, key: str, data: bytes) -> None:
        self._call("put", key, self.client.upload_fileobj, io.BytesIO(data), self.bucket,
                   self._key(key), Config=self._transfer_config())

    def get(self, key: str) -> bytes:
        buf = io.BytesIO()
        self._call("get", key, self.client.download_fileobj, self.bucket, self._key(key), buf,
                   Config=self._transfer_config())
        return buf.getvalue()

    def open(self, key: str) -> BinaryIO:
        response = self._call("get", key, self.client.get_object, Bucket=self.bucket,
                              Key=self._key(key))
        return io.BufferedReader(_S3Body(self, key, response["Body"]), buffer_size=1 << 20)

    def download(self, key: str, path: str | Path) -> None:
        self._call("get", key, self.client.download_file, self.bucket, self._key(key), str(path),
                   Config=self._transfer_config())

    def info(self, key: str) -> ObjectInfo:
        head = self._call("head", key, self.client.head_object, Bucket=self.bucket,
                          Key=self._key(key))
        return ObjectInfo(int(head["ContentLength"]), head["LastModified"].timestamp())

    def exists(self, key: str) -> bool:
        try:
            self._call("head", key, self.client.head_object, Bucket=self.bucket, Key=self._key(key))
            return True
        except ObjectNotFound:
            return False

    def list(self, prefix: str = "") -> list[str]:
        return sorted(self._listing(prefix))

    def _listing(self, prefix: str) -> dict[str, int]:
        """Every key under `prefix` with its size (ListObjectsV2 gives both, 1,000 a request)."""
        base = f"{self.prefix}/" if self.prefix else ""
        sizes = {}
        pages = self.client.get_paginator("list_objects_v2").paginate(
            Bucket=self.bucket, Prefix=base + prefix)
        for page in self._call("list", prefix or None, list, pages):
            sizes.update((obj["Key"][len(base):], int(obj["Size"]))
                         for obj in page.get("Contents", ()))
        return sizes

    def sizes(self, keys: Iterable[str]) -> dict[str, int | None]:
        """One listing per folder of the keys, not a HEAD per key: a conversation's episodes
        share a folder, so its skip check is a request or two."""
        keys = [check_key(k) for k in keys]
        listed: dict[str, int] = {}
        for folder in sorted({k.rpartition("/")[0] for k in keys}):
            listed |= self._listing(f"{folder}/" if folder else "")
        return {k: listed.get(k) for k in keys}

    def delete(self, key: str) -> None:
        self._call("delete", key, self.client.delete_object, Bucket=self.bucket, Key=self._key(key))

    def list_partial(self) -> list[Partial]:
        """Incomplete multipart uploads under the prefix (their parts are stored and billed)."""
        base = f"{self.prefix}/" if self.prefix else ""
        pages = self.client.get_paginator("list_multipart_uploads").paginate(
            Bucket=self.bucket, Prefix=base)
        out, now = [], time.time()
        for page in self._call("list uploads", None, list, pages):
            for up in page.get("Uploads", ()):
                out.append(Partial(name=f"{up['Key']}?uploadId={up['UploadId']}",
                                   key=up["Key"][len(base):],
                                   age_seconds=now - up["Initiated"].timestamp()))
        return sorted(out, key=lambda p: p.name)

    def delete_partial(self, partial: Partial) -> None:
        key, _, upload_id = partial.name.partition("?uploadId=")
        self._call("abort upload", partial.key, self.client.abort_multipart_upload,
                   Bucket=self.bucket, Key=key, UploadId=upload_id)


class _S3Body(io.RawIOBase):
    """A GetObject body as a raw stream (so `io.BufferedReader` can give `readline` and
    iteration); a failure mid-stream is the store's one-line `StoreError`, as for `get`."""

    def __init__(self, store: S3Store, key: str, body):
        self.store, self.key, self.body = store, key, body

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        data = self.store._call("get", self.key, self.body.read, len(buffer))
        buffer[:len(data)] = data
        return len(data)

    def close(self) -> None:
        if not self.closed:
            self.body.close()
        super().close()
