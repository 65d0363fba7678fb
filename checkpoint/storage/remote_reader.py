"""Read a checkpoint on object storage (see :mod:`checkpoint.storage.commit`) with ranged
reads only: per shard object one GET of its header, then per tensor (or per rank's slice of it)
only its byte ranges.

One checkpoint, whole: a :class:`~.views.CheckpointView` fetches the model index (the commit marker) once;
the optimizer part and the extra-state files are the objects that index names, so a reader
never mixes two saves. Everything is checked before any tensor is returned, as for a local
checkpoint (:mod:`checkpoint.storage.reader`): named objects exist with the recorded sizes,
headers are valid, the index matches them.

Headers are validated by safetensors itself: its Python API validates a header only through
``safe_open`` (a local path, memory-mapped) or ``deserialize`` (the whole file's bytes), so the
fetched header bytes go through the local reader's own check
(:func:`~.st_header.header_of_bytes`: a sealed in-memory copy of the object's size, the data a
hole, opened with ``safe_open``; no data bytes stored or fetched).

Every read of a shard object is pinned to the object the load opened (S3; see
:mod:`checkpoint.storage.objstore`): the first GET of each shard (its header) records its
``VersionId`` (a versioned bucket) or ``ETag``, and every later GET of it (the rest of the header,
the data check, the copies, ``verify``) names that version or sends ``If-Match``. The bytes copied
into a target are then the bytes checked, even for tensors fetched again for their copy (``Shard(0)``
row blocks, tensors past :data:`_STAGE_MAX`): on a versioned bucket the checked version is
copied whatever was written since; otherwise an overwrite (or removal) is a
CorruptCheckpointError naming object and tensor ("changed while being loaded"), never unknown
bytes. :meth:`RemoteCheckpointReader.confirm_unchanged` (one HEAD per object, run by a load after
its check) raises it before any target is written.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Mapping, Sequence

import torch
from torch.autograd.graph import increment_version

from ..errors import (
    ChecksumMismatchError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    LoadError,
    MissingShardError,
)
from . import digest as _digest
from . import paths
from .format import MODEL_PREFIX, FileRecordV2, index_name
from .objstore import ObjectChangedError, ObjectVersion
from .layout import ST_TO_DTYPE
from .read_check import row_chunks
from .reader import (
    CheckpointReader,
    FileDigestCheck,
    check_total_size,
    is_whole_block,
    block_slices,
    compare_record,
)
from .views import CheckpointView
from .st_header import header_of_bytes, parse_index_bytes
from .writer import block_runs, stats, tensor_bytes

_HEAD_GUESS = 64 << 10  # first ranged GET per shard: the header of most files fits
_VERIFY_CHUNK = 16 << 20
_READ_AHEAD = 64 << 20  # bytes fetched ahead at once (RemoteCheckpointReader.expect)
_RANGE_MAX = 16 << 20  # bytes per coalesced ranged GET
# Bytes of checked tensors kept between a load's check and its copies (RemoteCheckpointReader.check_first):
# a tensor kept is fetched once; past this, a tensor is fetched again for its copy (memory bounded), from
# the object version it was checked in (RemoteCheckpointReader._pins).
_STAGE_MAX = 1 << 30


def new_pins(store) -> dict[str, ObjectVersion] | None:
    """An empty pin table for reads of ``store`` (filled by each object's first GET), or None
    for a store without pinned reads (it has no ``check_versions``: local, ``memory://``)."""
    return {} if hasattr(store, "check_versions") else None


def pinned_range(store, name: str, start: int, end: int, pins: dict[str, ObjectVersion] | None) -> bytes:
    """Bytes ``[start, end)`` of object ``name`` of ``store``: the first GET of ``name`` records
    its version in ``pins`` (:func:`new_pins`), every later one names that version or sends
    ``If-Match`` (S3; a plain ranged GET where ``pins`` is None).

    Raises:
        ObjectChangedError: ``name`` was overwritten or removed since its first GET.
        LoadError / FileNotFoundError: as :meth:`checkpoint.storage.objstore.ObjectStore.get_range`."""
    if pins is None:
        return store.get_range(name, start, end)
    return store.get_range(name, start, end, pins=pins)


def pinned_size(store, name: str, listed: int, pins: dict[str, ObjectVersion] | None) -> int:
    """The size of object ``name`` of ``store`` at the version ``pins`` holds for it (pinned
    here by a HEAD when it holds none: S3), or ``listed`` (its size in a listing) where ``pins``
    is None; reads through :func:`pinned_range` of ``[0, size)`` cover exactly that object.

    Raises what :meth:`checkpoint.storage.objstore.ObjectStore.pinned_size` raises."""
    return listed if pins is None else store.pinned_size(name, pins)


class RemoteCheckpointReader(CheckpointReader):
    """A validated checkpoint on object storage; the API of :class:`CheckpointReader`, every read
    a ranged GET (``root`` is the checkpoint's URL)."""

    def __init__(
        self, view: CheckpointView, index, index_name_: str | None, key_file, sizes: dict[str, int],
        pins: dict[str, ObjectVersion] | None = None,
    ):  # fmt: skip
        store = view.store
        super().__init__(store.url, index, store.url_of(index_name_) if index_name_ else None, key_file)
        self.view, self.store, self._sizes = view, store, sizes
        self.index_raw = b""  # the index object's bytes (set by open_remote_checkpoint)
        self._totals: dict[str, int] = {}  # data bytes per shard header (verify)
        self._heads: dict[str, bytes] = {}  # first bytes of each shard, fetched together
        self._staged: dict[str, memoryview] = {}  # tensors check_first fetched, kept for their copy
        # The version of each shard object its first GET answered (S3): every later GET reads that one.
        # None: a store without pinned reads (it has no ``check_versions``).
        self._pins = pins if pins is not None else new_pins(store)

    def _range(self, name: str, start: int, end: int) -> bytes:
        """Bytes ``[start, end)`` of shard object ``name``, at its pinned version."""
        return pinned_range(self.store, name, start, end, self._pins)

    def _many(self, spans: Sequence[tuple[str, int, int]]) -> list[bytes]:
        """Byte ranges ``(name, start, end)`` of shard objects, concurrently, at their pinned versions."""
        if self._pins is None:
            return self.store.get_many(spans)
        return self.store.get_many(spans, pins=self._pins)

    def confirm_unchanged(self) -> None:
        """Confirm, before the copies start, that every shard object this reader opened and may
        fetch again (a tensor not kept by :meth:`check_first`) is still the object it opened: one
        HEAD per object at its pinned version (S3; nothing elsewhere). A load runs it after its
        check, so an overwrite since the open is refused before any target is written.

        What remains possible: on a bucket without versioning, an overwrite between this HEAD
        and the last ranged GET of the copies is still refused (each GET sends ``If-Match``), but
        mid-copy: targets copied before it hold the checked bytes, the rest are unchanged. On a
        versioned bucket the pinned version is read whatever is written since (only removing
        that version fails the load).

        Raises:
            CorruptCheckpointError: an object was overwritten or removed since it was opened
                (its URL named: "changed while being loaded").
            LoadError: a HEAD failed for good.
        """
        if not self._pins:
            return
        due = {f for k, f in self._key_file.items() if k not in self._staged}
        try:
            self.store.check_versions({f: v for f, v in self._pins.items() if f in due})
        except ObjectChangedError as e:
            raise CorruptCheckpointError(e.file, e.why) from None

    # -- headers --------------------------------------------------------------------------------
    def _open_file(self, name: str):
        size = self._sizes[name]
        where = self.store.url_of(name)
        first = self._heads.pop(name, None)
        if first is None:
            first = self._range(name, 0, min(size, _HEAD_GUESS))
        if len(first) < 8:
            raise CorruptCheckpointError(where, f"not a valid safetensors file: {size} bytes")
        (n,) = struct.unpack("<Q", first[:8])
        if 8 + n > size:
            raise CorruptCheckpointError(where, f"not a valid safetensors file: header of {n} bytes in {size}")
        head_bytes = first[: 8 + n] if 8 + n <= len(first) else first + self._range(name, len(first), 8 + n)
        head = header_of_bytes(head_bytes, size, where, header_digest=self.recorded_header(name))[1]
        self._totals[name] = sum(
            v["data_offsets"][1] - v["data_offsets"][0] for k, v in head.items() if k != "__metadata__"
        )
        return None, head, 8 + n

    # -- data -----------------------------------------------------------------------------------
    def _span(self, key: str) -> tuple[str, int, int, tuple[int, ...], torch.dtype]:
        name = self._key_file[self._known(key)]
        b, e = self._spans[key]
        shape, st = self._specs[key]
        if st not in ST_TO_DTYPE:
            raise CorruptCheckpointError(self.store.url_of(name), f"tensor {key!r} has dtype {st} torch cannot hold", key=key)
        return name, b, e, shape, ST_TO_DTYPE[st]

    def get(self, key: str) -> torch.Tensor:
        name, b, e, shape, dtype = self._span(key)
        out = torch.empty(shape, dtype=dtype)
        self._fill(tensor_bytes(out), name, [(b, e)], key)
        self.check_digest(key, tensor_bytes(out))  # read whole: checked as local reads are
        return out

    # Not the local batched preadv of CheckpointReader: each tensor goes through read_into (ranged GETs).
    read_many = None

    def copy_into(
        self, key: str, out: torch.Tensor, slices: Sequence[slice] | None = None, check: bool = False
    ) -> bool:
        """:meth:`CheckpointReader.copy_into`'s contract over ranged GETs: tensor ``key`` (or its
        block ``tensor[slices]``) into ``out``, a CPU tensor of that shape in any dtype and layout
        (``copy_``'s conversions), through :meth:`get` / :meth:`get_slice` (no local window to
        copy through). A whole read is checked against its digest (``check`` is implied there);
        a block is not (its digest covers bytes not fetched). False (nothing read) when ``out``
        is not on the CPU.

        Raises:
            CorruptCheckpointError: an object shorter than its index says, or a whole tensor's
                bytes differ from its digest, or its object changed since it was opened ("changed
                while being loaded": URL and tensor named, ``out`` unchanged).
            LoadError: a ranged GET fails.
        """
        if not out.is_cpu:
            return False
        src = self.get(key) if slices is None else self.get_slice(key, slices)
        out.copy_(src)
        return True

    def read_into(self, key: str, out: torch.Tensor) -> bool:
        known = self._specs.get(key)
        if (
            known is None or key not in self._key_file or out.device.type != "cpu"
            or tuple(out.shape) != tuple(known[0]) or ST_TO_DTYPE.get(known[1]) != out.dtype
            or not out.is_contiguous() or out.is_conj() or out.is_neg()
        ):  # fmt: skip
            return False
        name, b, e, _, _ = self._span(key)
        self.check_first([key])  # fetched, checked and kept: ``out`` is written only with checked bytes
        try:
            self._fill(tensor_bytes(out), name, [(b, e)], key)
        finally:
            increment_version(out)  # written behind torch's back, as copy_ would count it
        return True

    def get_slice(self, key: str, slices: Sequence[slice]) -> torch.Tensor:
        """Only the bytes of block ``tensor[slices]`` (step-1 slices), as few ranged GETs as the
        block's contiguous runs need (one covering GET when that reads at most twice the bytes)."""
        name, b, _, shape, dtype = self._span(key)
        slices = block_slices(key, shape, slices)
        if is_whole_block(shape, slices):
            return self.get(key)  # the whole tensor: checked against its digest like any whole read
        starts, lens = [], []
        for s, dim in zip(tuple(slices) + (slice(None),) * (len(shape) - len(slices)), shape):
            lo, hi, step = s.indices(dim)
            if step != 1:
                return self.get(key)[tuple(slices)]
            starts.append(lo)
            lens.append(max(hi - lo, 0))
        out = torch.empty(lens, dtype=dtype)
        if out.numel() == 0:
            return out
        item = dtype.itemsize
        runs = list(block_runs(shape, lens, starts))
        spans = [(b + g * item, b + (g + n) * item) for g, _, n in runs]
        self._fill(tensor_bytes(out), name, spans, key)
        return out

    def _fill(self, dst: memoryview, name: str, spans: list[tuple[int, int]], key: str) -> None:
        """Bytes ``spans`` of object ``name``, concatenated, into ``dst`` (a read failing for
        good is a LoadError naming tensor ``key``)."""
        try:
            self._fill_spans(dst, name, spans, key)
        except ObjectChangedError as e:
            raise CorruptCheckpointError(e.file, f"tensor {key!r}: {e.why}", key=key) from None
        except LoadError as e:
            raise LoadError(key, e.file, str(e).split(" failed: ", 1)[-1]) from None
        except CorruptCheckpointError as e:
            if e.key is not None:
                raise
            why = str(e).removeprefix(f"{e.file}: ")
            raise CorruptCheckpointError(e.file, f"tensor {key!r}: {why} (changed or cut since it was opened?)", key=key) from None

    def check_first(
        self, keys: Iterable[str] = (), rows: Mapping[str, Sequence[tuple[int, int]]] | None = None
    ) -> dict[str, dict[int, bytes]]:
        """:meth:`CheckpointReader.check_first` over ranged GETs: each tensor of ``keys`` is
        fetched whole and checked before any target is written; it is then kept (up to
        :data:`_STAGE_MAX` bytes in all) for the copy that follows, so a load fetches it once; the
        format-3 chunks starting in ``rows``' ranges are fetched whole and hashed.

        Raises:
            CorruptCheckpointError: a tensor's bytes differ from its digest, or its object is
                shorter than its index says, or changed since it was opened ("changed while
                being loaded") (URL and tensor named); no target written.
            LoadError: a ranged GET fails.
        """
        chunk = self.digest_chunk
        whole, parts = self._due_checks(keys, rows)
        room = _STAGE_MAX - sum(len(v) for v in self._staged.values())
        for k in whole:
            name, b, e, _, _ = self._span(k)
            buf = memoryview(bytearray(e - b))
            self._fill(buf, name, [(b, e)], k)
            self.check_digest(k, buf)
            self._checked.add(k)
            if e - b <= room:
                self._staged[k] = buf
                room -= e - b
        out: dict[str, dict[int, bytes]] = {}
        for k, ranges in parts.items():
            name, b, e, _, _ = self._span(k)
            got = out.setdefault(k, {})
            for lo, hi in ranges:
                first, stop = row_chunks(e - b, chunk, lo, hi)
                if first >= stop:
                    continue
                a, z = b + first * chunk, min(e, b + stop * chunk)
                buf = memoryview(bytearray(z - a))
                self._fill(buf, name, [(a, z)], k)
                for i in range(first, stop):
                    got[i] = _digest.chunk_digest(buf[(i - first) * chunk : (i - first + 1) * chunk])
        return out

    def expect(self, keys: Sequence[str]) -> None:
        """Hint: whole tensors ``keys`` will be read in this order. They are then fetched ahead,
        a batch of at most 64 MiB at a time, in ranged GETs of adjacent tensors (up to 16 MiB
        each) sent concurrently: fewer, larger requests, memory bounded by the batch."""
        self._ahead = [(self._key_file[k], *self._spans[k]) for k in keys if k in self._spans and k in self._key_file]
        self._ahead_at = {span: i for i, span in enumerate(self._ahead)}
        self._cache: dict[tuple[str, int, int], memoryview] = {}

    def _read_ahead(self, i: int) -> None:
        batch, total = [], 0
        for span in self._ahead[i:]:
            size = span[2] - span[1]
            if batch and total + size > _READ_AHEAD:
                break
            if span not in self._cache:
                batch.append(span)
                total += size
        ranges: list[list] = []  # [name, lo, hi, [spans]]
        for span in sorted(batch):
            name, b, e = span
            last = ranges[-1] if ranges else None
            if last is not None and last[0] == name and last[2] == b and e - last[1] <= _RANGE_MAX:
                last[2] = e
                last[3].append(span)
            else:
                ranges.append([name, b, e, [span]])
        for (name, lo, hi, spans), data in zip(ranges, self._many([(n, lo, hi) for n, lo, hi, _ in ranges])):
            if len(data) != hi - lo:
                raise CorruptCheckpointError(self.store.url_of(name), f"object ends early ({len(data)} of {hi - lo} bytes at {lo})")
            view = memoryview(data)
            for span in spans:
                self._cache[span] = view[span[1] - lo : span[2] - lo]

    def _fill_spans(self, dst: memoryview, name: str, spans: list[tuple[int, int]], key: str = "") -> None:
        need = sum(e - b for b, e in spans)
        if need == 0:
            return
        staged = self._staged.get(key)
        if staged is not None and len(spans) == 1 and spans[0] == self._spans.get(key):  # fetched by check_first
            dst[:need] = self._staged.pop(key)
            return
        ahead = getattr(self, "_ahead_at", {})
        if len(spans) == 1 and (name, *spans[0]) in ahead:  # expected: served from the read-ahead
            span = (name, *spans[0])
            if span not in self._cache:
                self._read_ahead(ahead[span])
            dst[:need] = self._cache.pop(span)
            stats.bytes_read += need
            return
        lo, hi = spans[0][0], spans[-1][1]
        if len(spans) == 1 or hi - lo <= 2 * need:
            data = self._range(name, lo, hi)
            if len(data) != hi - lo:
                raise CorruptCheckpointError(self.store.url_of(name), f"object ends early ({len(data)} of {hi - lo} bytes at {lo})")
            at = 0
            for b, e in spans:
                dst[at : at + e - b] = memoryview(data)[b - lo : e - lo]
                at += e - b
        else:
            at = 0
            got = self.store.get_ranges(name, spans) if self._pins is None else self.store.get_ranges(name, spans, pins=self._pins)
            for (b, e), data in zip(spans, got):
                if len(data) != e - b:
                    raise CorruptCheckpointError(self.store.url_of(name), f"object ends early ({len(data)} of {e - b} bytes at {b})")
                dst[at : at + e - b] = data
                at += e - b
        stats.bytes_read += need

    # -- integrity ------------------------------------------------------------------------------
    def verify_file(self, name: str) -> str:
        if name not in self.files:
            raise KeyError(f"{name!r} is not a file of {self.root}; files: {self.files}")
        rec = self.meta.files.get(name) if self.meta else None
        check = self._hash_object(name, rec)
        if check.problem is not None:
            raise ChecksumMismatchError(self.store.url_of(name), rec.digest if rec else "", f"{check.digest} ({check.problem})")
        return check.digest

    def check_file(self, name: str) -> FileDigestCheck:
        return self._hash_object(name, self.meta.files.get(name) if self.meta else None)

    def header_total(self, name: str) -> int:
        return self._totals[name]

    def _hash_object(self, name: str, rec) -> FileDigestCheck:
        """Format-version-2 digests of object ``name``, read in ranged pieces of 16 MiB."""
        size = self._sizes[name]
        (n,) = struct.unpack("<Q", self._range(name, 0, 8))
        header = _digest.hexdigest(self._range(name, 0, 8 + n))
        spans = sorted(
            (b, e, k) for k, (b, e) in self._spans.items() if self._key_file.get(k) == name
        )
        tensors = {}
        for b, e, k in spans:
            h = _digest.tensor_hasher(self.digest_chunk)
            for lo in range(b, e, _VERIFY_CHUNK):
                h.update(self._range(name, lo, min(e, lo + _VERIFY_CHUNK)))
            tensors[k] = h.hexdigest()
        if not isinstance(rec, FileRecordV2):  # written by another tool: nothing to compare with
            return FileDigestCheck(size, "xxh3_128", _digest.combine(header, tensors.values()), tensors, None)
        return compare_record(rec, size, header, tensors)

    def _index_bytes(self) -> bytes:
        return self.index_raw

    def open_part(self, prefix: str) -> CheckpointReader | None:
        obj = self.view.object_of(index_name(prefix))
        if obj is None:
            return None
        if self.view.member_bytes(index_name(prefix)) is None:
            if self.meta is not None and self.meta.objects is not None:  # recorded by the save, gone since
                raise MissingShardError(self.root, [obj], index_name(MODEL_PREFIX))
            return None
        return open_remote_checkpoint(self.view, prefix, check_headers=self.check_headers)

    def held_path(self, name: str) -> str:
        return self.store.url_of(name)

    def close(self) -> None:
        """Nothing to release: no file is held open (every read is a ranged GET)."""

    def __del__(self) -> None:
        pass

    def __repr__(self) -> str:
        return f"RemoteCheckpointReader({self.root!r}, {len(self._key_file)} tensors in {len(self.files)} files)"


def open_remote_checkpoint(
    view: CheckpointView, prefix: str = MODEL_PREFIX, *, check_headers: bool = True
) -> RemoteCheckpointReader:
    """Open and validate part ``prefix`` of the checkpoint of ``view`` (errors as
    :func:`checkpoint.storage.reader.open_local_checkpoint`, naming URLs; ``check_headers`` as there).

    Raises:
        CheckpointNotFoundError: no model index (nothing committed there) and no single
            ``<prefix>.safetensors``.
        MissingShardError: objects the index names are absent (e.g. deleted by a newer save).
    """
    store = view.store
    name = index_name(prefix)
    obj = view.object_of(name)
    raw = view.member_bytes(name) if obj is not None else None
    if raw is None:
        listing = store.listing()
        sizes = {n: size for n, (kind, size) in listing.items() if kind != "directory"}
        single = f"{prefix}.safetensors"
        if view.index_raw is None and single in sizes:
            reader = RemoteCheckpointReader(view, None, None, {}, sizes)
            _, head, _ = reader._open_file(single)
            reader._key_file = {k: single for k in head if k != "__metadata__"}
            reader.files = [single]
            reader._load_headers()
            return reader
        why = f"no {name}" + (" (a save that never committed, or not a checkpoint)" if prefix == MODEL_PREFIX else "")
        raise CheckpointNotFoundError(store.url, why)
    index = parse_index_bytes(raw, store.url_of(obj))
    files = index.files()
    for f in files:
        paths.check_name(store.url, f)
    meta = index.metadata.fqnckpt
    if meta is not None and set(meta.files) != set(files):
        raise CorruptCheckpointError(
            store.url_of(obj), f"metadata.fqnckpt.files {sorted(meta.files)} differ from the weight_map's files {files}"
        )
    heads: dict[str, bytes] = {}
    pins: dict[str, ObjectVersion] | None = {} if hasattr(store, "check_versions") else None
    if meta is not None:  # sizes recorded: every shard's first bytes in one concurrent batch
        sizes = {f: meta.files[f].size for f in files}
        spans = [(f, 0, min(sizes[f], _HEAD_GUESS)) for f in files]
        try:  # (these GETs pin each object: see RemoteCheckpointReader._pins)
            got = store.get_many(spans) if pins is None else store.get_many(spans, pins=pins)
        except FileNotFoundError:
            got = None
        if got is None:
            listing = store.listing()
            raise MissingShardError(store.url, [f for f in files if f not in listing] or files, name)
        heads = dict(zip(files, got))
        short = [f for f in files if len(heads[f]) < min(sizes[f], _HEAD_GUESS)]
        if short:
            raise CorruptCheckpointError(store.url_of(short[0]), f"is shorter than the {sizes[short[0]]} bytes the index records")
    else:  # written by another tool: sizes from a listing
        listing = store.listing()
        sizes = {n: size for n, (kind, size) in listing.items() if kind != "directory"}
        missing = [f for f in files if f not in sizes]
        if missing:
            raise MissingShardError(store.url, missing, name)
    reader = RemoteCheckpointReader(view, index, obj, dict(index.weight_map), sizes, pins)
    reader.check_headers = check_headers
    reader.index_raw = raw
    reader._heads = heads
    reader._load_headers()
    check_total_size(reader)
    return reader


__all__ = ["RemoteCheckpointReader", "open_remote_checkpoint"]
