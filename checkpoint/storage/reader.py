"""Read a checkpoint: an index directory, a directory with one ``model.safetensors``, or one file.

The index is authoritative: only files it names are opened (a stray ``.safetensors`` is ignored
with a warning), and everything is validated before any tensor is returned — a named file that is
missing, an entry leading outside the directory, a tensor missing from its file or stored in two
files, a corrupt header. Headers are validated by ``safetensors.safe_open`` (which also rejects
overlapping / out-of-range offsets, size-vs-shape mismatches and truncated files) on a private
copy of the header bytes read through the reader's descriptor
(:func:`~.st_header.validate_header`: a header is never read through a mapping, so a file cut
while read cannot SIGBUS); tensor bytes are read with ``preadv``, whole tensors or only the
slices a rank needs, or, inside a load (:meth:`CheckpointReader.reading`), copied from the file's
mapping held under a read lease (:mod:`~.leased`), which no writer or truncation can change
while the lease holds.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import math
import operator
import os
import struct
import threading
import warnings
from collections.abc import Container, Iterable, Mapping, Sequence

import torch
from torch.autograd.graph import increment_version

from . import local_commit as atomic
from .commit import recorded_object
from ..errors import (
    CheckpointError,
    LoadError,
    CheckpointNotFoundError,
    ChecksumMismatchError,
    CorruptCheckpointError,
    DuplicateTensorError,
    MissingShardError,
    TensorNotInShardError,
)
from . import digest as _digest
from . import paths
from .dir_layout import check_one_layout
from .urls import is_url
from .format import (
    MODEL_PREFIX,
    OPTIMIZER_PREFIX,
    FileRecord,
    FileRecordV2,
    FqnckptMeta,
    IndexFile,
    index_name,
)
from .layout import DTYPE_TO_ST, ST_TO_DTYPE, TensorSpec
from . import leased as _leased
from . import pread as _pread
from . import read_check as _read_check
from .read_check import check_tensor_digest
from . import tensor_read as _tread
from .pread import read_runs
# Torch-free: fqnckpt inspect reads headers and indexes through it without torch.
from .st_header import PACKED, open_safetensors_with_header, read_index, torch_shape
from .writer import NUMPY_DTYPES, sha256_file, stats, tensor_bytes

class _Hashed:
    """A digest already computed, in the form :meth:`CheckpointReader.check_digest` takes."""

    __slots__ = ("value",)

    def __init__(self, value: str):
        self.value = value

    def hexdigest(self) -> str:
        return self.value


_MAP_MIN = 1 << 20  # bytes of one file a span reads at once before it maps the file (_lease)


def _stamp(fd: int) -> tuple[int, int, int]:
    """What a write to the open file ``fd`` changes: its size and modification time (with its
    inode). Not its change time: a save replacing the checkpoint renames and unlinks the old
    files, which changes theirs (and so the file this descriptor reads) without a byte written."""
    st = os.fstat(fd)
    return st.st_ino, st.st_size, st.st_mtime_ns


def _in_span(method):
    """``method`` run inside :meth:`CheckpointReader.reading` (its leases given back at its end
    unless an outer span holds them)."""

    @functools.wraps(method)
    def run(self, *args, **kwargs):
        self._span_start()  # (reading() without a generator's cost: get runs once per tensor)
        try:
            return method(self, *args, **kwargs)
        finally:
            self._span_end()

    return run


class StrayFileWarning(UserWarning):
    """A ``.safetensors`` file in the checkpoint directory is not named by the index (not read)."""


def _torch_shape(name: str, key: str, st: str, shape: list[int]) -> tuple[int, ...]:
    """:func:`~.st_header.torch_shape` of a packed dtype's header shape (F4: two values a byte).

    Raises:
        CorruptCheckpointError: naming file and tensor, a shape not ending in whole bytes."""
    try:
        return torch_shape(st, shape)
    except ValueError as e:
        raise CorruptCheckpointError(name, f"tensor {key!r}: {e}", key=key) from None


def _safe_member(root: str, entry: str) -> str:
    """Absolute path of index entry ``entry`` inside ``root``, under the one symlink rule of
    :mod:`checkpoint.storage.paths` (plain file names; symlinks only into the checkpoint directory
    or, for a hub-cache snapshot, into its cached repository)."""
    return paths.member(root, entry)


def open_safetensors(path: str):
    """``safetensors.safe_open`` of ``path``'s validated header plus the one check it lacks: a
    tensor name appearing twice in the JSON header (safetensors keeps the last entry silently).
    The handle is for keys and metadata only: it maps a private copy holding the header and a
    hole, never the file (:func:`~.st_header.validate_header`); its tensors would read as zeros,
    so tensor bytes come from :class:`CheckpointReader`.

    Raises:
        CorruptCheckpointError: safetensors rejects the file (message names the tensor at fault
            where it can, and Git LFS pointers), or the header repeats a tensor name.
    """
    return open_safetensors_with_header(path)[0]


class FileDigestCheck:
    """Result of :func:`check_file`: actual ``size`` (bytes), ``algorithm``, file-level ``digest``,
    per-tensor ``tensors`` digests (version 2) and ``problem`` (None when it matches the record)."""

    __slots__ = ("size", "algorithm", "digest", "tensors", "problem")

    def __init__(self, size: int, algorithm: str, digest: str, tensors: dict[str, str], problem: str | None):
        self.size, self.algorithm, self.digest, self.tensors, self.problem = (
            size,
            algorithm,
            digest,
            tensors,
            problem,
        )


def check_file(path: str, rec: FileRecord | FileRecordV2 | None, chunk: int | None = None) -> FileDigestCheck:
    """Re-hash shard file ``path`` and compare it with its index record ``rec`` (None: nothing to
    compare, sha256 reported); ``chunk``: the index's tensor digest chunk (format version 3, None
    for version 2). The problem text names the header or the tensors whose bytes changed."""
    if not isinstance(rec, FileRecordV2):
        size, d = os.path.getsize(path), sha256_file(path)
        problem = None
        if rec is not None and size != rec.size:
            problem = f"size {size} bytes, index says {rec.size}"
        elif rec is not None and d != rec.sha256:
            problem = "corrupted data"
        return FileDigestCheck(size, "sha256", d, {}, problem)
    size, header, tensors = _digest.hash_file(path, chunk)
    return compare_record(rec, size, header, tensors)


def compare_record(rec: FileRecordV2, size: int, header: str, tensors: dict[str, str]) -> FileDigestCheck:
    """Compare a file's measured size and format-version-2 digests with its index record."""
    d = _digest.combine(header, tensors.values())
    why = []
    if size != rec.size:
        why.append(f"size {size} bytes, index says {rec.size}")
    if header != rec.header:
        why.append("header bytes changed")
    changed = [k for k, v in rec.tensors.items() if tensors.get(k) != v]
    if changed:
        why.append(f"tensor bytes changed: {changed[:10]}{' ...' if len(changed) > 10 else ''}")
    if not why and (list(tensors) != list(rec.tensors) or d != rec.digest):
        why.append("file digest differs from the index's")
    problem = "; ".join(why) if why else None
    return FileDigestCheck(size, "xxh3_128", d, tensors, problem)


_SMALL_TARGET = 1 << 20  # targets under this many bytes are read through a ctypes array
_ARRAY_TYPES: dict[int, type] = {}


def _bytes_at(address: int, n: int):
    """A writable buffer over ``n`` bytes of memory at ``address`` (a live tensor's, which the
    caller keeps alive while the buffer is used: :class:`~.pread.Run` holds it as an owner): a ctypes array, several times cheaper
    than ``memoryview(t.numpy()).cast("B")``, per target of loads of 10^4-10^5 small tensors.
    Slice it through ``memoryview`` (a ctypes array's own slice is a list)."""
    kind = _ARRAY_TYPES.get(n)
    if kind is None:
        if len(_ARRAY_TYPES) >= 4096:  # checkpoints of many distinct sizes: bounded memory
            _ARRAY_TYPES.clear()
        kind = _ARRAY_TYPES[n] = ctypes.c_ubyte * n
    return kind.from_address(address)


class CheckpointReader:
    """A validated, open checkpoint. Use :func:`checkpoint.storage.opening.open_checkpoint`; close with :meth:`close` or ``with``.

    ``files`` are the shard file names read (relative to ``root``), ``index`` the parsed
    :class:`~checkpoint.storage.format.IndexFile` (``None`` without an index).
    """

    def __init__(self, root: str, index: IndexFile | None, index_path: str | None, key_file: dict[str, str]):
        self.root = root
        self.index = index
        self.index_path = index_path
        self._key_file = key_file
        self.files: list[str] = sorted(set(key_file.values()))
        self._handles: dict[str, object] = {}
        self._fds: dict[str, int] = {}  # raw fd per file, opened with the handle (see held_path)
        self._specs: dict[str, tuple[tuple[int, ...], str]] = {}
        self._spec_objs: dict[str, TensorSpec] = {}
        self._spans: dict[str, tuple[int, int]] = {}  # key -> absolute [begin, end) in its file
        self._verified: set[str] = set()  # files verify_file checked whole: no second hash until a span
        self._checked: set[str] = set()  # tensors check_first found intact: no second hash in the span
        self._digests_of: dict[str, dict[str, str] | None] = {}  # file -> its recorded tensor digests
        self._totals: dict[str, int] = {}  # file -> data bytes of its header's tensors (on open)
        self._maps: dict[str, _leased.LeasedMap | None] = {}  # file -> its leased mapping in a span
        self._stamps: dict[str, tuple] = {}  # file -> (inode, size, mtime) when checked unleased
        self._span_depth = 0  # depth of reading() spans open, by any thread
        self._close_due = False  # close() called while a span was open: closed when it ends
        self._span_lock = threading.Lock()  # span starts and ends: none starts while another drops the maps
        # Whether opening a shard compares its header bytes with the index's digest (off for
        # ``verify``, which re-hashes every file and reports each difference instead of stopping).
        self.check_headers = True

    # -- lookups ------------------------------------------------------------------------------
    @property
    def meta(self) -> FqnckptMeta | None:
        """fqnckpt's own index metadata, if this checkpoint was written by fqnckpt."""
        return self.index.metadata.fqnckpt if self.index is not None else None

    @property
    def digest_chunk(self) -> int | None:
        """Chunk size of the index's tensor digests (format version 3), None for version 2 (plain
        xxh3-128) or without digests (:func:`checkpoint.storage.digest.tensor_hexdigest`)."""
        meta = self.meta
        return meta.tensor_digest_chunk if meta is not None else None

    @property
    def alias_groups(self) -> list[list[str]]:
        return [list(g) for g in self.meta.alias_groups] if self.meta else []

    def keys(self) -> list[str]:
        """Stored tensor names, sorted."""
        return sorted(self._key_file)

    def __contains__(self, key: object) -> bool:
        return key in self._key_file

    def file_of(self, key: str) -> str:
        return self._key_file[self._known(key)]

    def spec(self, key: str) -> TensorSpec:
        """Shape and dtype of ``key`` from its file header (no data read)."""
        spec = self._spec_objs.get(key)
        if spec is not None:
            return spec
        shape, st = self._specs[self._known(key)]
        if st not in ST_TO_DTYPE:
            raise CorruptCheckpointError(os.path.join(self.root, self.file_of(key)), f"tensor {key!r} has dtype {st} torch cannot hold", key=key)
        spec = self._spec_objs[key] = TensorSpec.trusted(key, shape, ST_TO_DTYPE[st])  # header validated on open
        return spec

    @_in_span
    def get(self, key: str) -> torch.Tensor:
        """The whole tensor ``key`` as a new CPU tensor (stored shape and dtype), read with
        ``preadv`` (:mod:`~.tensor_read`: a file cut short is an error, never a SIGBUS).

        Raises:
            CorruptCheckpointError: the file ends before the tensor (file and tensor named), or
                its dtype is one torch cannot hold.
            LoadError: the read fails (tensor and file named).
        """
        at, begin = self._where(key)
        spec = self.spec(key)
        if not self._digest_due(key):
            t = _tread.read_tensor(at, key, begin, spec.shape, spec.dtype)
            stats.bytes_read += t.numel() * t.element_size()
            return t
        # Hashed while it is read (pieces hashed from cache as they land: no second pass).
        t, got = _tread.read_hashed(at, key, begin, spec.shape, spec.dtype, self.digest_chunk)
        stats.bytes_read += t.numel() * t.element_size()
        self.check_digest(key, _Hashed(got))
        return t

    def recorded_digest(self, key: str) -> str | None:
        """The xxh3-128 hex digest the index records for tensor ``key`` (fqnckpt format version
        2), else None (no index, a foreign index, format version 1)."""
        name = self._key_file.get(key, "")
        got = self._digests_of.get(name, False)
        if got is False:  # each file's record looked up once (20,000-tensor loads ask per tensor)
            rec = self.meta.record(name) if self.meta is not None else None
            got = self._digests_of[name] = rec.tensors if isinstance(rec, FileRecordV2) else None
        return got.get(key) if got is not None else None

    def _digest_due(self, key: str) -> bool:
        """Whether a whole read of ``key`` is to be checked: the index records its digest and its
        file was not checked whole already."""
        return (  # _checked first: a read after check_first asks it of every tensor again
            key not in self._checked and self.recorded_digest(key) is not None and self._key_file[key] not in self._verified
        )

    def check_digest(self, key: str, data: object) -> None:
        """Check ``data`` (all of tensor ``key``'s stored bytes, any buffer: a target read whole,
        an ``xxhash`` hasher fed every byte, or their hex digest) against the index's digest of ``key``; nothing
        when the index records none. One hash of bytes already in memory (xxh3-128, ~10 GB/s on
        one core here): safetensors has no checksum, so without it a flipped byte loads silently.

        Raises:
            CorruptCheckpointError: the digests differ (file and tensor named; ``key`` set).
        """
        want = self.recorded_digest(key)
        if want is None or self._key_file[key] in self._verified or key in self._checked:
            return  # no digest, or checked already (check_first, or load(verify=True)'s whole files)
        check_tensor_digest(os.path.join(self.root, self._key_file[key]), key, data, want, self.digest_chunk)

    @_in_span
    def check_first(
        self, keys: Iterable[str] = (), rows: Mapping[str, Sequence[tuple[int, int]]] | None = None
    ) -> dict[str, dict[int, bytes]]:
        """Check, before any target is written, the tensors ``keys`` whole against the index's
        digests, and hash the format-3 chunks of ``rows`` (``{key: [(lo, hi), ...]}``: byte
        ranges of the tensor, such as a rank's ``Shard(0)`` rows) that start in those ranges, for
        the caller to gather from every rank and check with :meth:`check_chunks`. Tensors without
        a recorded digest, or checked already in the same span, are skipped; a tensor found intact
        is not hashed again by a later read of that span (a later span checks it again: its
        file may have changed in between). The bytes are hashed from the file's leased mapping inside a
        :meth:`reading` span (the copies that follow in the span then copy the same bytes), else
        through one small buffer per read thread (:mod:`~.read_check`); never into a target.

        Returns:
            ``{key: {chunk index: 16-byte digest}}`` for ``rows``' keys that have chunk digests.

        Raises:
            CorruptCheckpointError: a tensor's bytes differ from its digest, or its file ends
                early (file and tensor named; ``key`` set); no target was written.
            LoadError: a read fails (tensor and file named).
        """
        chunk = self.digest_chunk
        whole, parts = self._due_checks(keys, rows)
        files: dict[str, tuple[int, str, dict[str, str]]] = {}  # name -> (fd, path, recorded digests)

        def file_of(k: str) -> tuple[int, str, dict[str, str]]:
            name = self._key_file[k]
            f = files.get(name)
            if f is None:
                at, _ = self._where(k)  # opens the file (and its descriptor) if closed since
                f = files[name] = (at.fd, os.path.join(self.root, name), self.meta.record(name).tensors)
            return f

        spans, plain = [], {}  # plain: file -> [(begin, end, key)] of tensors of one digest each
        for k in whole:
            b, e = self._spans[k]
            if chunk is None or e - b <= chunk:
                plain.setdefault(self._key_file[k], []).append((b, e, k))
                continue
            fd, path, want = file_of(k)
            spans.append(_read_check.Whole(k, fd, path, b, e, want[k]))
        units = []
        for k, ranges in parts.items():
            fd, path, _ = file_of(k)
            b, e = self._spans[k]
            for lo, hi in ranges:
                first, stop = _read_check.row_chunks(e - b, chunk, lo, hi)
                units += _read_check.tensor_units(fd, path, k, b, e, chunk, first, stop)
        by_file: dict[str, int] = {}  # bytes hashed per file: map it under a lease when large
        for u in [*spans, *units]:
            name = self._key_file[u.key]
            by_file[name] = by_file.get(name, 0) + (u.end - u.begin if isinstance(u, _read_check.Whole) else u.hi - u.lo)
        for name, items in plain.items():
            by_file[name] = by_file.get(name, 0) + sum(e - b for b, e, _ in items)
        for name, n in by_file.items():
            self._lease(name, n)
            if self._maps.get(name) is None and name not in self._stamps:
                self._stamps[name] = _stamp(self._fd(name))  # no lease: a rewrite is found by its stamp
        # A file still on the device: hashed whole by this thread in file order (readahead).
        cold = {n for n in by_file if self._maps.get(n) is None and not self._resident(n)}
        stream = [w for w in spans if self._key_file[w.key] in cold]
        spans = [w for w in spans if self._key_file[w.key] not in cold]
        for name, items in plain.items():  # many small tensors: no object per tensor
            fd, path, want = file_of(items[0][2])
            if name in cold:
                stream += [_read_check.Whole(k, fd, path, b, e, want[k]) for b, e, k in items]
            else:
                _read_check.check_plain(fd, path, items, want)
        _read_check.check_whole(stream, chunk, threads=False)
        _read_check.check_whole(spans, chunk)
        self._checked.update(whole)
        got = _read_check.hash_units(units)
        stats.bytes_checked += sum(u.hi - u.lo for u in units)
        out: dict[str, dict[int, bytes]] = {k: {} for k in parts}
        for (k, i), d in got.items():
            if i is not None and k in out:
                out[k][i] = d
        return out

    def _due_checks(
        self, keys: Iterable[str], rows: Mapping[str, Sequence[tuple[int, int]]] | None
    ) -> tuple[list[str], dict[str, Sequence[tuple[int, int]]]]:
        """:meth:`check_first`'s work: the tensors to hash whole (those of ``keys`` not checked
        yet, and those of ``rows`` of one chunk or without chunk digests: a row block of such a
        tensor can only be checked by reading it whole) and the row ranges to hash in chunks."""
        chunk = self.digest_chunk
        key_file, checked, verified = self._key_file, self._checked, self._verified
        whole = []
        for k in dict.fromkeys(keys):  # (_digest_due inlined: loads of 10^4-10^5 tensors)
            if k in checked:
                continue
            name = key_file.get(k)
            if name is None:
                self._known(k)  # raises UnknownNameError
            if name not in verified and self.recorded_digest(k) is not None:
                whole.append(k)
        parts: dict[str, Sequence[tuple[int, int]]] = {}
        for k, r in (rows or {}).items():
            if not self._digest_due(self._known(k)) or k in whole:
                continue
            b, e = self._spans[k]
            if chunk and e - b > chunk:
                parts[k] = r
            elif r:
                whole.append(k)
        return whole, parts

    def confirm_unchanged(self) -> None:
        """Confirm that no file this reader checked without a read lease (:mod:`~.leased`: none
        could be had on it, or leases are off) was written since its check: its size and
        modification time are those taken before it was hashed (a write sets the modification
        time, fine-grained once it was read: Linux's multigrain timestamps). A load runs it after its
        check, so a rewrite in place before the copies is refused with every target unchanged,
        and again after the copies (:meth:`confirm_copied`).

        Inside a :meth:`reading` span, a lease is tried first on each such file (one the check read
        from the device is in the page cache now) and its stamp compared while the lease holds:
        unchanged, the file is kept so by the lease until the span ends, and the copies read it
        from the mapping, as for a file leased from the start (no stamp left to compare after them).

        Raises:
            CorruptCheckpointError: a file was written since it was checked (file named).
        """
        self._lease_checked()
        self._check_stamps("")

    def _lease_checked(self) -> None:
        if not self._span_depth:
            return
        for name in list(self._stamps):
            fd = self._fds.get(name)
            if fd is None or self._maps.get(name) is not None:
                continue
            m = _leased.take(fd)
            if m is None:
                continue
            if _stamp(fd) != self._stamps[name]:  # written after its check: refused just below
                m.release()
                continue
            self._maps[name] = m
            del self._stamps[name]

    def confirm_copied(self) -> None:
        """:meth:`confirm_unchanged` after the copies: a file rewritten in place while they ran
        (no lease held on it) is refused, naming it; the targets may then hold some of its new
        bytes, which no digest was checked against.

        Raises:
            CorruptCheckpointError: a file was written since it was checked (file named).
        """
        self._check_stamps("; the targets may hold some of its new bytes, which no digest was checked against")

    def _check_stamps(self, more: str) -> None:
        for name, was in self._stamps.items():
            if _stamp(self._fds[name]) != was:
                raise CorruptCheckpointError(
                    os.path.join(self.root, name),
                    "changed while being loaded (written in place after its digests were checked, and no read lease "
                    f"could be held on it to keep writers out): load it again{more}",
                )

    def check_chunks(self, key: str, digests: dict[int, bytes]) -> bool:
        """Check tensor ``key`` against the index's digest from the 16-byte digests of its format-3
        chunks by index (gathered from the ranks that read its rows: :meth:`read_many`'s
        ``chunks``). Returns False, checking nothing, when a chunk is missing (a rank read its
        block another way) or the index records no digest for it.

        Raises:
            CorruptCheckpointError: the combined digest differs (file and tensor named).
        """
        want, chunk = self.recorded_digest(key), self.digest_chunk
        if want is None or not chunk or self._key_file[key] in self._verified or key in self._checked:
            return False
        b, e = self._spans[key]
        n = _digest.chunk_count(e - b, chunk)
        if e == b or any(k not in digests for k in range(n)):
            return False
        self.check_digest(key, _digest.combine_chunks([digests[k] for k in range(n)]))
        self._checked.add(key)
        return True

    @_in_span
    def copy_into(
        self, key: str, out: torch.Tensor, slices: Sequence[slice] | None = None, check: bool = False
    ) -> bool:
        """Tensor ``key`` (or its block ``tensor[slices]``, step-1 slices) into ``out``, a CPU
        tensor of that shape in any dtype and layout (``copy_``'s conversions): the package's one
        block read (:func:`~.tensor_read.copy_into`: the block's runs straight into ``out``, or
        whole rows through one reused window, or a ``copy_`` from the leased mapping inside a
        :meth:`reading` span; no intermediate tensor of the tensor's size). False (nothing read)
        when ``out`` is not on the CPU.

        ``check``: when the block holds every row (the whole tensor, a ``Shard(1)`` column
        block), the tensor is checked against the index's digest before ``out`` is written
        (:meth:`check_first`); a block of some rows only is not (the digest covers bytes it
        does not read: :meth:`check_first`'s ``rows`` check those across ranks).

        Raises:
            CorruptCheckpointError: the file ends before the tensor (file and tensor named), or
                a checked tensor's bytes differ from its digest (``out`` unchanged).
            LoadError: the read fails (tensor and file named).
        """
        if not out.is_cpu:
            return False
        at, begin = self._where(self._known(key))
        spec = self.spec(key)
        if slices is not None:
            slices = block_slices(key, spec.shape, slices)
        if check and self._digest_due(key) and (not slices or not spec.shape or _all_rows(spec.shape, slices)):
            self.check_first([key])  # a block of every row: the whole tensor checked before the copy
        shape = spec.shape
        if len(shape) > 32:  # numpy (the block copies' byte views) holds 32 (1.x) / 64 dims; torch more
            shape, out, slices = _unit_dims_dropped(shape, out, slices)
        self._lease(at.name, out.numel() * spec.dtype.itemsize)
        try:
            _tread.copy_into(at, key, begin, shape, spec.dtype, out, slices)
        finally:
            increment_version(out)  # preadv may have written behind torch's back, as in read_many
        stats.bytes_read += out.numel() * spec.dtype.itemsize
        return True

    def _where(self, key: str) -> tuple[_tread.Where, int]:
        """The open file holding ``key`` and the tensor's absolute byte offset in it."""
        self._handle(key)  # opens the file (and its descriptor) if closed since
        name = self._key_file[key]
        return _tread.Where(self._fds[name], self.root, name), self._spans[key][0]

    def _target_view(self, key: str, out: torch.Tensor, shape: tuple[int, ...] | None = None) -> memoryview | None:
        """``out``'s own bytes when tensor ``key`` (or its block of ``shape``) can be read straight
        into it (a contiguous CPU tensor of that shape and the stored dtype), else None."""
        known = self._specs.get(key)
        if (
            known is None
            or key not in self._spans
            or key not in self._key_file
            or not out.is_cpu  # (device.type costs ~0.8 us a tensor)
            or DTYPE_TO_ST.get(out.dtype) != known[1]
            or out.shape != (known[0] if shape is None else shape)
            or not out.is_contiguous()
            or out.is_conj()
            or out.is_neg()
        ):
            return None
        # Checked above (contiguous CPU, not conj / neg): out's bytes are data_ptr() on.
        n = out.nbytes
        if 0 < n < _SMALL_TARGET:
            return _bytes_at(out.data_ptr(), n)
        if out.dtype in NUMPY_DTYPES and n and out.dim() <= 32:  # numpy 1 holds 32 dims
            return memoryview((out.detach() if out.requires_grad else out).numpy()).cast("B")
        return tensor_bytes(out)  # out's own memory (contiguous CPU: no copy)

    def _block_span(self, key: str, slices: Sequence[slice]) -> tuple[tuple[int, ...], int, int] | None:
        """``(block shape, begin, end)``: the absolute byte range of block ``tensor[slices]`` of
        ``key`` (step-1 slices, one per dim) when it is one contiguous range of the file, else
        None. Row-major: it is when every dim after some dim j is whole and every dim before j
        has length 1 (e.g. a ``Shard(0)`` row block)."""
        shape, st = self._specs[key]
        if len(slices) != len(shape) or not shape:
            return None
        bounds = []
        for s, n in zip(slices, shape):
            lo, hi, step = s.indices(n)
            if step != 1:
                return None
            bounds.append((lo, max(lo, hi)))
        lens = tuple(hi - lo for lo, hi in bounds)
        j = len(shape) - 1
        while j > 0 and lens[j] == shape[j]:
            j -= 1  # trailing whole dims
        if any(n != 1 for n in lens[:j]):
            return None
        b, e = self._spans[key]
        item = (e - b) // max(1, math.prod(shape)) if e > b else 0
        start, stride = 0, item
        for (lo, _), n in zip(reversed(bounds), reversed(shape)):
            start += lo * stride
            stride *= n
        return lens, b + start, b + start + math.prod(lens) * item

    def _fd(self, name: str) -> int:
        fd = self._fds.get(name)
        if fd is None:
            fd = self._fds[name] = os.open(
                os.path.join(self.root, name), os.O_RDONLY | getattr(os, "O_CLOEXEC", 0)
            )
        return fd

    def read_into(self, key: str, out: torch.Tensor) -> bool:
        """Read tensor ``key`` straight into ``out`` when ``out`` is a contiguous CPU tensor of the
        stored shape and dtype (``preadv``, no intermediate tensor: :func:`~.pread.read_runs`);
        False otherwise (then use :meth:`get`). Byte ranges come from the header ``safe_open`` validated: safetensors has no
        API to read into existing memory, and ``get_tensor`` costs ~100 us per tensor.
        """
        return self.read_many([(key, out)])[0]

    @_in_span
    def read_many(self, pairs: Sequence[tuple], check: bool | Container[str] = True) -> list[bool]:
        """:meth:`read_into` for each ``(key, out)`` pair; per pair, whether it was read. A triple
        ``(key, out, slices)`` reads only block ``tensor[slices]`` of ``key`` into ``out`` (a
        DTensor's local shard, or a block of it) when that block is one contiguous range of the
        file (:meth:`_block_span`; a ``Shard(0)`` row block is). Tensors adjacent in a file are
        read by one ``preadv`` into all their targets, large ones in pieces, and all of the
        runs and pieces of the call shared by a few threads (:func:`~.pread.read_runs`).

        A tensor read whole (a pair, or a triple whose block is the whole tensor) is checked
        against its xxh3-128 digest in the index when ``check`` is True or holds its key, before
        any target is written (:meth:`check_first`).

        Raises:
            CorruptCheckpointError: a file ends early, or a tensor read whole differs from its
                digest (file and tensor named; no target written then).
            LoadError: torch or the OS fails on a tensor (key and file named).
        """
        if check:
            checked, spans = self._checked, self._spans  # (checked: a load's check_first ran first)
            self.check_first(
                p[0] for p in pairs
                if p[0] not in checked and (check is True or p[0] in check) and p[0] in spans
                and (len(p) == 2 or is_whole_block(self._specs[p[0]][0], p[2]))
            )  # fmt: skip
        done = [False] * len(pairs)
        try:
            large = 2 * _pread.PIECE  # from here on a tensor is read in pieces; a run is cut there too
            small: dict[str, list[tuple[int, int, memoryview, str, torch.Tensor]]] = {}
            runs: list[_pread.Run] = []
            for i, pair in enumerate(pairs):
                key, out = pair[0], pair[1]
                try:
                    if len(pair) > 2:  # a block of the tensor
                        span = self._block_span(self._known(key), pair[2]) if key in self._spans else None
                        if span is None:
                            continue
                        shape, b, e = span
                        view = self._target_view(key, out, shape)
                    else:
                        view = self._target_view(key, out)
                        b, e = self._spans[key] if view is not None else (0, 0)
                    if view is None:
                        continue
                    done[i] = True
                    name = self._key_file[key]
                    if e - b >= large:  # cut into pieces and shared by a few threads (see pread)
                        runs.append(_pread.Run(self._fd(name), [view], [key], b, self.root, name, (out,)))
                    elif e > b:
                        small.setdefault(name, []).append((b, e, view, key, out))
                except CheckpointError:
                    raise
                except Exception as e:  # noqa: BLE001 - torch / OS errors are named by key and file
                    where = os.path.join(self.root, self._key_file.get(key, ""))
                    raise LoadError(key, where, f"{type(e).__name__}: {e}") from e
            for name, items in small.items():
                fd = self._fd(name)
                items.sort(key=lambda x: x[0])
                start = 0
                for j in range(1, len(items) + 1):  # runs of adjacent tensors, `large` bytes at most
                    if j < len(items) and items[j][0] == items[j - 1][1] and items[j][1] - items[start][0] <= large:
                        continue
                    run = items[start:j]
                    runs.append(
                        _pread.Run(fd, [x[2] for x in run], [x[3] for x in run], run[0][0], self.root, name, tuple(x[4] for x in run))
                    )
                    start = j
            by_file: dict[str, int] = {}
            for r in runs:
                by_file[r.name] = by_file.get(r.name, 0) + r.nbytes
            for name, n in by_file.items():
                self._lease(name, n)
            stats.bytes_read += read_runs(runs)
        finally:
            # preadv wrote behind torch's back: bump the targets' version counters, as copy_ would
            # (autograd's saved-tensor check, and autoparallel's never-written check, read them).
            increment_version([p[1] for p, ok in zip(pairs, done) if ok])
        return done

    @_in_span
    def get_slice(self, key: str, slices: Sequence[slice]) -> torch.Tensor:
        """Only the block ``tensor[slices]`` of ``key`` (one ``slice`` per dim), read from disk with
        ``preadv`` as a new tensor (:func:`~.tensor_read.read_block`). A block of every row (a
        column block) is checked with the whole tensor against the index's digest first
        (:meth:`check_first`), as a whole read is; a block of some rows is not (the digest covers
        bytes it does not read). Raises what :meth:`get` raises."""
        slices = block_slices(key, self._specs[self._known(key)][0], slices)
        if is_whole_block(self._specs[key][0], slices):
            return self.get(key)  # the whole tensor: checked against its digest like any whole read
        spec = self.spec(key)
        if self._digest_due(key) and spec.shape and _all_rows(spec.shape, slices):
            self.check_first([key])
        at, begin = self._where(key)
        self._lease(at.name, math.prod(s.indices(n)[1] - s.indices(n)[0] for s, n in zip(slices, spec.shape)) * spec.dtype.itemsize)
        t = _tread.read_block(at, key, begin, spec.shape, spec.dtype, slices)
        stats.bytes_read += t.numel() * t.element_size()
        return t

    def verify_file(self, name: str) -> str:
        """Re-hash shard ``name`` (one read); returns its file-level digest (xxh3-128 scheme of
        format versions 2 and 3, sha256 for version 1 or without fqnckpt metadata).

        Raises:
            ChecksumMismatchError: size, header or any tensor's digest differ from the index's
                record (``expected`` / ``actual`` are the file-level digests).
            KeyError: ``name`` is not a file of this checkpoint.
        """
        if name not in self.files:
            raise KeyError(f"{name!r} is not a file of {self.root}; files: {self.files}")
        path = os.path.join(self.root, name)
        src = self.held_path(name)
        rec = self.meta.record(name) if self.meta else None
        check = check_file(src, rec, self.digest_chunk)  # the file opened, even if a save replaced it since
        if check.problem is not None:
            raise ChecksumMismatchError(path, rec.digest, f"{check.digest} ({check.problem})")
        self._verified.add(name)
        return check.digest

    def check_index_digest(self) -> None:
        """Raise :class:`ChecksumMismatchError` when :meth:`verify_index` finds a problem."""
        problem = self.verify_index()
        if problem is not None:
            raise ChecksumMismatchError(self.index_path, self.meta.index_xxh3_128 or "", problem)

    def verify_index(self) -> str | None:
        """Problem with the index's own digest (format versions 2 and 3), or None when it matches or the
        index has none (older versions, foreign indexes)."""
        meta = self.meta
        if meta is None and self.index_path is not None:
            # A foreign index has no fqnckpt block; ours with a damaged key ("metadata", "fqnckpt")
            # would pass as foreign: both names and the digest field are in every index we write.
            raw = self._index_bytes()
            if b'"fqnckpt"' in raw or _digest.INDEX_FIELD.encode() in raw:
                return f"{self.index_path}: fqnckpt's index metadata is damaged (the fqnckpt block does not parse)"
            return None
        if meta is None or meta.format_version < 2:
            return None
        if meta.index_xxh3_128 is None:
            return f"{self.index_path}: format version {meta.format_version} index without {_digest.INDEX_FIELD}"
        raw = self._index_bytes()
        got = _digest.index_digest_of(raw, meta.index_xxh3_128)
        if got != meta.index_xxh3_128:
            return f"{self.index_path}: index bytes changed ({_digest.INDEX_FIELD} {got} != recorded {meta.index_xxh3_128})"
        return None

    def check_file(self, name: str) -> FileDigestCheck:
        """:func:`check_file` of shard ``name`` against its index record (one read of the file)."""
        rec = self.meta.record(name) if self.meta else None
        return check_file(self.held_path(name), rec, self.digest_chunk)

    def header_total(self, name: str) -> int:
        """Data bytes of every tensor in shard ``name``'s header, as validated on open (not read
        again: a file rewritten in place since must not fail ``verify`` with a bare parse error;
        its digests say it changed)."""
        return self._totals[name]

    def open_part(self, prefix: str) -> CheckpointReader | None:
        """The reader of part ``prefix`` (``"optimizer"``) of the same checkpoint, None when it has
        none (headers checked as this reader's are). Raises what :func:`open_local_checkpoint` raises,
        and :class:`MissingShardError` for a part the model index's record names that is gone."""
        name = recorded_object(self.index, index_name(prefix)) if self.index is not None else index_name(prefix)
        if name is None or not os.path.isfile(os.path.join(self.root, name)):
            if name is not None and self.meta is not None and self.meta.objects is not None:  # recorded, gone since
                raise MissingShardError(self.root, [name], index_name(MODEL_PREFIX))
            return None
        return open_local_checkpoint(self.root, prefix=prefix, check_headers=self.check_headers)

    # -- plumbing -----------------------------------------------------------------------------
    def _index_bytes(self) -> bytes:
        with open(self.index_path, "rb") as f:
            return f.read()

    def held_path(self, name: str) -> str:
        """A path reading the very file opened with this checkpoint, even after a later save
        replaced it (commits rename new files in; the opened inode stays): ``/proc/self/fd/N``
        where it exists, else the file's path if it still names the opened file.

        Raises:
            CorruptCheckpointError: no ``/proc`` and the file was replaced since it was opened.
        """
        path = os.path.join(self.root, name)
        fd = self._fds.get(name)
        if fd is None:
            return path
        proc = f"/proc/self/fd/{fd}"
        if os.path.exists(proc):
            return proc
        now, held = os.stat(path), os.fstat(fd)
        if (now.st_dev, now.st_ino) != (held.st_dev, held.st_ino):
            raise CorruptCheckpointError(
                path, "was replaced by a later save after the checkpoint was opened; reopen it"
            )
        return path

    def recorded_header(self, name: str) -> str | None:
        """The index's xxh3-128 digest of shard ``name``'s header bytes (format versions 2 and 3),
        checked on every open of the file (:func:`~.st_header.header_of_bytes`); None without
        one, or when this reader was opened with ``check_headers=False``."""
        meta = self.meta
        rec = meta.record(name) if meta is not None and self.check_headers else None
        return rec.header if isinstance(rec, FileRecordV2) else None

    def _open_file(self, name: str):
        path = os.path.join(self.root, name)
        # The raw fd first; the header is read and validated through it (never mapped: a file cut
        # while mapped kills the process by SIGBUS), so header and data come from one inode.
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        try:
            h, head = open_safetensors_with_header(path, fd=fd, header_digest=self.recorded_header(name))
            (n,) = struct.unpack("<Q", os.pread(fd, 8, 0))
        except BaseException:
            os.close(fd)
            raise
        self._drop_map(name)
        old = self._fds.pop(name, None)
        if old is not None:
            os.close(old)
        self._fds[name] = fd
        self._handles[name] = h
        return h, head, 8 + n

    def _known(self, key: str) -> str:
        if key not in self._key_file:
            from fqn.errors import UnknownNameError

            raise UnknownNameError(key, self._key_file, f"tensor of checkpoint {self.root}:")
        return key

    def _handle(self, key: str):
        name = self._key_file[self._known(key)]
        h = self._handles.get(name)
        if h is None:
            with atomic.read_view(self.root):
                h = self._open_file(name)
        return h

    def _load_headers(self) -> None:
        """Open every named file, check the index against the headers (before any data is read)."""
        in_file: dict[str, str] = {}  # tensor -> the first file whose header has it
        dups: dict[str, list[str]] = {}
        specs, spans = self._specs, self._spans
        for name in self.files:
            h, head, data_start = self._open_file(name)
            total = 0
            for k, v in head.items():  # one pass, few lookups: headers hold 10^4-10^5 tensors
                if k == "__metadata__":
                    continue
                b, e = v["data_offsets"]
                total += e - b
                first = in_file.setdefault(k, name)
                if first != name:
                    dups.setdefault(k, [first]).append(name)
                    continue
                st = v["dtype"]
                specs[k] = (tuple(v["shape"]) if st not in PACKED else _torch_shape(name, k, st, v["shape"]), st)
                spans[k] = (data_start + b, data_start + e)
            self._totals[name] = total
        if dups:
            k = next(k for k in in_file if k in dups)
            raise DuplicateTensorError(k, dups[k])
        if self.index is None and not self._key_file:  # files given alone: every tensor of their headers
            self._key_file = dict(in_file)
        for k, name in self._key_file.items():
            if in_file.get(k) != name:
                raise TensorNotInShardError(k, name, in_file.get(k))
        if len(in_file) > len(self._key_file):  # every indexed tensor was found above
            extra = sorted(set(in_file) - set(self._key_file))
            warnings.warn(
                f"{self.root}: tensors {extra[:10]} are in shard headers but not in the index; ignored",
                StrayFileWarning,
                stacklevel=3,
            )
            for k in extra:
                self._specs.pop(k, None)
                self._spans.pop(k, None)

    @contextlib.contextmanager
    def reading(self):
        """A span of reads (one load: its check and its copies): inside it the files read are
        mapped under a read lease (:mod:`~.leased`), so the check hashes the mapped pages, the
        copies copy from them, and no writer changes a file between the two; the leases are
        given back when the outermost span ends. Spans nest, and the spans of all threads
        reading through this reader count together (a thread's reads never meet a mapping
        another thread's span closed); :meth:`get`, :meth:`check_first`, :meth:`read_many`,
        :meth:`copy_into` and :meth:`get_slice` open their own. What was checked before the
        outermost span began (an earlier load of this reader, ``verify``'s whole files) was
        checked without this span's leases, so it is checked again in it."""
        self._span_start()
        try:
            yield self
        finally:
            self._span_end()

    def _span_start(self) -> None:
        with self._span_lock:
            if not self._span_depth:
                self._checked.clear()
                self._verified.clear()
                self._stamps.clear()
            self._span_depth += 1

    def _span_end(self) -> None:
        with self._span_lock:  # (a read of another thread's span keeps the mappings: depth > 0)
            self._span_depth -= 1
            if not self._span_depth and self._maps:
                with contextlib.ExitStack() as drops:  # every lease given back, whatever one raises
                    for name in list(self._maps):
                        drops.callback(self._drop_map, name)
            if not self._span_depth and self._close_due:  # close() was called during the span
                self._close_now()

    def _lease(self, name: str, nbytes: int) -> None:
        """Map file ``name`` under a read lease for the span when the span reads ``nbytes`` or
        more of it at once (once; None remembered where no lease can be had), so reads of its
        descriptor copy from the mapping. Smaller reads go through ``preadv``: a mapping's setup
        and teardown cost tens of microseconds."""
        if self._span_depth and nbytes >= _MAP_MIN and name not in self._maps:
            self._maps[name] = _leased.take(self._fd(name))

    def _resident(self, name: str) -> bool:
        """Whether file ``name``'s bytes look cached (:func:`~.leased.resident`)."""
        fd = self._fd(name)
        return _leased.resident(fd, os.fstat(fd).st_size)

    def _drop_map(self, name: str) -> None:
        m = self._maps.pop(name, None)
        if m is not None:
            m.release()

    def close(self) -> None:
        """Give back every lease and close every file; while a span is open (a read of another
        thread, or of this one) that happens when the span ends, so no read meets a mapping
        unmapped under it."""
        with self._span_lock:
            if self._span_depth:
                self._close_due = True
                return
            self._close_now()

    def _close_now(self) -> None:
        self._close_due = False
        for name in list(self._maps):
            self._drop_map(name)
        self._handles.clear()  # safe_open handles of the headers' private copies (st_header.validate_header)
        fds, self._fds = self._fds, {}
        for fd in fds.values():
            os.close(fd)

    def __del__(self) -> None:
        for fd in getattr(self, "_fds", {}).values():
            with contextlib.suppress(OSError):
                os.close(fd)

    def __enter__(self) -> CheckpointReader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"CheckpointReader({self.root!r}, {len(self._key_file)} tensors in {len(self.files)} files)"


def _all_rows(shape: Sequence[int], slices: Sequence[slice]) -> bool:
    """Whether block ``slices`` of a tensor of ``shape`` holds every dim-0 row."""
    return slices[0].indices(shape[0])[:2] == (0, shape[0])


def block_slices(key: str, shape: Sequence[int], slices: Sequence[slice]) -> list[slice]:
    """``slices`` of a block of tensor ``key`` (``shape``) checked, as every reader's
    ``get_slice`` takes them: one ``slice`` per leading dim (missing ones whole), int bounds, a
    positive step (a step past the dim is that dim, as the block is the same).

    Raises:
        TypeError: an item is not a slice or a bound not an int (tensor named).
        IndexError: more slices than the tensor has dims.
        ValueError: a step below 1.
    """
    slices = list(slices)
    if len(slices) > len(shape):
        raise IndexError(f"tensor {key!r} has {len(shape)} dims, got {len(slices)} slices")
    out = []
    for d, (s, n) in enumerate(zip(slices, shape)):
        try:  # ints and what indexes like one (numpy integers), as torch takes them
            lo, hi, step = (None if v is None else operator.index(v) for v in (s.start, s.stop, s.step))
        except (AttributeError, TypeError):
            raise TypeError(f"tensor {key!r}: get_slice takes a slice of ints per dim, got {s!r} for dim {d}") from None
        if step is not None and step < 1:
            raise ValueError(f"tensor {key!r}: slice step must be positive, got {step} for dim {d}")
        out.append(slice(lo, hi, None if step is None else min(step, max(n, 1))))
    return out


def is_whole_block(shape: Sequence[int], slices: Sequence[slice] | None) -> bool:
    """Whether block ``tensor[slices]`` of a tensor of ``shape`` is all of it, in order."""
    return slices is None or (
        len(slices) <= len(shape) and all(s.indices(n) == (0, n, 1) for s, n in zip(slices, shape))
    )


def _unit_dims_dropped(
    shape: tuple[int, ...], out: torch.Tensor, slices: Sequence[slice] | None
) -> tuple[tuple[int, ...], torch.Tensor, list[slice] | None]:
    """``(shape, out, slices)`` without the stored tensor's size-1 dims (views of ``out``; the
    row-major byte order is the same), so that a tensor of more dims than numpy holds (torch
    holds any number; at most 63 of them can exceed 1) reads through the numpy block copies."""
    keep = [i for i, d in enumerate(shape) if d != 1]
    if slices is not None:
        slices = list(slices) + [slice(None)] * (len(shape) - len(slices))
        if any(slices[i].indices(1)[:2] != (0, 1) for i in range(len(shape)) if shape[i] == 1):
            return shape, out, slices  # an empty block: nothing to read, the normal path says so
        slices = [slices[i] for i in keep]
    if out.dim() == len(shape) and all(out.shape[i] == 1 for i in range(len(shape)) if shape[i] == 1):
        # as_strided: squeeze of a list of dims holds at most 64 of them
        out = out.as_strided([out.shape[i] for i in keep], [out.stride(i) for i in keep], out.storage_offset())
    return tuple(shape[i] for i in keep), out, slices


def open_local_checkpoint(path: str | os.PathLike, prefix: str = MODEL_PREFIX, *, check_headers: bool = True) -> CheckpointReader:
    """Open and validate a checkpoint.

    ``path`` is a directory with ``<prefix>.safetensors.index.json`` (authoritative), a directory
    with a single ``<prefix>.safetensors`` and no index (HF's layout for small models), or one
    ``.safetensors`` file. ``prefix`` is ``"model"`` or ``"optimizer"``. Local paths only: URLs
    go through :func:`checkpoint.storage.opening.open_checkpoint` (``checkpoint.open_checkpoint``).

    Raises:
        CheckpointNotFoundError: nothing loadable at ``path``.
        MissingShardError: files named by the index are missing (all of them are listed).
        UnsafePathError: an index entry is not a plain file name, or a file is a symlink leading
            outside the checkpoint directory (see :mod:`checkpoint.storage.paths`).
        TensorNotInShardError: the index maps a tensor to a file whose header lacks it.
        DuplicateTensorError: a tensor is stored in two files.
        CorruptCheckpointError: the index or a header is invalid (git-lfs pointers are named), a
            header's bytes differ from the digest the index records for them (``check_headers``,
            the default; ``verify`` turns it off to report every file instead), or an fqnckpt
            index's ``metadata.total_size`` differs from the indexed tensors' bytes.
        InterruptedCommitError: a save was killed mid-commit and this process cannot complete it.
        TypeError: ``path`` is a URL (see above).

    Concurrent saves: the reader sees the checkpoint before or after any ``save(overwrite=True)``
    running at the same time, whole, never a mix (see :func:`checkpoint.storage.local_commit.read_view`; wrap
    several ``open_checkpoint`` calls in one ``read_view`` to get the same checkpoint for each).
    """
    if is_url(path) or not isinstance(path, (str, os.PathLike)):  # never taken as a local path
        raise TypeError(
            f"{path}: a URL; open it with checkpoint.open_checkpoint (checkpoint.storage.opening)"
        )
    path = os.path.abspath(os.fspath(path))
    # One checkpoint, whole: every file is opened inside one read view (no commit runs meanwhile;
    # see checkpoint.storage.local_commit), and a reader keeps the files it opened.
    with atomic.read_view(path):
        return _open_checkpoint(path, prefix, check_headers)


def _open_checkpoint(path: str, prefix: str, check_headers: bool = True) -> CheckpointReader:
    if os.path.isfile(path):
        if not path.endswith(".safetensors"):
            raise CheckpointNotFoundError(path, "expected a directory or a .safetensors file")
        root, name = os.path.dirname(path), os.path.basename(path)
        h = open_safetensors(path)
        reader = CheckpointReader(root, None, None, {k: name for k in h.keys()})
        reader._load_headers()
        return reader
    if not os.path.isdir(path):
        raise CheckpointNotFoundError(path)
    check_one_layout(path)  # DCP's .metadata beside our index: refused by every reader alike
    idx_path = _safe_member(path, index_name(prefix))
    single = _safe_member(path, f"{prefix}.safetensors")
    if os.path.isfile(idx_path):
        index = read_index(idx_path)
        files = index.files()
        full = {f: _safe_member(path, f) for f in files}
        missing = [f for f, p in full.items() if not os.path.isfile(p)]
        if missing:
            raise MissingShardError(path, missing, index_name(prefix))
        meta = index.metadata.fqnckpt
        if meta is not None and set(meta.files) != set(files):
            raise CorruptCheckpointError(
                idx_path,
                f"metadata.fqnckpt.files {sorted(meta.files)} differ from the weight_map's files {files}",
            )
        reader = CheckpointReader(path, index, idx_path, dict(index.weight_map))
        reader.check_headers = check_headers
        _warn_strays(path, prefix, set(files))
    elif os.path.isfile(single):
        h = open_safetensors(single)
        reader = CheckpointReader(path, None, None, {k: f"{prefix}.safetensors" for k in h.keys()})
    else:
        raise CheckpointNotFoundError(path, f"no {index_name(prefix)} and no {prefix}.safetensors")
    reader._load_headers()
    check_total_size(reader)
    return reader


def check_total_size(reader: CheckpointReader) -> None:
    """An fqnckpt index's ``metadata.total_size`` must equal the indexed tensors' data bytes (a
    mismatch means index and files do not belong together). Foreign (e.g. HF) indexes may count
    whole storages, so they are not held to it."""
    if reader.meta is None or reader.index.metadata.total_size is None:
        return
    declared = reader.index.metadata.total_size
    actual = sum(e - b for k, (b, e) in reader._spans.items() if k in reader._key_file)
    if actual != declared:
        raise CorruptCheckpointError(
            reader.index_path,
            f"metadata.total_size is {declared} bytes but the indexed tensors hold {actual} bytes "
            "(index and shard files do not belong together)",
        )


def _warn_strays(root: str, prefix: str, named: set[str]) -> None:
    other = OPTIMIZER_PREFIX if prefix == MODEL_PREFIX else MODEL_PREFIX
    strays = sorted(
        f
        for f in os.listdir(root)
        if f.endswith(".safetensors")
        and f not in named
        and not f.startswith(f"{other}-")
        and not f.startswith(".")
        and f != "adapter_model.safetensors"  # peft's adapter beside its base (checkpoint.peft_state)
    )
    if strays:
        warnings.warn(
            f"{root}: {strays} not named by {index_name(prefix)}; not read (the index is authoritative)",
            StrayFileWarning,
            stacklevel=3,
        )
