"""``verify``: re-hash every file (and the index) and check the index against the headers."""

from __future__ import annotations

import json
import os
import struct

from .atomic import read_view
from .errors import CheckpointError, CheckpointNotFoundError
from .reports import FileCheck, VerifyReport
from .storage.format import OPTIMIZER_PREFIX, index_name
from .storage.reader import CheckpointReader, check_file, open_checkpoint


def _header_total(path: str) -> int:
    # The header is already validated by safe_open; read its offsets to sum the data bytes.
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        head = json.loads(f.read(n))
    return sum(v["data_offsets"][1] - v["data_offsets"][0] for k, v in head.items() if k != "__metadata__")


def _check_part(reader: CheckpointReader, report: VerifyReport) -> None:
    meta = reader.meta
    total = 0
    problem = reader.verify_index()
    if problem is not None:
        report.problems.append(problem)
    for name in reader.files:
        p = os.path.join(reader.root, name)
        src = reader.held_path(name)  # the file opened, even if a save replaced it since
        rec = meta.files.get(name) if meta else None
        check = check_file(src, rec)
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
        total += _header_total(src)
    report.tensors += len(reader.keys())
    report.total_size += total
    if reader.index is not None:
        declared = reader.index.metadata.total_size
        if declared is not None and declared != total:
            report.problems.append(
                f"{reader.index_path}: metadata.total_size {declared} != {total} bytes in the headers"
            )
        if meta is None:
            report.problems.append(f"{reader.index_path}: no fqnckpt metadata, files not checksummed")


def verify(path: str | os.PathLike) -> VerifyReport:
    """Re-hash every file of the checkpoint (model and, if present, optimizer part) and check the
    index against the file headers (every indexed tensor in its file, no duplicates, sizes,
    ``total_size``). Each problem is reported as text naming its file; a flipped byte shows as a
    digest mismatch of that file naming the header or tensors changed (format version 2: xxh3-128
    per tensor and header, see :mod:`checkpoint.storage.digest`; version 1: sha256 per file), or as
    a mismatch of the index's own digest.

    Raises:
        CheckpointNotFoundError: nothing at ``path``. Other problems are reported, not raised.
    """
    path = os.path.abspath(os.fspath(path))
    report = VerifyReport(path=path)
    readers: list[CheckpointReader] = []
    with read_view(path):  # every part of one checkpoint, even during a save (checkpoint.atomic)
        prefixes = ["model"]
        if os.path.isfile(os.path.join(path, index_name(OPTIMIZER_PREFIX))):
            prefixes.append(OPTIMIZER_PREFIX)
        for prefix in prefixes:
            try:
                readers.append(open_checkpoint(path, prefix=prefix))
            except CheckpointNotFoundError:
                raise
            except (CheckpointError, OSError) as e:
                report.problems.append(f"{type(e).__name__}: {e}")
    for reader in readers:
        try:
            with reader:
                _check_part(reader, report)
        except (CheckpointError, OSError) as e:
            report.problems.append(f"{type(e).__name__}: {e}")
    return report
