"""``CheckpointManager``: numbered training checkpoints under one root, saved in the background,
with retention.

``root/step-00000100`` is a checkpoint in fqnckpt's (Hugging Face) layout, committed atomically by
:func:`checkpoint.save` / :func:`checkpoint.async_save`, so a step directory is visible only once
complete and a kill at any moment leaves :meth:`CheckpointManager.latest` on a complete checkpoint.
Under a URL root (``s3://bucket/run``, ``memory://...``; ``storage_options`` go to fsspec) a step
is the object prefix ``root/step-00000100/``, committed by its model index written last
(:mod:`checkpoint.storage.commit`). Steps, completeness and retention are one code path over the
root's byte store (a local directory's too):
retention removes a step with :func:`checkpoint.storage.commit.remove_checkpoint`, its model
index first (from then on the step is incomplete, never loaded), then only the files its records
name; a user's file in a step directory stays (and so does the directory). A step left without
an index by a killed save or removal is removed by the next retention.

Fault points (``checkpoint.testing.faults``) of the manager, for crash tests:
``manager_before_retention`` (committed, nothing removed) and ``manager_after_retention_removal``
(one old checkpoint removed).
"""

from __future__ import annotations

import contextlib
import os
import re
import warnings
from collections.abc import Mapping, MutableMapping
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from ..testing import faults
from ..storage.opening import recover
from ..ranks import dist
from ..errors import CheckpointError, CheckpointExistsError, CheckpointNotFoundError, InterruptedCommitError, RankMismatchError
from ..storage.extra_state import PerRank, read_extra_state_file
from ..storage.location import local_path, local_target, resolve, store_of
from ..storage.views import checkpoint_view
from ..storage.commit import is_committed, remove_checkpoint
from .async_save import AsyncSaver, SaveFuture
from .rng_state import RNGState

# ASCII digits only (``\d`` also matches e.g. Arabic-Indic digits, which int() accepts).
_STEP_DIR = re.compile(r"^step-([0-9]{8,})$")
# What a killed save of a step leaves beside it: its staging directory, its lock file.
_LEFTOVER = re.compile(r"^\.(step-[0-9]{8,})\.fqnckpt-(?:staging-[0-9a-f]{32}|lock)$")


class ForeignEntryWarning(UserWarning):
    """A ``step-*`` entry under a manager's root that the manager did not write (its name is not
    one :func:`step_dir_name` gives, or it is not a plain directory): never read, never removed."""


def step_dir_name(step: int) -> str:
    """``100`` -> ``step-00000100``."""
    return f"step-{step:08d}"


def parse_step_dir_name(name: str) -> int | None:
    """The step of a directory name the manager writes, else None: ``step-00000100`` -> 100;
    ``step-100``, ``step-000000100`` (another spelling of 100), ``step-abc``, ``step-5.bak`` -> None.
    Strict, so one step has one name and a foreign directory is never taken for a step."""
    m = _STEP_DIR.match(name)
    if m is None:
        return None
    step = int(m.group(1))
    return step if step_dir_name(step) == name else None


def is_complete(path: str) -> bool:
    """A committed checkpoint directory (:func:`checkpoint.storage.commit.is_committed` on its
    byte store, as on object storage): its model index (and
    optimizer index, if any) parses, every file its records name exists, shards with the byte
    size recorded. No tensor data is read."""
    if not os.path.isdir(path) or os.path.islink(path):
        return False
    return is_committed(store_of(path))


RNG_KEY = "fqnckpt.rng"  # the manager's per-rank RNG entry in extra_state
# A plain (DDP-style) module saved on several ranks: one process's save writes the checkpoint, so
# every rank's RNG states are gathered (list by rank) into one shared entry instead.
RNG_RANKS_KEY = "fqnckpt.rng.ranks"


def _per_rank_savable(module: Any) -> bool:
    """Whether a save of ``module`` runs on every rank (so every rank's per-rank state is kept):
    one rank in all, or DTensors in the state (saved collectively)."""
    if not dist.active() or dist.world_size() == 1:
        return True
    tensors = module.values() if isinstance(module, Mapping) else module.state_dict().values()
    return any(isinstance(t, DTensor) for t in tensors)


def _steps_in(store: Any) -> list[tuple[int, bool]]:
    """``(step, complete)`` of each directory under ``store`` named as :func:`step_dir_name` names
    it (a plain directory, not a symlink), ascending. Reads indexes only; changes nothing."""
    return [
        (step, is_committed(store.child(name))) for name, (kind, _) in sorted(store.listing().items())
        if kind == "directory" and (step := parse_step_dir_name(name)) is not None
    ]  # fmt: skip


def _foreign_in(store: Any) -> list[str]:
    """Names under ``store`` starting ``step-`` that a manager did not write: another spelling
    (``step-5``, ``step-abc``, ``step-00000005.bak``), or not a plain directory (a file or a
    symlink named ``step-00000007``). Sorted."""
    return sorted(
        n for n, (kind, _) in store.listing().items()
        if n.startswith("step-") and (parse_step_dir_name(n) is None or kind != "directory")
    )  # fmt: skip


def list_steps(root: str) -> list[tuple[int, bool]]:
    """:func:`_steps_in` of local directory ``root``."""
    return _steps_in(store_of(root))


def foreign_step_entries(root: str) -> list[str]:
    """:func:`_foreign_in` of local directory ``root``."""
    return _foreign_in(store_of(root))


class CheckpointManager:
    """Save ``root/step-{step:08d}`` checkpoints, find the newest complete one, keep the newest few.

    ``root``: directory (created). ``keep_latest``: how many complete checkpoints to keep (None:
    all); after each save the older complete ones beyond that are removed, never the one just
    written nor the newest complete one. ``async_save``: save with :func:`checkpoint.async_save`
    (the call returns once the state is staged; one save in flight, the next waits for it).
    ``background_staging``: passed to :func:`checkpoint.async_save` (the optimizer's tensors are
    copied while the next forward / backward runs; its next ``step()`` waits for the copy; read
    the contract there).
    ``rng_state``: also save each rank's random generators (torch CPU, the accelerator's, Python
    ``random``, numpy: :class:`~checkpoint.training.rng_state.RNGState`) as the per-rank extra
    state entry ``"fqnckpt.rng"``, and restore them in :meth:`load_latest` (on the same rank; on
    another world size re-derived per rank by :meth:`RNGState.reshard`), whether or not it is
    given an ``extra_state`` dict (with ``None`` the RNG states alone are read: exact resume by
    default; ``rng_state=False`` restores none). A module without DTensors on several ranks (DDP)
    is written by one process's save, so every rank's states are gathered into the shared entry
    ``"fqnckpt.rng.ranks"`` (a list by rank; call ``save`` on every rank, as every method) and
    each rank takes its own back (another world size: :meth:`RNGState.reshard`). Checkpoints that
    hold none restore none.

    ``root`` may be a URL (``s3://bucket/run``, ``memory://...``): steps are object prefixes
    committed by their model index (see the module docstring); ``storage_options`` go to the
    fsspec filesystem, ``transfer`` (:class:`~checkpoint.storage.objstore.TransferConfig`) sets
    upload part size, parts in flight and retries.

    ``module`` / ``optimizer`` (optional): the state later saves take. With ``async_save`` the
    staging memory of the first save is then touched in the background from the start (as
    :meth:`load_latest` does; see ``_prepare_soon``), so that save blocks about as long as later
    ones; the optimizer's state that does not exist yet is touched after its first ``step()``.
    Nothing is read or written on disk for them here, and no collective runs.

    On many ranks create it and call every method on every rank; rank 0 removes old checkpoints.

    Raises:
        ValueError: ``keep_latest`` is not None or an int >= 1.
        UnsupportedStorageError: a URL whose scheme has no installed fsspec backend.
        CheckpointExistsError: a local ``root`` (or a folder above it) is a file.
    """

    def __init__(
        self,
        root: str | os.PathLike,
        *,
        keep_latest: int | None = None,
        async_save: bool = True,
        background_staging: bool = False,
        rng_state: bool = True,
        storage_options: Mapping[str, Any] | None = None,
        transfer: Any = None,
        module: torch.nn.Module | Mapping[str, torch.Tensor] | None = None,
        optimizer: torch.optim.Optimizer | None = None,
    ):
        if keep_latest is not None and (
            isinstance(keep_latest, bool) or not isinstance(keep_latest, int) or keep_latest < 1
        ):
            raise ValueError(f"keep_latest must be None or an int >= 1, got {keep_latest!r}")
        where = resolve(root, storage_options, transfer)
        local = local_path(where)
        # One byte store under every root: steps, retention and leftovers are the same code.
        self._store = store_of(os.path.abspath(local) if local is not None else where)
        self.root = self._store.url
        self.keep_latest = keep_latest
        self._saver = AsyncSaver() if async_save else None
        self.background_staging = background_staging
        self.rng_state = rng_state
        self._future: SaveFuture | None = None
        self._step_hook: Any = None  # see _prepare_soon
        self.last_report = None  # LoadReport of the last load_latest
        try:
            self._store.ensure_dir()
        except (FileExistsError, NotADirectoryError):
            raise CheckpointExistsError(self.root, "it or a folder above it is a file, not a directory of steps") from None
        if dist.rank() == 0:
            self._recover_steps()
            foreign = self.foreign_entries()
            if foreign:
                warnings.warn(
                    f"{self.root}: {foreign} are not step directories this manager writes "
                    f"(step-NNNNNNNN, at least 8 digits); they are never loaded or removed",
                    ForeignEntryWarning,
                    stacklevel=2,
                )
        if module is not None:
            self._prepare_soon(module, optimizer)

    # -- finding checkpoints -------------------------------------------------------------------
    def path(self, step: int) -> str:
        """Where step ``step`` is (or would be) saved (a URL under an ``s3://`` root)."""
        return self._store.url_of(step_dir_name(step))

    def _where(self, step: int) -> Any:
        """Where :func:`checkpoint.save` / :func:`checkpoint.load` take step ``step``."""
        return local_target(self._store.child(step_dir_name(step)))  # a local directory as its path

    def steps(self) -> list[int]:
        """Steps of the complete checkpoints under ``root``, ascending: only directories named as
        :func:`step_dir_name` names them (see :meth:`foreign_entries` for the rest)."""
        return [step for step, complete in _steps_in(self._store) if complete]

    def foreign_entries(self) -> list[str]:
        """See :func:`foreign_step_entries`: never loaded, never removed by retention."""
        return _foreign_in(self._store)

    def latest(self) -> str | None:
        """Path of the newest (highest step) complete checkpoint, or None."""
        steps = self.steps()
        return self.path(steps[-1]) if steps else None

    # -- saving ---------------------------------------------------------------------------------
    def save(
        self,
        step: int,
        module: torch.nn.Module | Mapping[str, torch.Tensor],
        optimizer: torch.optim.Optimizer | None = None,
        extra_state: Mapping[str, Any] | None = None,
        *,
        max_shard_size: int | str | None = None,
    ) -> SaveFuture | None:
        """Save ``module`` (+ ``optimizer``, ``extra_state``) as step ``step`` (replacing a
        checkpoint of the same step atomically), then apply retention. Async: first waits for the
        previous save, returns its :class:`SaveFuture` once staged; sync: returns None when done.

        Raises what :func:`checkpoint.save` raises; async: the previous save's error, raised here
        before anything new is staged (a failing disk is not silently skipped).

        Raises:
            ValueError: ``step`` is not an int >= 0.
        """
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be an int >= 0, got {step!r}")
        self.wait()
        path = self._where(step)
        if self.rng_state and RNG_KEY not in (extra_state or {}):
            if _per_rank_savable(module):
                extra_state = {**(extra_state or {}), RNG_KEY: PerRank(RNGState())}
            else:  # every rank calls save (this class's contract): each rank's states, gathered
                states = dist.check_all_gather("gathering every rank's RNG states", None, RNGState().state_dict())
                extra_state = {**(extra_state or {}), RNG_RANKS_KEY: states}
        kw = dict(optimizer=optimizer, extra_state=extra_state, max_shard_size=max_shard_size, overwrite=True)
        if self._saver is None:
            from ..saving import save

            save(module, path, layout="memory", **kw)  # a training checkpoint: the module's own names, as async saves write
            self._retain(step)
            return None
        self._future = self._saver.save(
            module,
            path,
            after_commit=lambda: self._retain(step),
            background_staging=self.background_staging,
            **kw,
        )
        return self._future

    def prepare(
        self,
        module: torch.nn.Module | Mapping[str, torch.Tensor],
        optimizer: torch.optim.Optimizer | None = None,
        *,
        max_shard_size: int | str | None = None,
    ) -> int:
        """Allocate and touch the staging memory the first async :meth:`save` of ``module`` (+
        ``optimizer``) needs, so it blocks no longer than later saves (see
        :meth:`AsyncSaver.prepare`); returns the staging bytes (0 without ``async_save``, a no-op).
        On many ranks call it on every rank.

        Raises: what :meth:`save` raises before staging (``TypeError`` / ``ValueError``)."""
        if self._saver is None:
            return 0
        return self._saver.prepare(module, optimizer=optimizer, max_shard_size=max_shard_size)

    def wait(self) -> None:
        """Block until the save in flight has committed (and retention ran); re-raise its error."""
        fut, self._future = self._future, None
        if fut is not None:
            fut.result()

    def close(self) -> None:
        """End this manager's background work: wait for the save in flight (re-raising its error,
        as :meth:`wait`), stop a background touch of staging memory, remove the optimizer hook it
        left, and end its threads (see :meth:`AsyncSaver.close`). Later async saves raise
        ``RuntimeError``; reading (``steps``, ``load_latest``) still works. Also ``with
        CheckpointManager(...) as mgr:``. Idempotent."""
        if self._step_hook is not None:
            self._step_hook.remove()
            self._step_hook = None
        try:
            self.wait()
        finally:
            if self._saver is not None:
                self._saver.close()

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    @property
    def staging_bytes(self) -> int:
        """Host bytes held by this manager's staging buffers (0 without async_save)."""
        return self._saver.staging_bytes if self._saver is not None else 0

    # -- loading --------------------------------------------------------------------------------
    def load_latest(
        self,
        module: torch.nn.Module | Mapping[str, torch.Tensor],
        optimizer: torch.optim.Optimizer | None = None,
        extra_state: MutableMapping[str, Any] | None = None,
        **load_kwargs: Any,
    ) -> int | None:
        """Load the newest complete checkpoint with :func:`checkpoint.load` (strict by default);
        returns its step, or None (nothing loaded) when there is none; the
        :class:`~checkpoint.LoadReport` is kept in ``last_report``. On many ranks rank 0 picks
        the checkpoint (its newest complete step) and every rank checks it holds that step and
        what it restores besides the model (the RNG entries) before any collective load starts:
        each root may be a node-local copy, so a rank whose root lacks the step, or whose copy
        holds other entries, is refused on every rank alike and the process group stays usable
        (two small exchanges on the default group, which also agree on a failure to list or read
        the checkpoints on any rank). With
        ``async_save``, the staging memory of the first save is then touched in the background
        (see ``_prepare_soon``), so call it at the start of a run even when nothing is saved yet.

        Raises:
            CheckpointNotFoundError: on every rank, when some rank's root has no complete
                checkpoint of the step rank 0 picked (names the step, those ranks and their
                newest steps).
            RankMismatchError: on every rank, when the ranks' copies of the step differ in the
                RNG entries they hold.
            What :func:`checkpoint.load` raises.
        """
        from ..loading import load

        self.wait()
        step = self._agreed_step()
        if step is None:
            self._prepare_soon(module, optimizer)
            return None
        where = self._where(step)
        with self._view(where):  # one save read whole (object storage: one model index)
            added, rng = False, None
            per_rank_rng, gathered_rng = self._agreed_restore(step)
            saved_rng = self.rng_state and (extra_state is None or RNG_KEY not in extra_state) and per_rank_rng
            if saved_rng and extra_state is not None:
                extra_state[RNG_KEY] = PerRank(RNGState())  # the caller's dict: plain values land there
                added = True
            elif saved_rng:
                # No extra_state: the RNG states alone (exact resume by default), checked before the
                # model changes and set after it loaded; other saved entries stay unread.
                rng = self._plan_rng(where, {RNG_KEY: PerRank(RNGState())})
            gathered = None
            if self.rng_state and not saved_rng and gathered_rng:
                gathered = self._plan_rng(where, {RNG_RANKS_KEY: None})
            try:
                self.last_report = load(
                    module, where, optimizer=optimizer, extra_state=extra_state, **load_kwargs
                )
            finally:
                if added:
                    del extra_state[RNG_KEY]
            if rng is not None:
                rng.apply()
            if gathered is not None:
                gathered.apply()
                states = gathered.target[RNG_RANKS_KEY]
                rank, world = (dist.rank(), dist.world_size()) if dist.active() else (0, 1)
                RNGState().load_state_dict(
                    states[rank] if len(states) == world else RNGState.reshard(states, rank, world)
                )
        self._prepare_soon(module, optimizer)
        return step

    def _agreed_step(self) -> int | None:
        """The step to load, the same on every rank: the newest complete one under rank 0's root
        (None: none there), after checking that every rank's root holds it complete. One exchange
        of every rank's step list (or its error listing them)."""
        mine, err = None, None
        try:
            mine = self.steps()
        except Exception as e:  # noqa: BLE001 - agreed below: no rank left waiting for rank 0
            err = e
        if not dist.active():
            if err is not None:
                raise err
            return mine[-1] if mine else None
        every = dist.check_all_gather(f"finding the latest checkpoint under {self.root}", err, (mine, self.root))
        first = every[0][0]
        step = first[-1] if first else None
        lacking = {r: (s[-1] if s else None, p) for r, (s, p) in enumerate(every) if step is not None and step not in s}
        if lacking:  # the same verdict and message on every rank: each holds every rank's list
            newest = "; ".join(f"rank {r}: {'none' if s is None else f'step {s}'}" for r, (s, _) in sorted(lacking.items()))
            r = min(lacking)
            raise CheckpointNotFoundError(
                f"{lacking[r][1]}/{step_dir_name(step)}",  # each rank's root: a path or URL
                f"on rank {r}: rank 0 loads step {step}, the newest complete checkpoint under its root, and "
                f"rank(s) {sorted(lacking)} have no complete step {step} under theirs (newest there: {newest}); "
                "copy the step to every rank's root, or remove it from rank 0's",
            )
        return step

    def _agreed_restore(self, step: int) -> tuple[bool, bool]:
        """``(per-rank RNG entry, gathered RNG entry)``: whether step ``step`` holds each, read
        from this rank's copy and compared across ranks (one exchange), so every rank takes the
        same collective path. Raises RankMismatchError on every rank when the copies differ.
        ``(False, False)`` without reading when the manager restores no RNG states."""
        if not self.rng_state:
            return False, False
        flags, err = None, None
        try:
            flags = (self._has_rng(step), self._has_gathered_rng(step))
        except Exception as e:  # noqa: BLE001 - agreed below: no rank left waiting in load
            err = e
        if not dist.active():
            if err is not None:
                raise err
            return flags
        every = dist.check_all_gather(f"reading the extra state of step {step} under {self.root}", err, (flags, self.path(step)))
        if len({f for f, _ in every}) > 1:  # the same message on every rank: each rank's copy named
            names = {(True, False): RNG_KEY, (False, True): RNG_RANKS_KEY, (True, True): f"{RNG_KEY}, {RNG_RANKS_KEY}"}
            raise RankMismatchError(
                f"loading step {step}", "the RNG entries their copies of the step hold",
                {r: f"{names.get(f, 'none')} in {p}" for r, (f, p) in enumerate(every)},
                note="each rank's copy of a step must be the same checkpoint; nothing was loaded",
            )  # fmt: skip
        return every[0][0]

    def _has_rng(self, step: int) -> bool:
        """Whether step ``step`` holds the manager's per-rank RNG entry."""
        doc = read_extra_state_file(self.path(step))
        return doc is not None and doc.per_rank is not None and RNG_KEY in doc.per_rank.keys

    def _has_gathered_rng(self, step: int) -> bool:
        """Whether step ``step`` holds every rank's RNG states gathered (a plain module's save)."""
        doc = read_extra_state_file(self.path(step))
        return doc is not None and RNG_RANKS_KEY in doc.entries

    def _plan_rng(self, where: Any, targets: dict[str, Any]):
        """This rank's saved RNG states, checked (:func:`plan_extra_state`), ready to apply. On many
        ranks a failure on any rank is agreed before the collective load starts."""
        from ..loading import open_load_reader
        from ..plan.extra_state import plan_extra_state
        from ..reports import LoadReport

        restore, err = None, None
        try:
            reader = open_load_reader(where, read_optimizer=False)
            try:
                restore = plan_extra_state(reader, targets, LoadReport(path=str(where)))
            finally:
                reader.close()
        except Exception as e:  # noqa: BLE001 - agreed below: no rank left waiting in load
            err = e
        if dist.active():
            dist.check_all(f"restoring the RNG states saved in {where}", err)
        elif err is not None:
            raise err
        return restore

    def _prepare_soon(self, module, optimizer) -> None:
        """Async saves: have the writer thread touch the staging memory of the first save now, in
        the background (:meth:`AsyncSaver.prepare` with ``background=True``: no collective, no
        wait, the bytes a save holds anyway), so that save blocks about as long as later ones
        without a :meth:`prepare` by hand (several times longer without). Optimizer state that does not
        exist yet (AdamW's before its first step) is touched after the optimizer's next ``step()``
        (a step post-hook that removes itself). Not for object storage, whose staging differs."""
        if self._saver is None or local_path(self._where(0)) is None or self._saver._closed:
            return
        try:
            self._saver.prepare(module, optimizer=optimizer, background=True)
        except (TypeError, ValueError):
            return  # the save raises it, with its own message
        if optimizer is None or self._step_hook is not None:
            return
        if all(p in optimizer.state for g in optimizer.param_groups for p in g["params"]):
            return

        def after_first_step(*_args) -> None:
            if self._step_hook is not None:
                self._step_hook.remove()
                self._step_hook = None
            try:
                self._saver.prepare(module, optimizer=optimizer, background=True)
            except (TypeError, ValueError, RuntimeError):  # RuntimeError: the manager was closed
                pass

        self._step_hook = optimizer.register_step_post_hook(after_first_step)

    def _view(self, where: Any) -> contextlib.ExitStack:
        """One step read whole (:func:`checkpoint.storage.views.checkpoint_view`). A step whose
        commit was interrupted is completed first: the manager is its root's writer."""
        stack = contextlib.ExitStack()
        try:
            stack.enter_context(checkpoint_view(where))
        except InterruptedCommitError:
            recover(where)
            stack.enter_context(checkpoint_view(where))
        return stack

    # -- retention ------------------------------------------------------------------------------
    def _retain(self, written: int) -> None:
        if dist.rank() != 0 or self.keep_latest is None:
            return
        faults.fault_point("manager_before_retention")
        steps = self.steps()
        keep = set(steps[-self.keep_latest :]) | {written}
        if steps:
            keep.add(steps[-1])
        # also older step directories without a committed index: leftovers of killed saves or removals
        listed = [parse_step_dir_name(n) for n, (kind, _) in self._store.listing().items() if kind == "directory"]
        steps = sorted(set(steps) | {s for s in listed if s is not None and s < written})
        for step in steps:
            if step in keep:
                continue
            try:  # the model index first: from then on no reader takes it for a checkpoint
                remove_checkpoint(self._store.child(step_dir_name(step)), unborn=True)  # older steps: no save may still write there
            except (OSError, CheckpointError) as e:  # the new step is committed: not its failure
                warnings.warn(f"{self.path(step)}: retention could not remove it ({e}); retried after the next save", stacklevel=2)
                continue
            faults.fault_point("manager_after_retention_removal")

    def _recover_steps(self) -> None:
        """As the next writer of its root, complete what killed saves of its steps left beside
        them (a local step's staging directory or lock file of ours;
        :func:`checkpoint.storage.opening.recover`: only what a marker or manifest of ours names is
        touched). A step with an interrupted commit inside it is completed when it is loaded
        (:meth:`_load_step`); on object storage the next commit there cleans up."""
        steps = {m.group(1) for n in self._store.listing() if (m := _LEFTOVER.match(n)) and parse_step_dir_name(m.group(1)) is not None}
        for step in sorted(steps):
            recover(local_target(self._store.child(step)))
