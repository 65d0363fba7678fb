"""The backends the storage tests run the same cases on: a local directory (a plain path, or
``file://``), ``memory://`` and moto's S3 server on 127.0.0.1 (one server per test module).
Shared by ``test_storage_parity.py`` and ``test_storage_records.py``."""

from __future__ import annotations

import uuid

import pytest

from checkpoint.storage.location import resolve, store_of
from tests.s3_server import make_bucket, start_moto, storage_options


def moto_fixture(bucket: str):
    """A module-scoped fixture: storage options of a fresh moto S3 server holding ``bucket``."""

    @pytest.fixture(scope="module")
    def moto_opts():
        server, port = start_moto()
        make_bucket(port, bucket)
        yield storage_options(port)
        server.stop()

    return moto_opts


def fresh(backend: str, tmp_path, opts: dict, bucket: str) -> tuple[str, dict | None]:
    """``(root, storage_options)`` of a fresh, empty place on ``backend`` (``local``: a plain path;
    ``file``: the same as a ``file://`` URL; ``memory``; ``s3``)."""
    tag = uuid.uuid4().hex[:8]
    if backend == "local":
        return str(tmp_path / f"l-{tag}"), None
    if backend == "file":
        return f"file://{tmp_path}/f-{tag}", None
    if backend == "memory":
        return f"memory://{bucket}-{tag}", None
    return f"s3://{bucket}/{tag}", opts


def store(url: str, opts: dict | None):
    """The byte store of ``url`` (:class:`~checkpoint.storage.bytestore.LocalStore` for a local path)."""
    return store_of(resolve(url, opts))


def put(url: str, opts: dict | None, name: str, data: bytes) -> None:
    """Write object ``name`` under ``url`` as a user (or another tool) would."""
    store(url, opts).put(name, data)


def get(url: str, opts: dict | None, name: str) -> bytes | None:
    return store(url, opts).get(name)


def names(url: str, opts: dict | None) -> set[str]:
    """The object names directly under ``url``."""
    return set(store(url, opts).listing())
