"""Objects under one URL prefix through fsspec (``s3://`` via s3fs, ``memory://``, ``file://``, any
installed backend): whole and ranged reads, puts, bounded streaming uploads, listing, deletes.

Every call is retried on transient errors (5xx, throttling such as S3's ``SlowDown`` / 503,
timeouts, dropped connections) with exponential backoff, a bounded number of times
(:class:`TransferConfig`); then :class:`ObjectStoreError` (an ``OSError``) carries a message with
every credential of the storage options and the environment replaced by ``***``; reads raise
:class:`~checkpoint.errors.LoadError` naming the object, and saves turn write failures into
:class:`~checkpoint.errors.CheckpointWriteError`.

Uploads stream (:meth:`ObjectStore.open_writer`): on S3 a multipart upload whose parts
(``part_size`` bytes, S3's minimum is 5 MiB) are sent by ``parts_in_flight`` threads, the buffer
being filled counted among them, so at most ``part_size * parts_in_flight`` bytes are buffered per
file; a file of known size within that budget is one PUT (no multipart requests: measured in
``tests/bench/s3_save_load.py``, a multipart completion costs as much as a part). Other backends get the same bounded buffering in
front of ``fs.open(..., "wb")``. Multipart calls go through s3fs's ``call_s3`` (s3fs's own file
object uploads one part at a time).

Reads can be pinned to the object a reader opened (``pins``, an :class:`ObjectVersion` per
name): on S3 each later GET names the ``VersionId`` the first one answered (a versioned bucket
keeps serving those bytes after an overwrite), else sends ``If-Match: <ETag>`` (S3 refuses it
with 412 once the object changed), so a reader never mixes bytes of two objects under one name:
a change is :class:`ObjectChangedError`. Other backends have no object identity: no pinning.
"""

from __future__ import annotations

import contextlib
import errno
import threading
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from ..testing import faults
from ..errors import CorruptCheckpointError, LoadError, UnsupportedStorageError
from .secrets import register, scrub, scrubber
from .urls import redact_url, url_scheme
from . import ownership

_MEMORY_CAS = threading.Lock()  # memory:// conditional writes: compare and swap under one lock
S3_MIN_PART = 5 << 20  # S3 refuses smaller parts (except the last one of an upload)


@dataclass(frozen=True)
class TransferConfig:
    """How objects are moved. ``part_size``: bytes per upload part (>= 5 MiB on S3);
    ``parts_in_flight``: parts buffered or uploading at once per file (peak upload memory per file
    is ``part_size * parts_in_flight`` bytes); ``retries``: attempts after the first for each
    request that failed transiently; ``backoff_s`` doubling up to ``max_backoff_s`` between them."""

    part_size: int = 16 << 20
    parts_in_flight: int = 4
    retries: int = 5
    backoff_s: float = 0.1
    max_backoff_s: float = 4.0

    def __post_init__(self) -> None:
        if self.part_size < 1 or self.parts_in_flight < 1 or self.retries < 0:
            raise ValueError(f"TransferConfig needs part_size >= 1, parts_in_flight >= 1, retries >= 0: {self}")


class ObjectStoreError(OSError):
    """A storage request failed for good (not transient, or still failing after the retries).
    ``transient``: whether the last failure was of the retried kind. The message holds no credentials."""

    def __init__(self, message: str, transient: bool = False):
        super().__init__(scrub(message))
        self.transient = transient

    def __str__(self) -> str:
        return self.args[0]


class PreconditionFailed(ObjectStoreError):
    """A conditional write or delete (``If-Match`` / ``If-None-Match``) found the object changed:
    another writer got there first."""


def _precondition_failed(e: BaseException) -> bool:
    """S3 answers 412 PreconditionFailed (409 ConditionalRequestConflict for a race between two
    conditional requests); s3fs turns the first into FileExistsError or OSError(EINVAL) with the
    botocore error as ``__cause__``."""
    for err in (e, e.__cause__):
        response = getattr(err, "response", None)
        if isinstance(response, Mapping):
            code = str(response.get("Error", {}).get("Code", ""))
            status = response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0
            if code in ("PreconditionFailed", "ConditionalRequestConflict") or status in (412, 409):
                return True
    return isinstance(e, FileExistsError)


@dataclass(frozen=True)
class ObjectVersion:
    """Which object's bytes a reader saw under one name (S3): its ``VersionId`` on a versioned
    bucket (a GET naming it returns those bytes even after an overwrite), else its ``ETag`` (a
    GET with ``If-Match`` is refused once another object replaced it). S3's version ``"null"``
    (an unversioned or suspended bucket: an overwrite replaces it) counts as no version."""

    etag: str | None = None
    version_id: str | None = None

    @classmethod
    def of(cls, response: Mapping) -> ObjectVersion | None:
        """The version a GetObject / HeadObject response names; None when it names none."""
        vid = response.get("VersionId") or None
        etag = response.get("ETag") or None
        vid = None if vid == "null" else vid
        return cls(etag, vid) if etag or vid else None

    def request_args(self) -> dict[str, str]:
        """GetObject / HeadObject arguments that read exactly this object, or fail."""
        return {"VersionId": self.version_id} if self.version_id else {"IfMatch": self.etag or ""}

    def same(self, other: ObjectVersion) -> bool:
        """Whether response version ``other`` is this object (same version id, else same ETag)."""
        return other.version_id == self.version_id if self.version_id else other.etag == self.etag

    def __str__(self) -> str:
        return f"version {self.version_id}" if self.version_id else f"ETag {self.etag}"


class ObjectChangedError(CorruptCheckpointError):
    """Object ``file`` is no longer the one a reader opened (:class:`ObjectVersion` ``pinned``):
    overwritten (its ETag no longer matches) or removed (that object or version is gone) since.
    ``why`` says so ("changed while being loaded ..."). Readers raise it on as a plain
    CorruptCheckpointError naming the tensor (one class every rank of a load raises alike)."""

    def __init__(self, file: str, pinned: ObjectVersion, gone: bool = False):
        self.pinned, self.gone = pinned, gone
        what = "removed" if gone else "overwritten"
        super().__init__(file, f"changed while being loaded (the object opened, {pinned}, was {what} since)")


def _changed(e: BaseException) -> bool:
    """Whether a pinned GET / HEAD failed because the object changed: 412 on ``If-Match``, or
    no such key or version (s3fs: FileNotFoundError)."""
    return isinstance(e, FileNotFoundError) or _precondition_failed(e)


@dataclass
class StoreStats:
    """Counters of this process (tests and the benchmark read them)."""

    retries: int = 0
    parts: int = 0  # multipart parts sent
    objects: int = 0  # objects completed by ObjectWriter.close (each rank's own files)
    buffered: int = 0  # upload bytes buffered now
    peak_buffered: int = 0  # the most upload bytes buffered at once since the last reset
    ranged_gets: int = 0
    bytes_read: int = 0

    def reset(self) -> None:
        self.retries = self.parts = self.objects = self.buffered = self.peak_buffered = self.ranged_gets = self.bytes_read = 0


stats = StoreStats()
_stats_lock = threading.Lock()


def _buffered(delta: int) -> None:
    with _stats_lock:
        stats.buffered += delta
        stats.peak_buffered = max(stats.peak_buffered, stats.buffered)


# -- credentials never reach a message: the one scrubber (checkpoint.storage.secrets) -----------------

# -- which failures are transient ---------------------------------------------------------------------

_TRANSIENT_CODES = frozenset(
    {"SlowDown", "Throttling", "ThrottlingException", "RequestLimitExceeded", "TooManyRequests",
     "RequestTimeout", "RequestTimeTooSkewed", "InternalError", "ServiceUnavailable", "503", "500",
     "502", "504", "429"}
)  # fmt: skip
_TRANSIENT_ERRNO = frozenset(
    {errno.EBUSY, errno.EAGAIN, errno.EIO, getattr(errno, "EREMOTEIO", errno.EIO), errno.ETIMEDOUT,
     errno.ECONNRESET, errno.ECONNREFUSED, errno.ECONNABORTED, errno.EPIPE}
)  # fmt: skip


def is_transient(e: BaseException) -> bool:
    """5xx / throttling / timeouts / dropped connections: worth another try."""
    if isinstance(e, (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError, FileExistsError)):
        return False
    if isinstance(e, (ConnectionError, TimeoutError)):
        return True
    response = getattr(e, "response", None)  # botocore ClientError, without importing botocore
    if isinstance(response, Mapping):
        code = str(response.get("Error", {}).get("Code", ""))
        status = response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0
        return code in _TRANSIENT_CODES or status >= 500 or status == 429
    name = type(e).__name__
    if type(e).__module__.split(".")[0] in ("botocore", "aiobotocore", "aiohttp", "urllib3", "requests"):
        return any(w in name for w in ("Connection", "Timeout", "Incomplete", "Payload", "Parser"))
    if isinstance(e, OSError):
        return e.errno in _TRANSIENT_ERRNO or (e.errno is None and "Throttl" in str(e))
    return False


def _digest_tag(data: bytes | None) -> str | None:
    """The tag of an object's bytes on backends without ETags (compared before a conditional write)."""
    import hashlib

    return None if data is None else hashlib.sha256(data).hexdigest()


# -- the store ----------------------------------------------------------------------------------------------


class ObjectStore:
    """The objects under URL prefix ``url`` (a "directory" of a checkpoint, or a manager's root).
    Names are plain object names relative to the prefix. Use :func:`open_store`."""

    def __init__(self, url: str, fs: Any, root: str, options: Mapping | None, transfer: TransferConfig):
        self.url = redact_url(url.rstrip("/"))
        self.fs, self.root, self.options, self.transfer = fs, root.rstrip("/"), dict(options or {}), transfer
        self.scrub = scrubber(options)
        self.s3 = hasattr(fs, "call_s3") and hasattr(fs, "split_path")

    def __str__(self) -> str:  # messages name the URL, never the options
        return self.url

    def __repr__(self) -> str:
        return f"ObjectStore({self.url!r})"

    def child(self, name: str) -> ObjectStore:
        """The store of prefix ``url/name``."""
        return ObjectStore(f"{self.url}/{name}", self.fs, f"{self.root}/{name}", self.options, self.transfer)

    def key(self, name: str) -> str:
        return f"{self.root}/{name}"

    def url_of(self, name: str) -> str:
        return f"{self.url}/{name}"

    # -- retries ------------------------------------------------------------------------------
    def call(self, what: str, fn, *args, **kwargs):
        """``fn(*args, **kwargs)`` with the retries of :class:`TransferConfig`; a failure that
        stays is an :class:`ObjectStoreError` naming ``what`` (FileNotFoundError passes through)."""
        delay = self.transfer.backoff_s
        for attempt in range(self.transfer.retries + 1):
            try:
                return fn(*args, **kwargs)
            except (FileNotFoundError, ObjectChangedError):
                raise
            except Exception as e:  # noqa: BLE001 - classified, then retried or reported
                if kwargs.get("IfMatch") or kwargs.get("IfNoneMatch"):
                    if _precondition_failed(e):
                        raise PreconditionFailed(f"{what}: {self.scrub(str(e))}") from None
                transient = is_transient(e)
                if not transient or attempt == self.transfer.retries:
                    tries = f" after {attempt + 1} attempts" if transient else ""
                    raise ObjectStoreError(
                        f"{what}{tries}: {type(e).__name__}: {self.scrub(str(e))}", transient
                    ) from None  # the cause may quote credentials: not chained
                with _stats_lock:
                    stats.retries += 1
                time.sleep(delay)
                delay = min(delay * 2, self.transfer.max_backoff_s)
        raise AssertionError("unreachable")

    # -- reads: a failure for good is a LoadError naming the object ---------------------------
    def read(self, name: str, fn, *args, **kwargs):
        """:meth:`call` for reads: a failure that stays is :class:`~checkpoint.errors.LoadError`
        naming object ``name`` (FileNotFoundError and :class:`ObjectChangedError` pass through)."""
        try:
            return self.call(f"reading {self.url_of(name)}", fn, *args, **kwargs)
        except ObjectStoreError as e:
            raise LoadError(name, self.url_of(name), str(e)) from None

    def get(self, name: str) -> bytes | None:
        """The whole object ``name``; None when it does not exist. On S3 one GET (the bytes of
        one object, however large; no HEAD first).

        Raises:
            LoadError: the read failed for good (after the retries)."""
        try:
            if self.s3:
                data = self._pinned([(name, None, None)], {})[0]
            else:
                data = self.read(name, self.fs.cat_file, self.key(name))
        except FileNotFoundError:
            return None
        stats.bytes_read += len(data)
        return data

    def get_range(self, name: str, start: int, end: int, pins: dict[str, ObjectVersion] | None = None) -> bytes:
        """Bytes ``[start, end)`` of object ``name`` (one ranged GET); ``pins`` as :meth:`get_many`.

        Raises:
            FileNotFoundError: no such object (not pinned).
            ObjectChangedError: ``name`` is pinned and changed.
            LoadError: the read failed for good.
        """
        if end <= start:
            return b""
        if pins is not None and self.s3:
            data = self._pinned([(name, start, end)], pins)[0]
        else:
            data = self.read(name, self.fs.cat_file, self.key(name), start=start, end=end)
        stats.ranged_gets += 1
        stats.bytes_read += len(data)
        return data

    def get_ranges(
        self, name: str, spans: Sequence[tuple[int, int]], pins: dict[str, ObjectVersion] | None = None
    ) -> list[bytes]:
        """Several byte ranges of one object (ranged GETs sent concurrently); ``pins`` as :meth:`get_many`."""
        data = self.get_many([(name, s, e) for s, e in spans], pins)
        stats.bytes_read += sum(len(d) for d in data)
        return data

    def get_many(
        self, spans: Sequence[tuple[str, int, int]], pins: dict[str, ObjectVersion] | None = None
    ) -> list[bytes]:
        """Byte ranges ``(name, start, end)`` of any objects, the GETs sent concurrently.

        ``pins`` (S3; ignored elsewhere): the objects a reader opened, updated in place: a name
        in it is read at that :class:`ObjectVersion` only; a name not in it is read as it is
        now and its version recorded there (the first read of an object pins it).

        Raises:
            ObjectChangedError: a pinned object was overwritten or removed, or two GETs of one
                object not pinned yet answered different versions. FileNotFoundError: an object
                not pinned does not exist. LoadError: a read failed for good.
        """
        if not spans:
            return []
        if pins is not None and self.s3:
            data = self._pinned(spans, pins)
        else:
            data = self.read(
                spans[0][0], self.fs.cat_ranges, [self.key(n) for n, _, _ in spans], [s for _, s, _ in spans],
                [e for _, _, e in spans], on_error="raise",
            )  # fmt: skip
            for (name, _, _), d in zip(spans, data):
                if isinstance(d, BaseException):
                    raise LoadError(name, self.url_of(name), f"{type(d).__name__}: {self.scrub(str(d))}")
        stats.ranged_gets += len(spans)
        return data

    # -- pinned reads (S3) ----------------------------------------------------------------------
    async def _get_object(self, name: str, start: int | None, end: int | None, pin: ObjectVersion | None):
        """One GetObject of ``name`` (bytes ``[start, end)``, or all of it when ``start`` is
        None) at ``pin``: ``(bytes, the version the response names)``."""
        bucket, path, _ = self.fs.split_path(self.key(name))
        args = pin.request_args() if pin is not None else {}
        if start is not None:
            args["Range"] = f"bytes={start}-{end - 1}"
        try:
            r = await self.fs._call_s3("get_object", Bucket=bucket, Key=path, **args)
            async with r["Body"] as body:
                data = await body.read()
        except Exception as e:
            if pin is not None and _changed(e):
                raise ObjectChangedError(self.url_of(name), pin, gone=isinstance(e, FileNotFoundError)) from None
            raise
        got = ObjectVersion.of(r)
        if pin is not None and got is not None and not pin.same(got):  # a server that ignored the condition
            raise ObjectChangedError(self.url_of(name), pin)
        return data, got

    async def _head_object(self, name: str, pin: ObjectVersion) -> None:
        """One HeadObject of ``name`` at ``pin``: ObjectChangedError when it is no longer there."""
        bucket, path, _ = self.fs.split_path(self.key(name))
        try:
            r = await self.fs._call_s3("head_object", Bucket=bucket, Key=path, **pin.request_args())
        except Exception as e:
            if _changed(e):
                raise ObjectChangedError(self.url_of(name), pin, gone=isinstance(e, FileNotFoundError)) from None
            raise
        got = ObjectVersion.of(r)
        if got is not None and not pin.same(got):
            raise ObjectChangedError(self.url_of(name), pin)

    def _gather(self, name: str, coros: list) -> list:
        """Run ``coros`` concurrently on s3fs's loop (fsspec's batch size at a time), with the
        retries of :meth:`read`; the first failure raised (an :class:`ObjectChangedError` first)."""
        from fsspec.asyn import _run_coros_in_chunks, sync

        async def run(fresh):
            got = await _run_coros_in_chunks(fresh(), nofiles=True, return_exceptions=True)
            errors = [g for g in got if isinstance(g, BaseException)]
            if errors:
                raise next((g for g in errors if isinstance(g, ObjectChangedError)), errors[0])
            return got

        return self.read(name, sync, self.fs.loop, run, coros)

    def _pinned(self, spans: Sequence[tuple[str, int | None, int | None]], pins: dict[str, ObjectVersion]) -> list[bytes]:
        """GETs ``spans`` at ``pins`` (see :meth:`get_many`), concurrently."""
        got = self._gather(spans[0][0], lambda: [self._get_object(n, s, e, pins.get(n)) for n, s, e in spans])
        seen: dict[str, ObjectVersion] = {}
        for (n, _, _), (_, v) in zip(spans, got):
            if v is None or n in pins:
                continue
            first = seen.setdefault(n, v)
            if not first.same(v):
                raise ObjectChangedError(self.url_of(n), first)
        pins.update(seen)
        return [d for d, _ in got]

    def pinned_size(self, name: str, pins: dict[str, ObjectVersion]) -> int:
        """The byte size of object ``name`` at its version in ``pins`` (S3: one HeadObject; an
        object not pinned yet is pinned to the version this HEAD answers; other backends: its
        size now), so that reads of it through ``pins`` cover exactly that object, whatever a
        listing said of it before.

        Raises:
            FileNotFoundError: no such object (not pinned).
            ObjectChangedError: ``name`` is pinned and changed.
            LoadError: the HEAD failed for good."""
        if not self.s3:  # no versions to pin (reads are plain ranged GETs): its size now
            self.fs.invalidate_cache(self.key(name))
            return int(self.read(name, self.fs.size, self.key(name)))
        bucket, path, _ = self.fs.split_path(self.key(name))
        pin = pins.get(name)

        async def head():
            try:
                r = await self.fs._call_s3("head_object", Bucket=bucket, Key=path, **(pin.request_args() if pin else {}))
            except Exception as e:
                if pin is not None and _changed(e):
                    raise ObjectChangedError(self.url_of(name), pin, gone=isinstance(e, FileNotFoundError)) from None
                raise
            return r

        from fsspec.asyn import sync

        r = self.read(name, sync, self.fs.loop, head)
        got = ObjectVersion.of(r)
        if pin is not None and got is not None and not pin.same(got):
            raise ObjectChangedError(self.url_of(name), pin)
        if pin is None and got is not None:
            pins[name] = got
        return int(r["ContentLength"])

    def check_versions(self, pins: Mapping[str, ObjectVersion]) -> None:
        """One HEAD per object of ``pins`` (sent concurrently; S3 only) at its pinned version:
        whether each is still the object a reader opened.

        Raises:
            ObjectChangedError: one was overwritten or removed since (the first by name).
            LoadError: a HEAD failed for good."""
        if not pins or not self.s3:
            return
        names = sorted(pins)
        self._gather(names[0], lambda: [self._head_object(n, pins[n]) for n in names])

    def listing(self) -> dict[str, tuple[str, int]]:
        """``{name: (kind, size)}`` of what lies directly under the prefix (kind ``"file"`` or
        ``"directory"``), fresh (listing caches are dropped first); ``{}`` when nothing is there."""
        self.fs.invalidate_cache(self.root)
        try:
            entries = self.read(".", self.fs.ls, self.root, detail=True)
        except FileNotFoundError:
            return {}
        out = {}
        for e in entries:
            name = e["name"].rstrip("/").rsplit("/", 1)[-1]
            if e["name"].rstrip("/") != self.root and name:
                out[name] = (e.get("type", "file"), int(e.get("size") or 0))
        return out

    # -- writes --------------------------------------------------------------------------------
    @property
    def conditional(self) -> bool:
        """Whether :meth:`put` / :meth:`delete_if` are atomic compare-and-swap on this backend: S3's
        conditional requests (``If-Match`` / ``If-None-Match``); ``memory://``, visible to this
        process only, under one process-wide lock. Elsewhere (other fsspec backends) they are
        check-then-act: a narrow race remains."""
        return self.s3 or self._in_process

    @property
    def _in_process(self) -> bool:
        return "memory" in (self.fs.protocol if isinstance(self.fs.protocol, tuple) else (self.fs.protocol,))

    def _cas(self) -> contextlib.AbstractContextManager:
        """Held around a check-then-act conditional write or delete: atomic for ``memory://``."""
        return _MEMORY_CAS if self._in_process else contextlib.nullcontext()

    def writer_lock(self) -> contextlib.AbstractContextManager:
        """None on object storage: its commits are conditional index writes (see :mod:`~checkpoint.storage.commit`)."""
        return contextlib.nullcontext()

    def staging_areas(self) -> list[str]:
        return []  # object-store saves stage under their own names, listed by their manifests

    def remove_staging_area(self, name: str) -> None:
        pass

    def get_tagged(self, name: str) -> tuple[bytes | None, str | None]:
        """``(bytes, tag)`` of object ``name`` read in one request; ``tag`` is S3's ETag (for
        :meth:`put` ``if_match``), the bytes' sha256 on other backends; ``(None, None)`` when absent.

        Raises:
            LoadError: the read failed for good (after the retries)."""
        if not self.s3:
            data = self.get(name)
            return data, _digest_tag(data)
        from fsspec.asyn import sync

        bucket, path, _ = self.fs.split_path(self.key(name))

        async def fetch():
            r = await self.fs._call_s3("get_object", Bucket=bucket, Key=path)
            async with r["Body"] as body:
                return await body.read(), r.get("ETag")

        try:
            data, tag = self.read(name, sync, self.fs.loop, fetch)
        except FileNotFoundError:
            return None, None
        stats.bytes_read += len(data)
        return data, tag

    def tag_of(self, name: str) -> str | None:
        """The tag of object ``name`` as :meth:`get_tagged` gives it (S3's ETag, from a HEAD
        request: no body read; the bytes' sha256 elsewhere), None when absent: the ``if_match``
        of a :meth:`put` or :meth:`ObjectWriter.close` that replaces it only if unchanged."""
        if not self.s3:
            return _digest_tag(self.get(name))
        bucket, path, _ = self.fs.split_path(self.key(name))
        try:
            r = self.read(name, self.fs.call_s3, "head_object", Bucket=bucket, Key=path)
        except FileNotFoundError:
            return None
        return r.get("ETag")

    def put(self, name: str, data: bytes, if_match: str | None = None, if_absent: bool = False) -> None:
        """Write object ``name`` as one PUT (replaces it whole: readers see old or new bytes).
        ``if_match``: only if the object still has this tag (:meth:`get_tagged`); ``if_absent``:
        only if no such object exists. Atomic where :attr:`conditional`, else checked just before.

        Raises:
            PreconditionFailed: the condition did not hold (nothing written).
            ObjectStoreError: the request failed for good."""
        body = data if isinstance(data, (bytes, bytearray)) else bytes(data)
        what = f"writing {self.url_of(name)}"
        if not self.s3 and (if_match is not None or if_absent):  # check-then-act: see `conditional`
            with self._cas():
                if _digest_tag(self.get(name)) != (None if if_absent else if_match):
                    raise PreconditionFailed(f"{what}: the object changed")
                self.call(what, self._put, self.key(name), body)
            return
        self.call(what, self._put, self.key(name), body, IfMatch=if_match, IfNoneMatch="*" if if_absent else None)

    def _put(self, key: str, data: bytes | bytearray, IfMatch: str | None = None, IfNoneMatch: str | None = None) -> None:  # noqa: N803 - S3's names
        if self.s3:
            bucket, path, _ = self.fs.split_path(key)
            cond = {k: v for k, v in (("IfMatch", IfMatch), ("IfNoneMatch", IfNoneMatch)) if v}
            try:
                self.fs.call_s3("put_object", Bucket=bucket, Key=path, Body=data, **cond)
            finally:
                self.fs.invalidate_cache(key)
        else:
            self.ensure_dir()
            self.fs.pipe_file(key, data)

    def remove_dir_if_empty(self) -> None:
        """Remove the prefix itself when nothing is left under it, on backends with directories
        (``memory://``, ``file://``; an S3 prefix does not exist without objects)."""
        if self.s3 or self.listing():
            return
        try:
            self.fs.rmdir(self.root)
        except (OSError, NotImplementedError):
            pass  # something appeared meanwhile, or the backend has no rmdir: it stays
        self.fs.invalidate_cache(self.root)

    def delete_if(self, name: str, tag: str | None) -> None:
        """Remove object ``name`` only if it still has ``tag`` (:meth:`get_tagged`; unconditional
        when None or not :attr:`conditional`).

        Raises:
            PreconditionFailed: it changed (nothing removed). ObjectStoreError: failed for good."""
        if not self.s3:
            with self._cas():
                if tag is not None and _digest_tag(self.get(name)) not in (tag, None):
                    raise PreconditionFailed(f"removing {self.url_of(name)}: the object changed")
                return self.delete([name])
        if not tag:
            return self.delete([name])
        bucket, path, _ = self.fs.split_path(self.key(name))
        try:
            self.call(f"removing {self.url_of(name)}", self.fs.call_s3, "delete_object", Bucket=bucket, Key=path, IfMatch=tag)
        except FileNotFoundError:
            pass
        self.fs.invalidate_cache(self.root)

    def uploads(self) -> list[tuple[str, str]]:
        """``[(name, upload_id)]`` of the incomplete multipart uploads of objects directly under
        the prefix (S3; ``[]`` on backends without multipart uploads). Their parts are stored
        (and billed) but no listing shows them."""
        if not self.s3:
            return []
        bucket, path, _ = self.fs.split_path(self.root + "/")
        out, marker = [], {}
        while True:
            r = self.call(
                f"listing uploads under {self.url}", self.fs.call_s3, "list_multipart_uploads", Bucket=bucket,
                Prefix=path, **marker,
            )  # fmt: skip
            for u in r.get("Uploads", []) or []:
                name = u["Key"][len(path) :]
                if name and "/" not in name:
                    out.append((name, u["UploadId"]))
            if not r.get("IsTruncated"):
                return out
            marker = {"KeyMarker": r.get("NextKeyMarker", ""), "UploadIdMarker": r.get("NextUploadIdMarker", "")}

    def abort_upload(self, name: str, upload_id: str) -> None:
        """Abort incomplete multipart upload ``upload_id`` of object ``name`` (its parts are freed)."""
        bucket, path, _ = self.fs.split_path(self.key(name))
        try:
            self.call(
                f"aborting the upload of {self.url_of(name)}", self.fs.call_s3, "abort_multipart_upload", Bucket=bucket,
                Key=path, UploadId=upload_id,
            )  # fmt: skip
        except FileNotFoundError:
            pass  # already completed or aborted

    def ensure_dir(self) -> None:
        """Create the prefix on backends with real directories (``file://``); once per store."""
        if not self.s3 and not getattr(self, "_dir_made", False):
            self.fs.makedirs(self.root, exist_ok=True)
            self._dir_made = True

    def delete(self, names: Sequence[str]) -> None:
        """Remove objects ``names`` (missing ones are skipped)."""
        for name in names:
            try:
                self.call(f"removing {self.url_of(name)}", self.fs.rm_file, self.key(name))
            except FileNotFoundError:
                pass
        self.fs.invalidate_cache(self.root)

    def open_writer(
        self, name: str, size: int | None = None, if_match: str | None = None, if_absent: bool = False
    ) -> ObjectWriter:
        """A streaming writer of object ``name`` (see module docstring); the object appears only
        when :meth:`ObjectWriter.close` returns; :meth:`ObjectWriter.abort` drops it. ``size``:
        the object's byte size when known; one that fits in the upload budget
        (``part_size * parts_in_flight``) is sent as one PUT (no multipart requests).
        ``if_match`` / ``if_absent``: as :meth:`put`'s, for the object this writer replaces (S3:
        a conditional PUT or CompleteMultipartUpload; elsewhere checked as the upload opens,
        atomically for ``memory://``); a condition that fails raises
        :class:`PreconditionFailed` from ``write`` or ``close``."""
        return ObjectWriter(self, name, size, if_match, if_absent)


class ObjectWriter:
    """Bounded streaming upload of one object: :meth:`write` buffers parts of ``part_size`` bytes
    and hands full ones to upload threads; at most ``parts_in_flight`` part buffers exist at once
    (a writer blocks until one is free). Not thread-safe: one writer per thread."""

    def __init__(
        self, store: ObjectStore, name: str, size: int | None = None, if_match: str | None = None, if_absent: bool = False
    ):
        self.store, self.name = store, name
        self._if_match, self._if_absent = if_match, if_absent
        cfg = store.transfer
        self.part_size = max(cfg.part_size, S3_MIN_PART) if store.s3 else cfg.part_size
        self._single = size is not None and 0 < size <= cfg.part_size * cfg.parts_in_flight
        if self._single:
            self.part_size = size  # one buffer, one PUT (close): within the same memory budget
        self._slots = threading.BoundedSemaphore(cfg.parts_in_flight)
        self._pool = ThreadPoolExecutor(cfg.parts_in_flight, thread_name_prefix="fqnckpt-upload")
        self._buf: bytearray | None = None
        self._len = 0
        self._futures: list[Future] = []
        self._parts: dict[int, str] = {}
        self._upload_id: str | None = None
        self._file = None  # non-S3 backends: the fsspec file written in order
        self._lock = threading.Lock()  # non-S3: parts are written in order, one at a time
        self._next_part = 1
        self._written_part = 0
        self._cond = threading.Condition(self._lock)
        self.size = 0

    # -- filling -------------------------------------------------------------------------------
    def write(self, data) -> None:
        view = memoryview(data).cast("B")
        while len(view):
            if self._buf is None:
                self._raise_failed()
                self._slots.acquire()
                self._buf, self._len = bytearray(self.part_size), 0
                _buffered(self.part_size)
            n = min(len(view), self.part_size - self._len)
            self._buf[self._len : self._len + n] = view[:n]
            self._len += n
            self.size += n
            view = view[n:]
            if self._len == self.part_size and not self._single:
                self._submit()
            elif self._single and len(view) and self._len == self.part_size:
                raise ValueError(f"{self.store.url_of(self.name)}: more bytes written than the {self.part_size} declared")

    def _raise_failed(self) -> None:
        for f in self._futures:
            if f.done() and f.exception() is not None:
                raise f.exception()

    def _submit(self) -> None:
        buf, n = self._buf, self._len
        self._buf, self._len = None, 0
        number = self._next_part
        self._next_part += 1
        body = buf if n == len(buf) else bytes(memoryview(buf)[:n])
        fut = self._pool.submit(self._upload_part, number, body)

        def release(_f, size=len(buf)) -> None:
            _buffered(-size)
            self._slots.release()

        fut.add_done_callback(release)
        self._futures.append(fut)

    # -- sending -------------------------------------------------------------------------------
    def _ensure_started(self) -> None:
        st = self.store
        if st.s3:
            if self._upload_id is None:
                bucket, path, _ = st.fs.split_path(st.key(self.name))
                r = st.call(
                    f"writing {st.url_of(self.name)}", st.fs.call_s3, "create_multipart_upload", Bucket=bucket, Key=path
                )
                self._upload_id = r["UploadId"]
        elif self._file is None:
            st.ensure_dir()
            cond = self._if_match is not None or self._if_absent
            with st._cas() if cond else contextlib.nullcontext():  # memory:// shows the object from its open
                if cond and _digest_tag(st.get(self.name)) != (None if self._if_absent else self._if_match):
                    raise PreconditionFailed(f"writing {st.url_of(self.name)}: the object changed")
                self._file = st.call(f"writing {st.url_of(self.name)}", st.fs.open, st.key(self.name), "wb")

    def _upload_part(self, number: int, body) -> None:
        st = self.store
        what = f"writing {st.url_of(self.name)} (part {number})"
        if st.s3:
            with self._lock:
                self._ensure_started()
            bucket, path, _ = st.fs.split_path(st.key(self.name))
            r = st.call(
                what, st.fs.call_s3, "upload_part", Bucket=bucket, Key=path, UploadId=self._upload_id,
                PartNumber=number, Body=body,
            )  # fmt: skip
            with self._lock:
                self._parts[number] = r["ETag"]
        else:
            with self._cond:  # an fsspec file is written front to back
                while self._written_part != number - 1:
                    self._cond.wait()
                try:
                    self._ensure_started()
                    st.call(what, self._file.write, body)
                finally:
                    self._written_part = number
                    self._cond.notify_all()
        with _stats_lock:
            stats.parts += 1
        faults.fault_point("after_part_upload")

    def close(self) -> None:
        """Send what is buffered, wait for every part, complete the upload (the object appears).

        Raises:
            PreconditionFailed: the writer's ``if_match`` / ``if_absent`` did not hold (the
                upload is aborted, nothing replaced).
            ObjectStoreError: a part or the completion failed for good (the upload is aborted).
        """
        st = self.store
        if_match, if_absent = self._if_match, self._if_absent
        cond = {k: v for k, v in (("IfMatch", if_match), ("IfNoneMatch", "*" if if_absent else None)) if v}
        try:
            if st.s3 and self._upload_id is None and not self._futures:  # one buffer: one PUT
                buf = self._buf if self._buf is not None else bytearray()
                body = buf if self._len == len(buf) else bytes(memoryview(buf)[: self._len])
                self._free_buf()
                st.put(self.name, body, if_match=if_match, if_absent=if_absent)
                with _stats_lock:
                    stats.objects += 1
                return
            if self._buf is not None and (self._len or not self._futures):
                self._submit()
            for f in self._futures:
                f.result()
            if st.s3:
                bucket, path, _ = st.fs.split_path(st.key(self.name))
                parts = [{"PartNumber": n, "ETag": self._parts[n]} for n in sorted(self._parts)]
                st.call(
                    f"writing {st.url_of(self.name)}", st.fs.call_s3, "complete_multipart_upload", Bucket=bucket,
                    Key=path, UploadId=self._upload_id, MultipartUpload={"Parts": parts}, **cond,
                )  # fmt: skip
                st.fs.invalidate_cache(st.key(self.name))
            else:
                self._ensure_started()
                st.call(f"writing {st.url_of(self.name)}", self._file.close)
        except BaseException:
            self.abort()
            raise
        finally:
            ownership.settle(self._futures)  # every part sent or failed, Ctrl-C included
            self._pool.shutdown(wait=True)
        with _stats_lock:
            stats.objects += 1

    def _free_buf(self) -> None:
        if self._buf is not None:
            self._buf = None
            _buffered(-self.part_size)
            self._slots.release()

    def abort(self) -> None:
        """Drop the upload (best effort; parts already sent are discarded by the store)."""
        for f in self._futures:
            f.cancel()
        ownership.settle(self._futures)  # no part in flight once the upload is aborted (rule 1)
        self._pool.shutdown(wait=True)
        self._free_buf()
        st = self.store
        try:
            if st.s3 and self._upload_id is not None:
                bucket, path, _ = st.fs.split_path(st.key(self.name))
                st.fs.call_s3("abort_multipart_upload", Bucket=bucket, Key=path, UploadId=self._upload_id)
                self._upload_id = None
            elif self._file is not None:
                f, self._file = self._file, None
                if hasattr(f, "discard"):
                    f.discard()
                else:
                    f.close()
                    st.fs.rm_file(st.key(self.name))
        except Exception:  # noqa: BLE001 - the original error is the one to report
            pass


def open_store(
    url: str, storage_options: Mapping | None = None, transfer: TransferConfig | None = None
) -> ObjectStore:
    """The :class:`ObjectStore` of URL prefix ``url``; ``storage_options`` go to the fsspec
    filesystem (for s3fs e.g. ``{"endpoint_url": ..., "key": ..., "secret": ...}``).

    Raises:
        UnsupportedStorageError: fsspec or the backend of the URL's scheme is not installed, or
            fsspec knows no such scheme.
    """
    scheme = url_scheme(url)
    shown = redact_url(url)
    try:
        import fsspec
    except ImportError:
        raise UnsupportedStorageError(shown, scheme, "fsspec is not installed") from None
    register(storage_options)  # every later message of this process scrubs these
    register(fsspec.config.conf.get(scheme))  # options from FSSPEC_<SCHEME>_* / fsspec's config files
    scrub = scrubber(storage_options)
    try:
        cls = fsspec.get_filesystem_class(scheme)
    except (ValueError, ImportError) as e:
        raise UnsupportedStorageError(shown, scheme, scrub(str(e))) from None
    try:
        fs = cls(**dict(storage_options or {}))
    except Exception as e:  # noqa: BLE001 - bad options: named, credentials removed
        raise UnsupportedStorageError(shown, scheme, f"storage_options rejected: {type(e).__name__}: {scrub(str(e))}") from None
    root = cls._strip_protocol(url)
    if isinstance(root, list):  # pragma: no cover - chained URLs
        root = root[0]
    return ObjectStore(url, fs, root, storage_options, transfer or TransferConfig())


__all__ = ["ObjectStore", "ObjectWriter", "ObjectStoreError", "ObjectChangedError", "ObjectVersion", "PreconditionFailed", "TransferConfig", "open_store", "is_transient", "stats"]
