"""``verify``: re-hash every file and check the index against the headers."""

from __future__ import annotations

import os

from .errors import AmbiguousSourceError, CheckpointError, CheckpointNotFoundError, CorruptCheckpointError, external_errors
from .plan.values import guarded_get
from .reports import FileCheck, VerifyReport
from .storage.extra_state import checked_extra_state_files
from .storage.format import OPTIMIZER_PREFIX
from .storage.location import local_path, resolve
from .storage.opening import open_checkpoint
from .storage.reader import CheckpointReader
from .storage.views import checkpoint_view


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
    for name in sorted(meta.extra_shards or {}) if meta is not None and reader.files and local else ():
        # A file the save wrote beside the shards (peft's adapter): every byte, as a shard's.
        p, rec = os.path.join(reader.root, name), meta.extra_shards[name]
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
        meta = [".metadata"] if src.format == "dcp" and os.path.isfile(os.path.join(path, ".metadata")) else []  # DCP's plan, read first
        report.files = _unchecksummed(path, meta + [f for f in src.files if f not in meta])
        report.notes.append(
            f"{path}: format {src.format} carries no checksums: structure checked, every tensor read"
        )


def _unchecksummed(path: str, names: list[str]) -> list[FileCheck]:
    """A :class:`FileCheck` (size only: ``algorithm`` ``"none"``, no digest) for each file read
    of a format without checksums; ``names`` relative to ``path`` when it is a directory."""
    out = []
    for name in names:
        f = os.path.join(path, name) if os.path.isdir(path) else path
        out.append(FileCheck(file=name, size=os.path.getsize(f) if os.path.isfile(f) else 0, algorithm="none", digest=""))
    return out


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
    ``report.notes``. Other problems are reported, not raised.

    Raises:
        CheckpointNotFoundError: nothing at ``path`` in a format fqnckpt reads.
        AmbiguousSourceError: a directory with several pickle files, or DCP's ``.metadata`` beside a
            safetensors checkpoint (``.choices`` lists them).
        UnsupportedFormatError: a file whose content is no format fqnckpt reads.
    """
    from .progress import progress_bar

    where = resolve(path, storage_options)
    local = local_path(where)
    root = os.path.abspath(local) if local is not None else str(where)
    report = VerifyReport(path=root)
    total = _files_bytes(root) if local is not None else 0
    with external_errors(root, what="verifying"), progress_bar(total, "verify", progress) as bar:
        readers: list[CheckpointReader] = []
        extra_problems: list[str] = []
        # Every part of one checkpoint, even during a save: the view holds what opens them.
        with checkpoint_view(root if local is not None else where):
            try:
                # Headers not checked on open: check_file compares them, among every file's digests.
                readers.append(open_checkpoint(root if local is not None else where, check_headers=False))
            except CheckpointNotFoundError:
                if local is None or not os.path.exists(root):
                    raise
                _check_source_or_raise(root, report, bar)  # another format: local files only
            except AmbiguousSourceError:  # bad input (which checkpoint?), as sniff raises it
                raise
            except (CheckpointError, OSError) as e:
                report.problems.append(f"{type(e).__name__}: {e}")
            if readers:
                try:
                    opt = readers[0].open_part(OPTIMIZER_PREFIX)  # the part its record names, if any
                    if opt is not None:
                        readers.append(opt)
                except (CheckpointError, OSError) as e:
                    report.problems.append(f"{type(e).__name__}: {e}")
                try:
                    checked_extra_state_files(root)
                except (CheckpointError, OSError) as e:
                    extra_problems.append(f"{type(e).__name__}: {e}")
        if readers:
            _check_readers(readers, report, bar)
        report.problems.extend(extra_problems)
    return report


def _check_readers(readers: list[CheckpointReader], report: VerifyReport, bar) -> None:
    """Check every opened part (its files' headers, sizes and digests)."""
    for reader in readers:
        try:
            with reader:
                _check_part(reader, report, bar)
        except (CheckpointError, OSError) as e:
            report.problems.append(f"{type(e).__name__}: {e}")


def _check_source_or_raise(path: str, report: VerifyReport, bar) -> None:
    """Not fqnckpt's layout: another readable format, or the original not-found error."""
    from .errors import AmbiguousSourceError, UnsupportedFormatError
    from .sources import sniff
    from .sources.sniffing import meta_shards

    if meta_shards(path):
        _check_meta_shards(path, report, bar)
        return

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


def _check_meta_shards(path: str, report: VerifyReport, bar) -> None:
    """A directory of Meta's model-parallel shards, read as ``migrate --recipe meta-llama-to-hf``
    reads them (:func:`checkpoint.convert.catalog.open_catalog`: numbered 0..n-1, the same keys
    and dtypes in each, a params.json that parses): every tensor of every shard read and checked
    against its recorded shape and dtype. No checksums exist."""
    from .convert.catalog import open_catalog

    try:
        with external_errors(path, what="reading"):
            catalog = open_catalog(path)
    except CheckpointError as e:
        report.problems.append(f"{type(e).__name__}: {e}")
        return
    try:
        report.format, report.checksummed = "meta-shards", False
        for src in catalog.sources:
            for k in src.keys():
                try:
                    guarded_get(src, k)
                except CorruptCheckpointError as e:
                    report.problems.append(str(e))
                if bar is not None:
                    bar.update(src.nbytes(k))
        report.tensors = len(catalog.keys())
        report.total_size = sum(catalog.nbytes(k) for k in catalog.keys())
        report.files = _unchecksummed(path, [s.path.name for s in catalog.sources])
        report.notes.append(f"{path}: Meta's consolidated.NN.pth shards carry no checksums: structure checked, every tensor of every shard read")
    finally:
        catalog.close()


def _files_bytes(path: str) -> int:
    if os.path.isfile(path):
        return os.path.getsize(path)
    try:
        return sum(e.stat().st_size for e in os.scandir(path) if e.is_file() and not e.name.startswith("."))
    except OSError:
        return 0
