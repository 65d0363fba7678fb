"""The write pipeline in one function, :func:`write_checkpoint`: plan, write, digest, index, commit.

Every front door calls it with what differs between them (the parts and how their tensors are
fetched, whether ranks write together, a layout they chose): ``checkpoint.save`` and
``save_streaming`` (:mod:`checkpoint.saving`), ``async_save`` (from its staged copies),
``migrate`` and conversions (tensors streamed from the source), DCP's ``StorageWriter`` to object
storage. DCP's ``StorageWriter`` to a local path runs the same stages from its own callbacks,
since DCP calls them apart (:mod:`checkpoint.dcp.writer`).

The stages, one module each:

1. plan (:mod:`checkpoint.write.plan`): the files and bytes of every tensor, every check that can
   fail before the first byte; on many ranks one exchange agrees on it.
2. write (:mod:`checkpoint.write.parts`; object storage: :mod:`checkpoint.write.upload`): the
   bytes, into a staging directory, each tensor hashed beside its write.
3. digest (:mod:`checkpoint.write.digests`): files fsynced, the chunks no writer held whole read
   back, every tensor's digest.
4. index and 5. commit (:mod:`checkpoint.write.index`): records and indexes written last, then
   the checkpoint moved into place atomically (:mod:`checkpoint.storage.local_commit`; object
   storage: its model index, :mod:`checkpoint.storage.commit`).
"""

from __future__ import annotations

import hashlib
import math
import os
import warnings
from collections.abc import Mapping, Sequence

from ..errors import CheckpointError, CheckpointWriteError
from ..ranks import dist
from ..storage.extra_state import RANK_FILE_RE
from ..storage.format import IndexFile
from ..storage.layout import Layout
from ..storage.local_commit import StagedCheckpoint
from ..storage.location import local_path, local_target
from .digests import check_covered, chunk_runs, settle_files, tensor_digests
from .index import indexes_of, make_index, write_indexes_and_commit
from .parts import create_files, fetch_checked, fetch_tensor, write_owned, write_sequential
from .plan import Part, check_extra_names, check_same_arguments, check_same_tensors, plan_parts
from .upload import save_remote


def write_checkpoint(
    path: str,
    parts: Sequence[Part],
    max_shard_size=None,
    overwrite: bool = False,
    extra_files: Mapping[str, bytes] | None = None,
    *,
    distributed: bool = False,
    layouts: Sequence[Layout] | None = None,
    agreed: bool = False,
) -> list[IndexFile]:
    """Write ``parts`` as one checkpoint at ``path`` and commit it; returns each part's index.

    ``path``: a local path or a resolved byte store (:func:`checkpoint.storage.location.resolve`;
    ``file://`` commits as a local path). ``max_shard_size``: bytes of tensor data per file
    (``None``: the default for the world size, :func:`checkpoint.storage.layout.default_shard_size`).
    ``extra_files``: ``{file name: bytes}`` written in the same commit (rank 0's on many ranks;
    each rank's per-rank extra-state file is brought to rank 0). ``layouts``: one per part, planned
    by the caller (still checked); else planned here.

    ``distributed``: every rank of the default process group calls this with the same parts
    (plain tensors the same on every rank, DTensors sharded): each rank writes only the bytes it
    owns into the shared files, and one exchange first checks that the ranks planned the same
    files, destination and ``overwrite`` (a failure of any rank before it, e.g. in its state,
    joins it through :func:`join_failed_prepare`). ``agreed``: the caller's ranks agreed on the
    plan already (DCP's coordinator planned it): no exchange.

    Raises:
        UnsavableError, NestedCheckpointError, ValueError: before anything is written (the plan's
            checks: names, header sizes, extra file names, shapes and dtypes of fetched tensors).
        CheckpointExistsError: ``path`` holds a checkpoint and ``overwrite`` is False, or is not a
            checkpoint directory.
        CheckpointWriteError: an OS error (disk full, a failed request after its retries); the
            previous checkpoint at ``path`` stays whole.
        CheckpointError / RankMismatchError / RankAgreementError: on many ranks, no process group,
            ranks that disagree, or another rank's failure.
    """
    path = local_target(path)  # file:// commits as a local path
    extra_files = dict(extra_files or {})
    check_extra_names(list(extra_files))
    if not distributed:
        layouts = plan_parts(path, parts, max_shard_size, 1, layouts)
        if local_path(path) is None:  # a byte store: streamed objects, committed by its index
            return save_remote(path, parts, layouts, overwrite, extra_files, fetch_checked, False)
        return _write_local(path, parts, layouts, overwrite, extra_files)
    if not dist.active():
        raise CheckpointError(
            f"saving {path}: the state holds DTensors but no default process group is initialized "
            "(torch.distributed.init_process_group, of any world size, one rank included)"
        )
    rank, world = dist.rank(), dist.world_size()
    if agreed:
        layouts = plan_parts(path, parts, max_shard_size, world, layouts)
    else:
        layouts = _plan_agreed(path, parts, max_shard_size, overwrite, extra_files, layouts, rank, world)
    if local_path(path) is None:  # a byte store: each file uploaded by one rank, committed by its index
        return save_remote(path, parts, layouts, overwrite, extra_files, fetch_tensor, True)
    return _write_local_ranks(path, parts, layouts, overwrite, extra_files, rank, world)


def join_failed_prepare(path: str, error: BaseException) -> None:
    """This rank's side of the first exchange of a distributed :func:`write_checkpoint` when it
    failed before calling it (e.g. its state or extra state failed there alone): raises ``error``
    after every rank learnt of it (the others raise :class:`~checkpoint.errors.RankAgreementError`
    naming this rank)."""
    dist.check_all_gather(f"preparing {path}", error, None)


def _plan_agreed(path, parts, max_shard_size, overwrite, extra_files: dict, layouts, rank: int, world: int) -> list[Layout]:
    """Plan on every rank, then one exchange for the layout and extra-state checks (and any rank's
    failure so far); it also brings each rank's per-rank extra state (a few KB) to rank 0, which
    writes it with the rest (``extra_files`` is updated in place)."""
    fingerprint, extras, mine, failed = None, None, {}, None
    try:
        layouts = plan_parts(path, parts, max_shard_size, world, layouts)  # same specs on every rank: same verdict
        fingerprint = [tuple((f.name, f.header) for f in lay.files) for lay in layouts]
        mine = {n: bytes(d) for n, d in extra_files.items() if RANK_FILE_RE.match(n)}
        for n in mine:
            del extra_files[n]
        extras = {name: hashlib.sha256(data).hexdigest() for name, data in extra_files.items()}
    except Exception as e:  # noqa: BLE001 - agreed in the exchange below (rank agreement)
        failed = e
    local = local_path(path)
    args = (str(path) if local is None else os.path.abspath(local), bool(overwrite))  # a store: its URL
    gathered = dist.check_all_gather(f"preparing {path}", failed, (fingerprint, extras, mine, args))
    check_same_arguments(f"saving {path}", [g[3] for g in gathered], ("destination", "overwrite"))
    if len({hash(tuple(fp)) for fp, *_ in gathered}) != 1:
        check_same_tensors(path, [fp for fp, *_ in gathered])
        raise CheckpointError(f"saving {path}: ranks planned different layouts (different models or dtypes?)")
    rank_files = {n: d for _, _, m, _ in gathered for n, d in m.items()}
    if rank_files and len(rank_files) != world:  # the same verdict on every rank
        raise CheckpointError(f"saving {path}: PerRank extra_state passed on {len(rank_files)} of {world} ranks")
    extra_files.update(rank_files if rank == 0 else {})
    differ = [r for r, (_, e, _, _) in enumerate(gathered) if e != gathered[0][1]]
    if differ and rank == 0:
        # Rank 0's is the one written; per-rank values (e.g. RNG states of ranks seeded apart)
        # would come back as rank 0's on every rank.
        warnings.warn(
            f"saving {path}: extra_state differs between ranks (rank 0 vs ranks {differ}); rank 0's is "
            "saved and every rank gets it back on load",
            stacklevel=4,
        )
    return layouts


def _write_local(path: str, parts, layouts, overwrite: bool, extra_files: Mapping[str, bytes]) -> list[IndexFile]:
    """One process, local path: each file written front to back and hashed on the way
    (:func:`checkpoint.write.parts.write_sequential`), then indexes and commit."""
    indexes: list[IndexFile] = []
    try:
        with StagedCheckpoint(path, overwrite) as st:
            for part, layout in zip(parts, layouts):
                indexes.append(make_index(part, layout, write_sequential(st.dir, part, layout)))
            write_indexes_and_commit(st, parts, indexes, extra_files)
    except CheckpointError:
        raise
    except OSError as e:
        raise CheckpointWriteError(path, f"{type(e).__name__}: {e}") from e
    return indexes


def _wrap(e: BaseException, path: str, rank: int) -> BaseException:
    """An OS error as :class:`CheckpointWriteError` naming ``path`` and ``rank``; others as they are."""
    if isinstance(e, OSError) and not isinstance(e, CheckpointError):
        return CheckpointWriteError(path, f"{type(e).__name__}: {e}", rank)
    return e


def _write_local_ranks(path: str, parts, layouts, overwrite: bool, extra_files, rank: int, world: int) -> list[IndexFile]:
    """Many ranks, local path: rank 0 stages the files, every rank writes and hashes its bytes,
    fsyncs its share of the files while reading back the chunks it must, the digests are
    gathered, and rank 0 writes the indexes and commits. Each step ends in an agreement, so every
    rank raises when one failed (its own error there, RankAgreementError elsewhere)."""
    files = [f for lay in layouts for f in lay.files]
    staged: StagedCheckpoint | None = None
    err: BaseException | None = None
    staging_dir = None
    if rank == 0:
        try:
            staged = create_files(path, overwrite, files)
            staging_dir = staged.dir
        except BaseException as e:  # noqa: BLE001 - agreed below, re-raised on every rank
            err = e if not isinstance(e, OSError) or isinstance(e, CheckpointError) else CheckpointWriteError(path, str(e), 0)
    try:
        staging_dir = dist.check_all_gather(f"preparing {path}", err, staging_dir)[0]
        err, hashed = None, None
        try:
            hashed = write_owned(path, staging_dir, parts, layouts, rank, world)
        except BaseException as e:  # noqa: BLE001 - agreed below
            err = e
        dist.check_all(f"writing {path}", err)
        # Every file is fsynced by one rank (fsync flushes all ranks' pages of the file; each
        # writer started their writeback already) while the hash thread reads back this rank's
        # straddling chunks.
        err = None
        try:
            got = settle_files(staging_dir, [f.name for j, f in enumerate(files) if j % world == rank], hashed.back)
            for fqn, more in got.items():
                hashed.chunks.setdefault(fqn, []).extend(more)
        except BaseException as e:  # noqa: BLE001
            err = _wrap(e, path, rank)
        gathered = dist.check_all_gather(f"hashing {path}", err, (hashed.whole, chunk_runs(hashed.chunks), hashed.covered))
        check_covered(path, [c for *_, c in gathered], {sp.fqn: math.prod(sp.shape) for p in parts for sp in p.specs})
        sizes = {slot.spec.fqn: slot.end - slot.begin for f in files for slot in f.slots}
        digests = tensor_digests([w for w, _, _ in gathered], [r for _, r, _ in gathered], sizes)
        indexes = indexes_of(parts, layouts, digests)
        err = None
        if rank == 0:
            try:
                write_indexes_and_commit(staged, parts, indexes, extra_files)  # rank 0's extra files
            except BaseException as e:  # noqa: BLE001
                err = _wrap(e, path, 0)
        dist.check_all(f"committing {path}", err)
        return indexes
    finally:
        if staged is not None:
            staged.__exit__(None, None, None)
