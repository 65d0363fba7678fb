"""Exceptions of the ``checkpoint`` package. Every message names the offending file, key or rank.

Other engineers add their own types here with small edits; keep each one specific.
"""

from __future__ import annotations

import contextlib
import pickle
from collections.abc import Iterable, Iterator
from typing import Any


class CheckpointError(Exception):
    """Base class of every error raised by :mod:`checkpoint`. Its message holds no credential:
    string arguments pass through :func:`checkpoint.storage.secrets.scrub` here, once for every
    subclass."""

    def __init__(self, *args: Any):
        from .storage.secrets import scrub

        super().__init__(*(scrub(a) if isinstance(a, str) else a for a in args))

    def __reduce__(self) -> tuple:
        # Errors cross processes pickled (DCP gathers every rank's exception to every rank;
        # multiprocessing): subclasses' __init__ take other arguments than ``args``, so rebuild
        # from ``args`` and the attributes, without calling __init__ again.
        return (_rebuild, (type(self), self.args, dict(self.__dict__)))


def _rebuild(cls: type, args: tuple, state: dict) -> CheckpointError:
    """An error of ``cls`` unpickled: its ``args`` and attributes as they were."""
    err = cls.__new__(cls)
    err.args = args
    err.__dict__.update(state)
    return err


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """No checkpoint (index, ``model.safetensors`` or ``.safetensors`` file) at ``path``."""

    def __init__(self, path: str, why: str = ""):
        self.path = str(path)
        extra = f" ({why})" if why else ""
        super().__init__(f"no checkpoint at {self.path}{extra}")

    def __str__(self) -> str:  # OSError would format (errno, strerror)
        return self.args[0]


class CheckpointExistsError(CheckpointError, FileExistsError):
    """``path`` exists and ``overwrite=True`` was not given (or it is not a checkpoint directory)."""

    agreed = True  # every rank of a distributed save raises it (checkpoint.ranks.dist.check_all)

    def __init__(self, path: str, why: str = "pass overwrite=True to replace it"):
        self.path, self.why = str(path), why
        super().__init__(f"{self.path} already exists; {why}")

    def agreed_args(self) -> tuple[str, str]:
        return self.path, self.why

    def __str__(self) -> str:
        return self.args[0]


class NestedCheckpointError(CheckpointError, ValueError):
    """A save to ``path``, which lies inside the folder of checkpoint ``outer``: refused."""

    def __init__(self, path: str, outer: str):
        self.path, self.outer = str(path), str(outer)
        super().__init__(
            f"refusing to save a checkpoint at {self.path}: it is inside the checkpoint {self.outer} "
            "(a save, overwrite or retention of that checkpoint manages only its own files); "
            "save it beside it instead"
        )


class MissingShardError(CheckpointError, FileNotFoundError):
    """The index names shard file(s) that are not on disk. ``shards`` lists them."""

    def __init__(self, checkpoint: str, shards: Iterable[str], index: str):
        self.path = str(checkpoint)
        self.shards = sorted(shards)
        super().__init__(
            f"index {index} in {self.path} names shard file(s) missing on disk: {self.shards} "
            "(interrupted copy or download?)"
        )

    def __str__(self) -> str:
        return self.args[0]


class TensorNotInShardError(CheckpointError, ValueError):
    """The index maps ``key`` to ``shard`` but that shard's header does not hold it."""

    def __init__(self, key: str, shard: str, found_in: str | None = None):
        self.key, self.shard, self.found_in = key, shard, found_in
        where = f"; it is in {found_in!r} instead" if found_in else ""
        super().__init__(f"index maps tensor {key!r} to shard {shard!r}, whose header lacks it{where}")


class DuplicateTensorError(CheckpointError, ValueError):
    """Tensor ``key`` is stored in more than one file of the checkpoint."""

    def __init__(self, key: str, files: Iterable[str]):
        self.key, self.files = key, sorted(files)
        super().__init__(f"tensor {key!r} is stored in several files: {self.files}")


class UnsafePathError(CheckpointError, ValueError):
    """An index entry leads outside the checkpoint directory (``..``, absolute path or symlink)."""

    def __init__(self, entry: str, checkpoint: str, why: str):
        self.entry, self.path = entry, str(checkpoint)
        super().__init__(f"index entry {entry!r} of {self.path} is refused: {why}")


class CorruptCheckpointError(CheckpointError, ValueError):
    """A file is not a valid safetensors file / index (bad header, offsets, JSON, LFS pointer), or
    its bytes differ from the index's digests. ``key``: the entry at fault inside the file (tensor
    name, JSON field), when known. Raised alike on every rank of a collective load when one rank
    finds it (checkpoint.ranks.dist.check_all): the file is as corrupt for all of them."""

    agreed = True

    def __init__(self, file: str, why: str, key: str | None = None):
        self.file, self.key, self.why = str(file), key, why
        super().__init__(f"{self.file}: {why}")

    def agreed_args(self) -> tuple[str, str, str | None]:
        return self.file, self.why, self.key


class ChecksumMismatchError(CheckpointError, ValueError):
    """A file's sha256 or byte size differs from the one the index recorded."""

    def __init__(self, file: str, expected: str, actual: str):
        self.file, self.expected, self.actual = str(file), expected, actual
        super().__init__(f"{self.file}: checksum mismatch (index says {expected}, file has {actual})")


class CheckpointMismatchError(CheckpointError):
    """A strict load found missing / unexpected / shape-mismatched keys. ``report`` is the LoadReport."""

    def __init__(self, report: Any, path: str = ""):
        self.report = report
        parts = []
        for label, keys in (("missing", report.missing_keys), ("unexpected", report.unexpected_keys)):
            if keys:
                parts.append(f"{label} keys {_head(keys)}")
        shapes = [f"{m.key!r} checkpoint {tuple(m.checkpoint_shape)}, target {tuple(m.target_shape)}"
                  for m in report.shape_mismatched]  # fmt: skip
        if shapes:
            more = f" (+{len(shapes) - 10} more)" if len(shapes) > 10 else ""
            parts.append(f"shape-mismatched keys {'; '.join(shapes[:10])}{more}")
        where = f" {path}" if path else ""
        super().__init__(f"checkpoint{where} does not match the target: " + "; ".join(parts))


class TiedValuesMismatchError(CheckpointError, ValueError):
    """Names the target ties to one tensor are stored as separate tensors with different values;
    loading would let one silently overwrite the other, so nothing is loaded."""

    def __init__(self, keys: Iterable[str], files: Iterable[str], path: str):
        self.keys, self.files, self.path = list(keys), sorted(set(files)), str(path)
        super().__init__(
            f"{self.path}: tied names {self.keys} (one tensor in the target) are stored separately in "
            f"{self.files} with different values; refusing to pick one"
        )


class MetaTargetError(CheckpointError, ValueError):
    """Target tensors are on the meta device: copying into them is a no-op (they hold no data).
    ``keys`` lists them. Pass ``assign=True`` to replace them with the checkpoint's tensors
    (``how``: the remedy the message gives, another one for a DCP load)."""

    def __init__(self, keys: Iterable[str], path: str, how: str = "pass assign=True to replace them with the checkpoint's tensors"):
        self.keys, self.path = sorted(keys), str(path)
        super().__init__(
            f"loading {self.path}: target tensors {_head(self.keys)} are on the meta device (no data to "
            f"copy into); {how}"
        )


class UnwritableTargetError(CheckpointError, ValueError):
    """Target tensor ``key`` cannot take an in-place copy (``why``: expanded / overlapping memory,
    inference tensor, non-strided layout, ...). Nothing was loaded."""

    def __init__(self, key: str, path: str, why: str):
        self.key, self.path, self.why = key, str(path), why
        super().__init__(f"loading {self.path}: target tensor {key!r} cannot be written in place: {why}")


class OverlappingTargetsError(CheckpointError, ValueError):
    """Distinct target tensors ``keys`` share memory and the checkpoint holds different values for
    the shared elements: whichever is copied last would win silently. Nothing was loaded."""

    def __init__(self, keys: Iterable[str], path: str):
        self.keys, self.path = list(keys), str(path)
        super().__init__(
            f"loading {self.path}: target tensors {self.keys} share memory and the checkpoint holds "
            "different values for the shared elements; refusing to pick one"
        )


class LossyConversionError(CheckpointError, ValueError):
    """Stored ``key`` (dtype ``src``) cannot be converted to the target's dtype ``dst`` without
    losing values (``why``). Pass ``allow_lossy=True`` to convert anyway. Nothing was loaded."""

    def __init__(self, key: str, file: str, src: str, dst: str, why: str):
        self.key, self.file, self.src, self.dst = key, str(file), src, dst
        super().__init__(
            f"{self.file}: tensor {key!r} is {src}, the target is {dst}: {why} "
            "(pass allow_lossy=True to convert anyway)"
        )


class LoadError(CheckpointError):
    """torch (or the OS) failed while reading or writing ``key`` of ``file``; ``__cause__`` holds
    the original error."""

    def __init__(self, key: str, file: str, why: str):
        self.key, self.file = key, str(file)
        super().__init__(f"{self.file}: loading {key!r} failed: {why}")


class CheckpointWriteError(CheckpointError, OSError):
    """Writing the checkpoint failed (e.g. disk full) on some rank; the previous checkpoint is intact."""

    def __init__(self, path: str, why: str, rank: int | None = None):
        self.path, self.rank = str(path), rank
        on = f" on rank {rank}" if rank is not None else ""
        super().__init__(f"saving {self.path} failed{on}: {why}; any previous checkpoint there is intact")

    def __str__(self) -> str:
        return self.args[0]


class ConcurrentSaveError(CheckpointWriteError):
    """Another save committed a checkpoint at ``path`` after this save (or removal) started: this
    one was refused and what it wrote removed; the other checkpoint is whole and stays. Raised
    where the store has conditional writes (S3), or found by a re-read just before the commit."""

    agreed = True  # every rank of a distributed save raises it (checkpoint.ranks.dist.check_all)

    def __init__(self, path: str, why: str = "another save committed there after this save started; this save was refused"):
        self.why = why
        super().__init__(path, why)

    def agreed_args(self) -> tuple[str, str]:
        return self.path, self.why


class SnapshotChangedError(CheckpointError, RuntimeError):
    """An ``async_save(..., background_staging=True)`` found tensor ``key`` written in place after the
    call returned and before the background thread had staged it (seen through the tensor's version
    counter), so its snapshot would mix old and new values. Nothing was written at ``path``; any
    previous checkpoint there is intact. Writes through ``optimizer.step()`` wait for the staging
    and never cause this; other writers must call ``SaveFuture.wait_staged()`` first."""

    def __init__(self, key: str, path: str):
        self.key, self.path = key, str(path)
        super().__init__(
            f"{key!r} was written in place after async_save(..., background_staging=True) returned and before "
            f"it was staged: its snapshot would mix values; nothing was written at {self.path}. Call "
            "future.wait_staged() before writing it by other means than optimizer.step()"
        )

    def __str__(self) -> str:
        return self.args[0]


class UnsavableError(CheckpointError, ValueError):
    """``save`` refused, before writing anything, a name or value the safetensors format cannot
    hold (``key``: the tensor name, or the shard file whose header is too large), or an argument
    it cannot take (``key``: ``"max_shard_size"``, the message naming its value). Any previous
    checkpoint at ``path`` is untouched."""

    def __init__(self, key: Any, why: str, path: str = ""):
        self.key, self.path = key, str(path)
        self.file = self.path  # like UnsupportedTensorError / the CLI's error fields
        where = f"saving {self.path}: " if path else ""
        # Not super(): UnsavableTypeError's next base (UnsupportedTensorError) takes other arguments.
        Exception.__init__(self, f"{where}{key!r}: {why}; nothing was written")


class UnsupportedTensorError(CheckpointError, TypeError):
    """Tensor ``key`` of ``file`` cannot be stored or read as flat bytes: a layout other than
    strided (sparse, nested, mkldnn), a quantized tensor, or a dtype safetensors cannot hold
    (e.g. complex128). A ``TypeError`` too, for callers that caught the old error."""

    def __init__(self, file: str, key: str, why: str):
        self.file, self.key = str(file), key
        super().__init__(f"{self.file}: tensor {key!r}: {why}")


class QuantizationError(CheckpointError, ValueError):
    """Quantized weights that cannot be read back as the values they stand for: a block-scale
    grid that does not cover its weight, MXFP4 scales of another shape than their blocks, or a
    ``config.json`` ``quantization_config`` that disagrees with the tensors (or does not parse).
    ``file`` and ``key`` name the tensor (or ``quantization_config``) at fault."""

    def __init__(self, file: str, key: str, why: str):
        self.file, self.key = str(file), key
        super().__init__(f"{self.file}: {key!r}: {why}")


class UnsavableTypeError(UnsavableError, UnsupportedTensorError):
    """:class:`UnsavableError` for a value of a type safetensors cannot store (dtype, layout); also
    an :class:`UnsupportedTensorError`, the same kind of fault met while reading."""


class InterruptedCommitError(CheckpointError, OSError):
    """A save into ``path`` was killed after its commit point, while moving its files into place:
    the directory holds part of two checkpoints. Readers never write, so none completes it; the
    next save there (or :func:`checkpoint.recover`, ``fqnckpt recover PATH``) does, from the
    manifest the save left."""

    def __init__(self, path: str, why: str):
        self.path = str(path)
        super().__init__(
            f"{self.path}: a save was interrupted while committing ({why}); readers do not change it: "
            "the next save there completes it, or run `fqnckpt recover PATH` (checkpoint.recover)"
        )

    def __str__(self) -> str:
        return self.args[0]


class RankAgreementError(CheckpointError):
    """Another rank failed during a collective save / load; ``failures`` maps rank -> message."""

    def __init__(self, what: str, failures: dict[int, str]):
        self.failures = dict(failures)
        lines = "; ".join(f"rank {r}: {m}" for r, m in sorted(self.failures.items()))
        super().__init__(f"{what} failed on rank(s) {sorted(self.failures)}: {lines}")


class RankMismatchError(CheckpointError, ValueError):
    """The ranks of one collective call were given different arguments (a destination per rank,
    different ``overwrite`` flags or steps): refused on every rank before anything is written,
    since only one rank's value could take effect and the others would be ignored silently.
    ``values`` maps rank -> that rank's value (as text)."""

    def __init__(self, what: str, argument: str, values: dict[int, str], note: str | None = None):
        self.argument, self.values = argument, dict(values)
        first = self.values[min(self.values)]
        differ = {r: v for r, v in sorted(self.values.items()) if v != first}
        shown = "; ".join(f"rank {r}: {v}" for r, v in [(min(self.values), first), *differ.items()][:4])
        super().__init__(
            f"{what}: the ranks differ in {argument} ({shown}{'; ...' if len(differ) > 3 else ''}); "
            + (note or "a collective call needs the same value on every rank")
        )


class UnsupportedFormatError(CheckpointError, ValueError):
    """A source file's content matches no format fqnckpt reads (sniffed from its first bytes)."""

    def __init__(self, file: str, why: str):
        self.file = str(file)
        super().__init__(f"{self.file}: {why}")


class UnsafePickleError(CheckpointError, pickle.UnpicklingError):
    """A pickle references globals outside the ``weights_only`` safe set; ``globals`` lists them.
    Nothing was unpickled. Pass the ones you trust by name in ``trusted_globals=[...]``."""

    def __init__(self, file: str, globals: Iterable[str], why: str = ""):
        self.file, self.globals = str(file), sorted(globals)
        what = f"unsafe globals {self.globals}" if self.globals else why
        hint = " (pass trusted_globals=[...] / --trust NAME for the ones you trust)" if self.globals else ""
        super().__init__(f"{self.file}: refused to unpickle: {what}{hint}")


class AmbiguousSourceError(CheckpointError, ValueError):
    """The source holds several candidate containers (or ``key`` is wrong); ``choices`` lists them."""

    def __init__(self, file: str, choices: Iterable[str], why: str = "", choice_of: str = "key"):
        self.file, self.choices = str(file), list(choices)
        super().__init__(f"{self.file}: {why}; choices for {choice_of}: {self.choices}")


class DCPLoadError(CheckpointError, ValueError):
    """A DCP checkpoint cannot be loaded as asked (``path`` names the DCP directory)."""

    def __init__(self, path: str, why: str):
        self.path = str(path)
        super().__init__(f"DCP checkpoint {self.path}: {why}")


class UnknownReadItemError(DCPLoadError, KeyError):
    """A DCP load plan asks for ``key`` (at storage offsets ``offsets``; None for a non-tensor
    value) which the checkpoint's metadata lacks: a planner that planned against other metadata,
    or a plan edited by hand. Raised by ``StorageReader.read_data`` before anything is read. A
    ``KeyError`` too, for callers that caught the bare one."""

    def __init__(self, path: str, key: str, offsets: tuple[int, ...] | None = None):
        self.key, self.offsets = key, offsets
        at = f" at storage offsets {list(offsets)}" if offsets is not None else " (a non-tensor value)"
        super().__init__(path, f"the load plan reads {key!r}{at}, which its metadata does not hold; nothing was read")

    def __str__(self) -> str:  # KeyError would show the message quoted
        return self.args[0]


class AdapterConfigMismatchError(CheckpointError, ValueError):
    """The ``adapter_config.json`` saved in ``file`` and the target's peft config (adapter
    ``adapter``) differ in fields that change what the model computes (LoRA's rank, scaling,
    targeted modules, ...): ``fields`` maps each such field to ``(saved, target)``; ``key`` is the
    first. peft and transformers build the model from the saved config, so loading its tensors
    into a target built otherwise would give other outputs. Raised before any tensor changes."""

    def __init__(self, file: str, adapter: str, fields: dict[str, tuple[Any, Any]]):
        self.file, self.adapter, self.fields = str(file), adapter, dict(fields)
        self.key = next(iter(self.fields))
        shown = "; ".join(f"{k}: saved {s!r}, target {t!r}" for k, (s, t) in self.fields.items())
        super().__init__(
            f"{self.file}: the saved adapter config differs from the target's peft config (adapter "
            f"{adapter!r}) in {shown}; peft and transformers build the model from the saved config: "
            "build the target from it (peft.PeftConfig.from_pretrained) and load again; nothing was loaded"
        )


class ExtraStateMismatchError(CheckpointError, TypeError):
    """An ``extra_state`` entry of the checkpoint does not fit the caller's object: saved plain
    vs. through ``state_dict()``, another class, other keys, or the object's own
    ``load_state_dict`` refused it (tried on a copy, or undone). Raised before anything changed;
    ``key`` names the entry, ``file`` the file it is stored in."""

    def __init__(self, key: str, file: str, why: str):
        self.key, self.file = key, str(file)
        super().__init__(f"{self.file}: extra_state {key!r} {why}; nothing was loaded")


class MigrationError(CheckpointError):
    """A migration stopped (unresolved / ambiguous / colliding / missing keys); ``report`` is the
    :class:`checkpoint.MigrationReport` explaining every decision. Nothing was written."""

    def __init__(self, report: Any, why: str):
        self.report = report
        super().__init__(f"migration of {report.source} stopped: {why}")


class ExternalError(CheckpointError):
    """A library fqnckpt calls (torch, safetensors, pydantic, DCP, the OS) failed in a way no
    specific error of ours describes. ``file`` / ``key`` / ``rank`` say where (``None`` when
    unknown), ``cause`` is the original exception (also chained as ``__cause__``)."""

    def __init__(
        self, file: str | None, cause: BaseException, key: str | None = None, rank: int | None = None,
        what: str = "",
    ):  # fmt: skip
        self.file = str(file) if file is not None else None
        self.key, self.rank, self.cause = key, rank, cause
        where = ": ".join(
            x
            for x in (self.file, f"tensor {key!r}" if key else "", f"rank {rank}" if rank is not None else "")
            if x
        )
        detail = _typed(cause)
        super().__init__(f"{where or '<no file>'}: {what + ' ' if what else ''}failed: {detail}")


def _typed(e: BaseException) -> str:
    detail = _cause_detail(e)
    return f"{type(e).__name__}: {detail}" if detail else type(e).__name__


def _cause_detail(cause: BaseException) -> str:
    """One line for ``cause``: DCP's ``CheckpointException`` carries each rank's exception in
    ``failures`` and a whole traceback in its text; the first rank's own exception is used."""
    failures = getattr(cause, "failures", None)
    if isinstance(failures, dict) and failures:
        rank, wrapped = sorted(failures.items(), key=lambda kv: str(kv[0]))[0]
        inner = wrapped[0] if isinstance(wrapped, tuple) and wrapped else wrapped
        if isinstance(inner, BaseException):
            return f"on rank {rank}: {_typed(inner)}"
    lines = [ln.strip() for ln in str(cause).splitlines() if ln.strip()]
    if any(ln.startswith("Traceback") for ln in lines):
        lines = lines[-1:]  # the exception line of an embedded traceback
    return " ".join(" ".join(lines).split())


@contextlib.contextmanager
def external_errors(file: str | None, key: str | None = None, what: str = "") -> Iterator[None]:
    """Re-raise any exception from inside the block that is not ours as :class:`ExternalError`
    naming ``file`` / ``key`` (ours, ``fqn``'s and KeyboardInterrupt / SystemExit pass through).
    Catches ``BaseException``: DCP's ``CheckpointException`` derives from it, not from Exception."""
    from fqn.errors import FQNError

    try:
        yield
    except (CheckpointError, FQNError, KeyboardInterrupt, SystemExit, GeneratorExit):
        raise
    except BaseException as e:  # noqa: BLE001 - named and chained, never swallowed
        raise ExternalError(file, e, key, what=what) from e


def error_fields(e: BaseException) -> dict[str, Any]:
    """``{"error", "file", "key", "rank"}`` of an exception, for one-line / JSON reports: taken
    from the attributes our errors carry (``file`` / ``path`` / ``shard``; ``key`` / ``entry``)."""
    file = next((getattr(e, a) for a in ("file", "shard", "path") if getattr(e, a, None) is not None), None)
    if file is None and getattr(e, "files", None):
        file = ", ".join(map(str, e.files))
    key = next((getattr(e, a) for a in ("key", "entry") if getattr(e, a, None) is not None), None)
    from .storage.secrets import scrub

    return {
        "error": type(e).__name__,
        "message": scrub(str(e)),
        "file": scrub(str(file)) if file is not None else None,
        "key": key if key is None or isinstance(key, str) else str(key),
        "rank": getattr(e, "rank", None),
    }


def _head(keys: list[str], n: int = 10) -> str:
    more = f" (+{len(keys) - n} more)" if len(keys) > n else ""
    return f"{keys[:n]}{more}"


class UnsupportedStorageError(CheckpointError, ValueError):
    """A URL (``scheme://...``) whose scheme no installed fsspec backend serves (or fsspec itself
    is missing). URLs are never taken as local paths; ``scheme`` names it, the message names the
    extra to install."""

    def __init__(self, url: str, scheme: str, why: str = ""):
        self.url, self.scheme = str(url), scheme
        extra = f" ({why})" if why else ""
        super().__init__(
            f"{self.url}: no storage backend for {scheme!r}://{extra}; install it with "
            "`pip install fqnckpt[s3]` (fsspec + s3fs) or the fsspec backend package for that scheme"
        )


class UnsupportedURLError(UnsupportedStorageError):
    """A URL with a query (``?versionId=...``) or a fragment (``#...``). A checkpoint at a URL is
    a prefix of objects written and read by their plain names (index, shards, extra state): a
    query cannot pick an object version for all of them and a writer cannot honour one, so it is
    refused for every entry point (:func:`checkpoint.storage.urls.check_url`). ``url`` is the URL
    as messages show it (query values and fragment masked), ``parts`` what it carries
    (``"query keys [...]"``, ``"a fragment"``)."""

    def __init__(self, url: str, scheme: str, parts: list[str]):
        from .storage.secrets import scrub

        url = scrub(str(url))  # as the message shows it (scrub masks "Signature=..." whole)
        self.url, self.scheme, self.file, self.parts = url, scheme, url, list(parts)
        CheckpointError.__init__(
            self,
            # (a space after the URL: a ":" there would read as part of its masked query value)
            f"{self.url} carries {' and '.join(self.parts)}, which a checkpoint URL cannot: it is a "
            "prefix of objects read and written by their plain names, so a query (an object version, "
            "a signature) or fragment cannot apply to them and a save could not honour it; give the "
            "URL without '?...' and '#...' (filesystem settings go in storage_options)",
        )
