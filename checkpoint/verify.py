"""``verify``: re-hash every file and check the index against the headers."""

from __future__ import annotations

import json
import os
import struct

from .atomic import read_view
from .errors import CheckpointError, CheckpointNotFoundError
from .reports import FileCheck, VerifyReport
from .storage.format import OPTIMIZER_PREFIX, index_name
from .storage.reader import CheckpointReader, open_checkpoint
from .storage.writer import sha256_file


def _header_total(path: str) -> int:
    # The header is already validated by safe_open; read its offsets to sum the data bytes.
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        head = json.loads(f.read(n))
    return sum(v["data_offsets"][1] - v["data_offsets"][0] for k, v in head.items() if k != "__metadata__")


def _check_part(reader: CheckpointReader, report: VerifyReport) -> None:
    meta = reader.meta
    total = 0
    for name in reader.files:
        p = os.path.join(reader.root, name)
        src = reader.held_path(name)  # the file opened, even if a save replaced it since
        size, digest = os.path.getsize(src), sha256_file(src)
        rec = meta.files.get(name) if meta else None
        fc = FileCheck(
            file=name, size=size, sha256=digest,
            expected_size=rec.size if rec else None, expected_sha256=rec.sha256 if rec else None,
        )  # fmt: skip
        report.files.append(fc)
        if rec is not None and size != rec.size:
            report.problems.append(f"{p}: size {size} bytes, index says {rec.size}")
        if rec is not None and digest != rec.sha256:
            report.problems.append(
                f"{p}: sha256 {digest} differs from the index's {rec.sha256} (corrupted data)"
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
    sha256 mismatch of that file.

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
