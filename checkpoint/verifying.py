"""``verify``: re-hash every file and check the index against the headers."""

from __future__ import annotations

import contextlib
import os

from .atomic import read_view
from .errors import AmbiguousSourceError, CheckpointError, CheckpointNotFoundError, CorruptCheckpointError, external_errors
from .plan.values import guarded_get
from .reports import FileCheck, VerifyReport
from .storage.extra_state import checked_extra_state_files
from .storage.format import OPTIMIZER_PREFIX, index_name
from .storage.location import is_remote, resolve
from .storage.opening import open_checkpoint
from .storage.reader import CheckpointReader


def _check_part(reader: CheckpointReader, report: VerifyReport, bar=None) -> None:
    meta = reader.meta
    if reader.files and not report.files:  # the model part names the format
        report.format = "fqnckpt" if meta else ("safetensors-sharded" if reader.index else "safetensors")
    total = 0
    problem = reader.verify_index()
    if problem is not None:
        report.problems.append(problem)
    for name in reader.files:
        p = os.path.join(reader.root, name)
        rec = meta.files.get(name) if meta else None
        check = reader.check_file(name)
        if bar is not None:
            bar.update(check.size)
        fc = FileCheck(
            file=name, size=check.size, algorithm=check.algorithm, digest=check.digest,
            expected_size=rec.size if rec else None, expected_digest=rec.digest if rec else None,
            ok=check.problem is None,
        )  # fmt: skip
        report.files.append(fc)
        if check.problem is not None:
            report.problems.append(
                f"{p}: {check.algorithm} {check.digest} differs from the index's {rec.digest}: {check.problem}"
            )
        total += reader.header_total(name)
    local = getattr(reader, "store", None) is None  # (object storage: side files are not read back)
    for name in sorted(meta.side_files or {}) if meta is not None and reader.files and local else ():
        # A file the save wrote beside the shards (peft's adapter): every byte, as a shard's.
        p, rec = os.path.join(reader.root, name), meta.side_files[name]
        try:
            check = reader.check_file(name)
        except OSError as e:
            report.problems.append(f"{p}: recorded by the index but cannot be read ({type(e).__name__}: {e})")
            continue
        report.files.append(FileCheck(
            file=name, size=check.size, algorithm=check.algorithm, digest=check.digest,
            expected_size=rec.size, expected_digest=rec.digest, ok=check.problem is None,
        ))  # fmt: skip
        if check.problem is not None:
            report.problems.append(f"{p}: {check.algorithm} {check.digest} differs from the index's {rec.digest}: {check.problem}")
    for k in reader.keys():  # every dtype known (headers and offsets were checked on open)
        reader.spec(k)
    report.tensors += len(reader.keys())
    report.total_size += total
    where = reader.index_path or os.path.join(reader.root, reader.files[0] if reader.files else "")
    if reader.index is not None:
        declared = reader.index.metadata.total_size
        if declared is not None and declared != total:
            msg = f"{reader.index_path}: metadata.total_size {declared} != {total} bytes in the headers"
            if meta is not None:
                report.problems.append(msg)
            else:  # other writers may count whole storages (tied / shared): a fact, not damage
                report.notes.append(msg)
    if meta is None and reader.files:
        report.checksummed = False
        report.notes.append(
            f"{where}: no fqnckpt checksums (written by another tool): files not checksummed; "
            "structure checked (headers, index against files, sizes, offsets, dtypes)"
        )


def _check_source(path: str, report: VerifyReport, bar) -> None:
    """Any other format :func:`checkpoint.sources.open_source` reads (pickle, DCP, ...): no
    checksums exist, so every tensor is read and checked against its recorded shape and dtype
    by :func:`checkpoint.plan.values.guarded_get`, the check every load and migration makes."""
    from .sources import open_source

    with external_errors(path, what="reading"), open_source(path) as src:
        report.format = src.format
        report.checksummed = False
        bar.reset(total=src.total_bytes() + src.optimizer_bytes())
        opt = src.optimizer
        keys = [*src.keys(), *(opt.state if opt is not None and opt.separate else ())]  # optimizer beside
        for k in keys:
            try:  # the plan stage's read check (load and migrate make the same)
                guarded_get(src, k)
            except CorruptCheckpointError as e:
                report.problems.append(str(e))
            bar.update(src.nbytes(k))
        report.tensors = len(keys)
        report.total_size = src.total_bytes() + src.optimizer_bytes()
        report.files = []
        report.notes.append(
            f"{path}: format {src.format} carries no checksums: structure checked, every tensor read"
        )


def verify(
    path: str | os.PathLike, *, progress: bool | None = None, storage_options: dict | None = None
) -> VerifyReport:
    """Check a checkpoint: structure always, checksums where the index records them.

    fqnckpt / Hugging Face layout (index or one ``model.safetensors``; the optimizer part too):
    every file's header, offsets and dtypes, the index against the files (every indexed tensor
    in its file, no duplicates, sizes, ``total_size``), the index's own digest, and each file's
    byte size and digests against ``metadata.fqnckpt.files``, ``extra_state.json`` and every
    per-rank extra-state file it lists (schema, digest, rank) (format versions 2 and 3: xxh3-128 of the
    header and of each tensor, see :mod:`checkpoint.storage.digest`; version 1: sha256 per file). An index without that block (e.g. transformers'
    ``save_pretrained``) is checked for structure, with a note that it is not checksummed. Any
    other format fqnckpt reads (``torch.save`` pickles, DCP) has no checksums: every tensor is
    read and checked against its recorded shape and dtype.

    ``progress``: tqdm bar on stderr (``None``: only when stderr is a terminal, after 1 s; none
    for a URL). A URL (``s3://...``) is checked through fsspec, every object named by its one model
    index read in ranged pieces; ``storage_options`` go to the fsspec filesystem.

    Each problem is text naming its file (``report.ok`` is False; a flipped byte shows as a digest
    mismatch naming the header or tensors changed, a truncated shard as an invalid header); facts such as "not checksummed" go to
    ``report.notes``.

    Raises:
        CheckpointNotFoundError: nothing at ``path`` in a format fqnckpt reads.
        AmbiguousSourceError: a directory with several pickle files, or DCP's ``.metadata`` beside a
            safetensors checkpoint (``.choices`` lists them).
        UnsupportedFormatError: a file whose content is no format fqnckpt reads.
        Other problems are reported, not raised.
    """
    from .progress import progress_bar

    where = resolve(path, storage_options)
    if is_remote(where):
        return _verify_remote(where)
    path = os.path.abspath(where)
    report = VerifyReport(path=path)
    prefixes = ["model"]
    if os.path.isfile(os.path.join(path, index_name(OPTIMIZER_PREFIX))):
        prefixes.append(OPTIMIZER_PREFIX)
    with external_errors(path, what="verifying"), progress_bar(_files_bytes(path), "verify", progress) as bar:
        readers: list[CheckpointReader] = []
        with read_view(path):  # every part of one checkpoint, even during a save (checkpoint.atomic)
            for prefix in prefixes:
                try:
                    # Headers not checked on open: check_file compares them, among every file's digests.
                    readers.append(open_checkpoint(path, prefix=prefix, check_headers=False))
                except CheckpointNotFoundError:
                    if prefix != "model" or not os.path.exists(path):
                        raise
                    _check_source_or_raise(path, report, bar)
                except AmbiguousSourceError:  # bad input (which checkpoint?), as sniff raises it
                    raise
                except (CheckpointError, OSError) as e:
                    report.problems.append(f"{type(e).__name__}: {e}")
        if readers:
            _check_readers(readers, path, report, bar)
    return report


def _check_readers(readers: list[CheckpointReader], root: str, report: VerifyReport, bar) -> None:
    """Check every opened part, then ``extra_state.json``'s digest and every per-rank file it lists."""
    for reader in readers:
        try:
            with reader:
                _check_part(reader, report, bar)
        except (CheckpointError, OSError) as e:
            report.problems.append(f"{type(e).__name__}: {e}")
    try:
        checked_extra_state_files(root)
    except (CheckpointError, OSError) as e:
        report.problems.append(f"{type(e).__name__}: {e}")


def _verify_remote(store) -> VerifyReport:
    """:func:`verify` of a checkpoint on object storage: every part and file its one model index
    names (read in ranged pieces), and the extra-state files."""
    from .storage.remote_reader import remote_view

    report = VerifyReport(path=str(store))
    with external_errors(str(store), what="verifying"), contextlib.ExitStack() as held:
        try:
            held.enter_context(remote_view(store))  # fetches and parses the model index: a problem too
            readers = [open_checkpoint(store, check_headers=False)]
        except CheckpointNotFoundError:
            raise
        except (CheckpointError, OSError) as e:
            report.problems.append(f"{type(e).__name__}: {e}")
            return report
        try:
            opt = readers[0].open_part(OPTIMIZER_PREFIX)
            if opt is not None:
                readers.append(opt)
        except (CheckpointError, OSError) as e:
            report.problems.append(f"{type(e).__name__}: {e}")
        _check_readers(readers, str(store), report, None)
    return report


def _check_source_or_raise(path: str, report: VerifyReport, bar) -> None:
    """Not fqnckpt's layout: another readable format, or the original not-found error."""
    from .errors import AmbiguousSourceError, UnsupportedFormatError
    from .sources import sniff

    try:
        sniff(path)
    except (AmbiguousSourceError, UnsupportedFormatError):  # bad input, named: exit 2
        raise
    except CheckpointNotFoundError:
        raise CheckpointNotFoundError(
            path, "no index, *.safetensors, DCP .metadata or single pickle in it"
        ) from None
    except CheckpointError as e:
        report.problems.append(f"{type(e).__name__}: {e}")
        return
    try:
        _check_source(path, report, bar)
    except CheckpointError as e:
        report.problems.append(f"{type(e).__name__}: {e}")


def _files_bytes(path: str) -> int:
    if os.path.isfile(path):
        return os.path.getsize(path)
    try:
        return sum(e.stat().st_size for e in os.scandir(path) if e.is_file() and not e.name.startswith("."))
    except OSError:
        return 0
