"""A real S3 endpoint for tests and the benchmark: moto's server mode on 127.0.0.1 (as s3fs's own
tests run it), and :class:`FaultProxy`, an HTTP proxy in front of it that answers chosen requests
with S3 errors (5xx, ``SlowDown`` throttling) a given number of times."""

from __future__ import annotations

import http.client
import threading
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from checkpoint.ranks.launch import free_port

SECRET = "SEKRETsecretValue123"  # must never appear in a message or report


def start_moto():
    """``(server, port)`` of a fresh moto S3 server (stop it with ``server.stop()``)."""
    from moto.server import ThreadedMotoServer

    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    return server, port


def start_moto_process():
    """``(process, port)`` of moto's server in its own process (``python -m moto.server``), so
    that a benchmark's client and the server do not share one interpreter lock."""
    import socket
    import subprocess
    import sys
    import time

    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return proc, port
        time.sleep(0.1)
    proc.kill()
    raise RuntimeError(f"moto.server did not start on port {port}")


def storage_options(port: int) -> dict:
    """s3fs options for the endpoint on ``port``: botocore's own retries off, so the failures a
    :class:`FaultProxy` injects reach fqnckpt's retry layer (s3fs still retries ``SlowDown``)."""
    return {
        "endpoint_url": f"http://127.0.0.1:{port}",
        "key": "testing-key-id",
        "secret": SECRET,
        "config_kwargs": {"retries": {"total_max_attempts": 1, "mode": "standard"}},
    }


def make_bucket(port: int, bucket: str) -> None:
    import s3fs

    fs = s3fs.S3FileSystem(**storage_options(port))
    fs.call_s3("create_bucket", Bucket=bucket)


_ERRORS = {
    500: ("InternalError", "We encountered an internal error. Please try again."),
    503: ("SlowDown", "Please reduce your request rate."),
}


def plain_and_versioned(plain: str, versioned: str):
    """A generator for a module's ``s3`` fixture: moto's server with bucket ``plain`` (no
    versioning) and bucket ``versioned`` (versioning on); yields ``{"opts": storage options,
    "fs": an s3fs filesystem}`` and stops the server after."""
    import fsspec

    server, port = start_moto()
    make_bucket(port, plain)
    make_bucket(port, versioned)
    opts = storage_options(port)
    fs = fsspec.filesystem("s3", **opts)
    fs.call_s3("put_bucket_versioning", Bucket=versioned, VersioningConfiguration={"Status": "Enabled"})
    yield {"opts": opts, "fs": fs}
    server.stop()


class FaultProxy:
    """Forwards every request to ``127.0.0.1:target`` except those matching a rule:
    ``add(method, substring, status, times)`` answers ``times`` matching requests (None: all)
    with S3 error ``status`` (500 InternalError, 503 SlowDown). ``hits[(method, substring)]``
    counts the injected answers, ``seen`` every request line."""

    def __init__(self, target: int):
        self.target = target
        self.rules: list[list] = []
        self.hits: Counter = Counter()
        self.seen: list[str] = []
        self._lock = threading.Lock()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:
                pass

            def _any(self) -> None:
                n = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(n) if n else b""
                rule = proxy._match(self.command, self.path)
                if rule is not None:
                    code, msg = _ERRORS[rule[2]]
                    data = f"<?xml version='1.0' encoding='UTF-8'?><Error><Code>{code}</Code><Message>{msg}</Message></Error>".encode()
                    self.send_response(rule[2])
                    self.send_header("Content-Type", "application/xml")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                    return
                conn = http.client.HTTPConnection("127.0.0.1", proxy.target, timeout=60)
                try:
                    headers = {k: v for k, v in self.headers.items() if k.lower() != "expect"}
                    conn.request(self.command, self.path, body=body, headers=headers)
                    r = conn.getresponse()
                    data = r.read()
                    self.send_response(r.status)
                    for k, v in r.getheaders():
                        if k.lower() not in ("transfer-encoding", "content-length", "connection", "server", "date"):
                            self.send_header(k, v)
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    if self.command != "HEAD":
                        self.wfile.write(data)
                finally:
                    conn.close()

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _any

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self._thread.start()

    def add(self, method: str, substring: str, status: int, times: int | None = 1) -> None:
        with self._lock:
            self.rules.append([method, substring, status, times])

    def clear(self) -> None:
        with self._lock:
            self.rules.clear()
            self.hits.clear()
            self.seen.clear()

    def _match(self, method: str, path: str):
        with self._lock:
            self.seen.append(f"{method} {path}")
            for rule in self.rules:
                m, sub, _, times = rule
                if m == method and sub in path and (times is None or times > 0):
                    if times is not None:
                        rule[3] -= 1
                    self.hits[(m, sub)] += 1
                    return rule
        return None

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
