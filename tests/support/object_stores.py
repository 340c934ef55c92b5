"""Real object-store servers for tests: gcp-storage-emulator (GCS) and moto (S3).

Each runs as a subprocess on a free loopback port, once per test session, and is always
stopped afterwards. Tests reach the buckets through ``gs://`` and ``s3://`` URLs with the
environment tpu_ckpt (tensorstore) reads, and check them independently of tensorstore
(``Bucket.keys``, ``get``, ``put``, ``delete``: the GCS JSON API over HTTP, boto3 for S3).

Nothing here may reach the internet: ``GOOGLE_AUTH_TOKEN_FOR_TESTING`` stops tensorstore
looking for Google credentials (files, then the GCE metadata server), fixed AWS keys in the
environment come first in its AWS chain, and ``AWS_EC2_METADATA_DISABLED`` and empty AWS
config files rule out the rest.
"""

from __future__ import annotations

import contextlib
import dataclasses
import http.client
import http.server
import json
import os
import random
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from typing import NamedTuple

import pytest

from tpu_ckpt.settings import configure

# Runs a Python module (the rest of the command line) that the kernel kills when the test
# process dies, however it dies (an abort in native code, a timeout's SIGKILL), so that no
# server outlives its session. PR_SET_PDEATHSIG (1) survives the exec.
_DIE_WITH_PARENT = (
    "import ctypes, os, signal, sys; ctypes.CDLL(None).prctl(1, signal.SIGKILL); "
    "os.getppid() == int(sys.argv[1]) or sys.exit(1); os.execv(sys.executable, [sys.executable, *sys.argv[2:]])"
)

BUCKET = "tpu-ckpt-test"
FAULTS_BUCKET = "tpu-ckpt-faults"  # reached only through a FaultyProxy
_START_TIMEOUT_S = 60.0


class Server:
    """One emulator: its scheme (``gs`` or ``s3``) and HTTP endpoint, and plain access to its
    objects: the GCS JSON API over HTTP, or boto3 (moto refuses unsigned object requests)."""

    def __init__(self, scheme: str, endpoint: str):
        self.scheme = scheme
        self.endpoint = endpoint
        self._s3 = None
        if scheme == "s3":
            import boto3  # installed with moto

            self._s3 = boto3.client(
                "s3", endpoint_url=endpoint, region_name="us-east-1",
                aws_access_key_id="testing", aws_secret_access_key="testing",
            )

    def create_bucket(self, name: str) -> None:
        if self._s3 is not None:
            self._s3.create_bucket(Bucket=name)
            return
        body = json.dumps({"name": name}).encode()
        _request("POST", f"{self.endpoint}/storage/v1/b?project=test", body, {"Content-Type": "application/json"})

    def keys(self, bucket: str, prefix: str) -> list[str]:
        """Every object name in ``bucket`` starting with ``prefix``, as the server lists it."""
        return sorted(self.sizes(bucket, prefix))

    def sizes(self, bucket: str, prefix: str) -> dict[str, int]:
        """The size of every object in ``bucket`` starting with ``prefix``, by name, as the
        server lists them."""
        if self._s3 is not None:
            pages = self._s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
            return {item["Key"]: item["Size"] for page in pages for item in page.get("Contents", [])}
        query = urllib.parse.urlencode({"prefix": prefix})
        reply = json.loads(_request("GET", f"{self.endpoint}/storage/v1/b/{bucket}/o?{query}"))
        return {item["name"]: int(item["size"]) for item in reply.get("items", [])}

    def get(self, bucket: str, key: str) -> bytes:
        if self._s3 is not None:
            return self._s3.get_object(Bucket=bucket, Key=key)["Body"].read()
        return _request("GET", f"{self._object(bucket, key)}?alt=media")

    def put(self, bucket: str, key: str, data: bytes) -> None:
        if self._s3 is not None:
            self._s3.put_object(Bucket=bucket, Key=key, Body=data)
            return
        query = urllib.parse.urlencode({"uploadType": "media", "name": key})
        _request("POST", f"{self.endpoint}/upload/storage/v1/b/{bucket}/o?{query}", data)

    def delete(self, bucket: str, key: str) -> None:
        if self._s3 is not None:
            self._s3.delete_object(Bucket=bucket, Key=key)
            return
        _request("DELETE", self._object(bucket, key))

    def _object(self, bucket: str, key: str) -> str:
        return f"{self.endpoint}/storage/v1/b/{bucket}/o/{urllib.parse.quote(key, safe='')}"


@dataclasses.dataclass
class Bucket:
    """A fresh prefix in an emulator's bucket, for one test."""

    server: Server
    prefix: str
    name: str = BUCKET

    @property
    def scheme(self) -> str:
        return self.server.scheme

    def url(self, path: str = "") -> str:
        return f"{self.scheme}://{self.name}/{self.prefix}/{path}".rstrip("/")

    def keys(self, path: str = "") -> list[str]:
        """Object names under ``path`` (relative to this test's prefix)."""
        base = f"{self.prefix}/"
        return [k[len(base) :] for k in self.server.keys(self.name, base + path)]

    def sizes(self, path: str = "") -> dict[str, int]:
        """Object sizes by name under ``path`` (names relative to this test's prefix)."""
        base = f"{self.prefix}/"
        return {k[len(base) :]: size for k, size in self.server.sizes(self.name, base + path).items()}

    def get(self, path: str) -> bytes:
        return self.server.get(self.name, f"{self.prefix}/{path}")

    def put(self, path: str, data: bytes) -> None:
        self.server.put(self.name, f"{self.prefix}/{path}", data)

    def delete(self, path: str) -> None:
        self.server.delete(self.name, f"{self.prefix}/{path}")


def _request(method: str, url: str, data: bytes | None = None, headers: dict[str, str] | None = None) -> bytes:
    request = urllib.request.Request(url, data=data, method=method, headers=headers or {})
    with urllib.request.urlopen(request, timeout=30) as reply:
        return reply.read()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def _running(command: Callable[[int], list[str]], ready_path: str, log_path: str) -> Iterator[str]:
    """Starts ``python -m <command(port)>`` on a free port, waits until it answers, yields its
    URL, and always stops it.

    A port found free can be taken before the server binds it: then the server exits and
    another port is tried.
    """
    for _ in range(3):
        port = _free_port()
        endpoint = f"http://127.0.0.1:{port}"
        with open(log_path, "ab") as log:
            proc = subprocess.Popen(
                [sys.executable, "-c", _DIE_WITH_PARENT, str(os.getpid()), "-m", *command(port)],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            )
        try:
            if _wait_until_answering(proc, endpoint + ready_path):
                yield endpoint
                return
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    with open(log_path, errors="replace") as log:
        raise RuntimeError(f"{command(0)[:2]} never answered; its log:\n{log.read()[-4000:]}")


def _wait_until_answering(proc: subprocess.Popen, url: str) -> bool:
    deadline = time.monotonic() + _START_TIMEOUT_S
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            urllib.request.urlopen(url, timeout=2).close()
            return True
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            time.sleep(0.1)
    return False


@contextlib.contextmanager
def _variable(env: pytest.MonkeyPatch, name: str, value: str) -> Iterator[None]:
    """Sets an environment variable for the processes a test starts and for this one, whose
    tpu_ckpt settings, read once, are read again at their next use (and put back after)."""
    env.setenv(name, value)
    previous = configure(None)
    try:
        yield
    finally:
        configure(previous)


@pytest.fixture(scope="session")
def gcs_server(tmp_path_factory) -> Iterator[Server]:
    log = str(tmp_path_factory.mktemp("gcs") / "server.log")
    command = lambda port: ["gcp_storage_emulator", "start", "--host", "127.0.0.1", "--port", str(port), "--in-memory"]  # noqa: E731
    with _running(command, "/storage/v1/b", log) as endpoint, pytest.MonkeyPatch.context() as env:
        env.setenv("TENSORSTORE_GCS_HTTP_URL", endpoint)
        env.setenv("GOOGLE_AUTH_TOKEN_FOR_TESTING", "emulator-needs-no-token")
        server = Server("gs", endpoint)
        for name in (BUCKET, FAULTS_BUCKET):
            server.create_bucket(name)
        yield server


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory) -> Iterator[Server]:
    directory = tmp_path_factory.mktemp("s3")
    empty = directory / "empty"
    empty.write_text("")
    command = lambda port: ["moto.server", "-H", "127.0.0.1", "-p", str(port)]  # noqa: E731
    with (
        _running(command, "/", str(directory / "server.log")) as endpoint,
        pytest.MonkeyPatch.context() as env,
        _variable(env, "AWS_ENDPOINT_URL", endpoint),
    ):
        for name, value in {
            "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_REGION": "us-east-1",
            "AWS_DEFAULT_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true",
            "AWS_CONFIG_FILE": str(empty), "AWS_SHARED_CREDENTIALS_FILE": str(empty),
        }.items():
            env.setenv(name, value)
        env.delenv("AWS_SESSION_TOKEN", raising=False)
        env.delenv("AWS_PROFILE", raising=False)
        server = Server("s3", endpoint)
        for name in (BUCKET, FAULTS_BUCKET):
            server.create_bucket(name)
        yield server


@pytest.fixture(params=["gs", "s3"])
def bucket(request) -> Bucket:
    """A prefix of its own in the GCS emulator's and then in moto's bucket."""
    server = request.getfixturevalue({"gs": "gcs_server", "s3": "s3_server"}[request.param])
    return Bucket(server, f"{request.node.name.split('[')[0]}-{uuid.uuid4().hex[:8]}")


class Request(NamedTuple):
    method: str
    path: str
    status: int
    at: float  # time.monotonic() when it arrived


class FaultyProxy:
    """A forwarding HTTP proxy in front of an emulator that answers chosen requests itself
    with an error status, the way a loaded object store answers 429 or 503.

    ``fail(match, statuses)``: the next requests for which ``match(method, path)`` holds get
    ``statuses`` in turn; a status of ``DROP`` closes the connection without an answer.
    ``storm(status, seconds)``: every matching request gets ``status`` for that long, from
    now. ``flaky(fraction, status)``: that fraction of matching requests, drawn at random
    (seeded), gets ``status`` until ``calm()``. ``requests`` records every request seen, in order of arrival.
    ``delay_s`` holds every request for which ``delayed(method, path)`` holds (all, unless
    set) that long before it is answered (a distant store), and ``most_in_flight`` is the most
    requests it held at once.
    """

    def __init__(self, target: str):
        self._target = urllib.parse.urlparse(target)
        self._faults: list[tuple[Callable[[str, str], bool], int]] = []
        self._storms: list[tuple[Callable[[str, str], bool], int, float]] = []  # match, status, until
        self._flaky: list[tuple[Callable[[str, str], bool], int, float]] = []  # match, status, fraction
        self._random = random.Random(23)
        self._lock = threading.Lock()
        self.requests: list[Request] = []
        self.delay_s = 0.0
        self.delayed: Callable[[str, str], bool] = lambda method, path: True
        self.most_in_flight = 0
        self._in_flight = 0
        self._server = _ProxyServer(("127.0.0.1", 0), self._handler())
        self.endpoint = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def fail(self, match: Callable[[str, str], bool], statuses: list[int]) -> None:
        with self._lock:
            self._faults.extend((match, status) for status in statuses)

    def storm(self, status: int, seconds: float, match: Callable[[str, str], bool] = lambda method, path: True) -> None:
        with self._lock:
            self._storms.append((match, status, time.monotonic() + seconds))

    def flaky(
        self, fraction: float, status: int, match: Callable[[str, str], bool] = lambda method, path: True
    ) -> None:
        with self._lock:
            self._flaky.append((match, status, fraction))

    def calm(self) -> None:
        """Ends every storm and every flaky answer."""
        with self._lock:
            self._storms.clear()
            self._flaky.clear()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()

    def _injected(self, method: str, path: str) -> int | None:
        with self._lock:
            for i, (match, status) in enumerate(self._faults):
                if match(method, path):
                    del self._faults[i]
                    return status
            now = time.monotonic()
            for match, status, until in self._storms:
                if now < until and match(method, path):
                    return status
            for match, status, fraction in self._flaky:
                if match(method, path) and self._random.random() < fraction:
                    return status
        return None

    def _answer(self, method: str, path: str, headers: dict[str, str], body: bytes) -> tuple[int, list, bytes]:
        """An injected error, or the server's reply, after ``delay_s``; counts requests in flight."""
        with self._lock:
            self._in_flight += 1
            self.most_in_flight = max(self.most_in_flight, self._in_flight)
        try:
            if self.delayed(method, path):
                time.sleep(self.delay_s)
            status = self._injected(method, path)
            if status is not None:
                return status, [("Content-Type", "text/plain")], b"injected by the test"
            forwarded = {k: v for k, v in headers.items() if k.lower() not in _HOP_HEADERS}
            return self._forward(method, path, forwarded, body)
        finally:
            with self._lock:
                self._in_flight -= 1

    def _forward(self, method: str, path: str, headers: dict[str, str], body: bytes) -> tuple[int, list, bytes]:
        connection = http.client.HTTPConnection(self._target.hostname, self._target.port, timeout=30)
        try:
            connection.request(method, path, body=body, headers=headers)
            reply = connection.getresponse()
            return reply.status, reply.getheaders(), reply.read()
        finally:
            connection.close()

    def _handler(self) -> type[http.server.BaseHTTPRequestHandler]:
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def handle_one_request(self) -> None:
                self.raw_requestline = self.rfile.readline(65537)
                if not self.raw_requestline or not self.parse_request():
                    self.close_connection = True
                    return
                arrived = time.monotonic()
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                status, reply_headers, payload = proxy._answer(
                    self.command, self.path, dict(self.headers.items()), body
                )
                with proxy._lock:
                    proxy.requests.append(Request(self.command, self.path, status, arrived))
                if status == DROP:
                    self.close_connection = True
                    return
                self.send_response(status)
                for name, value in reply_headers:
                    if name.lower() not in _HOP_HEADERS | {"content-length"}:
                        self.send_header(name, value)
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(payload)

            def log_message(self, *args: object) -> None:
                pass

        return Handler


DROP = 0
"""A FaultyProxy "status": the connection is closed with no answer (a reset, a dead front end)."""


class _ProxyServer(http.server.ThreadingHTTPServer):
    request_queue_size = 128  # a client opening dozens of connections at once is not refused


_HOP_HEADERS = {"connection", "keep-alive", "transfer-encoding", "proxy-connection", "expect", "upgrade"}


@pytest.fixture
def faulty(bucket: Bucket) -> Iterator[tuple[FaultyProxy, Bucket]]:
    """A FaultyProxy in front of ``bucket``'s server, and a prefix that tpu_ckpt reaches only
    through it.

    The prefix is in a bucket of its own: tensorstore reads TENSORSTORE_GCS_HTTP_URL when it
    opens a bucket and keeps using that endpoint while the bucket stays open anywhere in the
    process, so a bucket other tests use might bypass the proxy.
    """
    proxy = FaultyProxy(bucket.server.endpoint)
    variable = "TENSORSTORE_GCS_HTTP_URL" if bucket.scheme == "gs" else "AWS_ENDPOINT_URL"
    try:
        with pytest.MonkeyPatch.context() as env, _variable(env, variable, proxy.endpoint):
            yield proxy, Bucket(bucket.server, bucket.prefix, FAULTS_BUCKET)
    finally:
        proxy.close()
