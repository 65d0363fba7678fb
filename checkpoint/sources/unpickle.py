"""Every unpickling fqnckpt does, behind one rule: exact ``(module, name)`` allowlists.

* DCP ``.metadata`` (a plain pickle ``weights_only`` cannot parse; torch's own reader calls
  ``pickle.load``): :class:`ExactUnpickler` over :func:`dcp_metadata_globals`. Every opcode that
  reaches a global (``GLOBAL``, ``STACK_GLOBAL``, ``INST``, ``OBJ`` / ``NEWOBJ`` / ``REDUCE`` on
  what those pushed) goes through ``find_class`` (CPython ``_pickle``), which resolves only an
  exact pair from a prebuilt table: nothing is imported or looked up by name, so a dotted name
  such as ``os.system`` inside an allowed module (which ``pickle`` resolves for protocol 4)
  never resolves. ``EXT1/2/4`` (copyreg extension codes) are refused before unpickling: CPython
  serves a code it met before from its cache without calling ``find_class``.
* ``torch.save`` files and DCP's non-tensor entries: torch's ``weights_only`` unpickler (of the
  opcodes reaching a global it accepts ``GLOBAL`` alone, looking the exact ``module.name`` string
  up in its table; ``STACK_GLOBAL`` and ``EXT1/2/4`` are unsupported operands to it), plus the
  caller's ``trusted_globals`` through ``torch.serialization.safe_globals`` (:func:`torch_load`).

A refusal is :class:`~checkpoint.errors.UnsafePickleError` naming the global and the file.
Python docs, "Restricting Globals"; torch/_weights_only_unpickler.py.
"""

from __future__ import annotations

import io
import pickle
import warnings
from collections.abc import Iterable
from typing import Any, BinaryIO

import torch

from ..errors import CorruptCheckpointError, UnsafePickleError

_DCP_METADATA = "torch.distributed.checkpoint.metadata"
_DCP_FS = "torch.distributed.checkpoint.filesystem"


def _dcp_metadata_table() -> dict[tuple[str, str], Any]:
    """The exact globals a DCP ``.metadata`` pickle holds (torch 2.x ``Metadata`` and its parts)."""
    import pathlib

    import torch.distributed.checkpoint.filesystem as fs
    import torch.distributed.checkpoint.metadata as md

    table: dict[tuple[str, str], Any] = {
        (_DCP_METADATA, n): getattr(md, n)
        for n in (
            "Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata",
            "BytesStorageMetadata", "ChunkStorageMetadata", "_MEM_FORMAT_ENCODING",
        )
        if hasattr(md, n)
    }  # fmt: skip
    for n in ("_StorageInfo", "_StoragePrefix", "SerializationFormat"):
        if hasattr(fs, n):
            table[(_DCP_FS, n)] = getattr(fs, n)
    table[("torch", "Size")] = torch.Size
    table[("torch.serialization", "_get_layout")] = torch.serialization._get_layout
    for n, v in vars(torch).items():
        if isinstance(v, torch.dtype):
            table[("torch", n)] = v
    for n in ("PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath", "Path"):
        table[("pathlib", n)] = getattr(pathlib, n)
    return table


_TABLE: dict[tuple[str, str], Any] | None = None


def dcp_metadata_globals() -> dict[tuple[str, str], Any]:
    """The exact ``(module, name)`` -> object table for DCP ``.metadata``, built once."""
    global _TABLE
    if _TABLE is None:
        _TABLE = _dcp_metadata_table()
    return _TABLE


class ExactUnpickler(pickle.Unpickler):
    """``pickle.Unpickler`` resolving only the exact ``(module, name)`` pairs of ``allowed``
    (a dict pair -> object); anything else, dotted names included, is
    :class:`UnsafePickleError` naming ``file`` and the global. Persistent ids are refused, and
    so is any ``EXT1`` / ``EXT2`` / ``EXT4`` opcode: CPython serves an extension code it met
    before from copyreg's cache, bypassing ``find_class``. So where copyreg has any extension
    registered or cached, the stream is scanned for those opcodes on construction; where it has
    none (the usual case), no EXT opcode can load (CPython raises "unregistered extension
    code"), and the scan, a pure-Python pass over every opcode (~0.1 s per 1,000 DCP tensors),
    runs only when loading fails, to name the opcode. Raises ValueError on a malformed pickle."""

    def __init__(self, f: BinaryIO, allowed: dict[tuple[str, str], Any], file: str):
        data = f.read()
        self._data: bytes | None = data
        if _extensions_known():
            ext = extension_globals(data)  # ValueError on a malformed pickle
            if ext:  # served from copyreg's cache without find_class once any unpickler met the code
                raise UnsafePickleError(str(file), ext)
            self._data = None  # scanned
        super().__init__(io.BytesIO(data))
        self._allowed, self._file = allowed, str(file)

    def load(self) -> Any:
        try:
            return super().load()
        except UnsafePickleError:
            raise
        except Exception:
            if self._data is not None:  # not scanned: an EXT opcode is named as before
                try:
                    ext = extension_globals(self._data)
                except ValueError:
                    ext = []
                if ext:
                    raise UnsafePickleError(self._file, ext) from None
            raise

    def find_class(self, module: str, name: str) -> Any:
        obj = self._allowed.get((module, name))
        if obj is None or "." in name:
            raise UnsafePickleError(self._file, [f"{module}.{name}"])
        return obj

    def persistent_load(self, pid: Any) -> Any:
        raise UnsafePickleError(self._file, [], why=f"persistent id {pid!r} is not allowed here")


def _extensions_known() -> bool:
    """Whether copyreg has any extension code registered or cached (then an EXT opcode could
    load something)."""
    import copyreg

    return bool(copyreg._extension_registry or copyreg._inverted_registry or copyreg._extension_cache)


def load_dcp_metadata(f: BinaryIO, file: str) -> Any:
    """Unpickle a DCP ``.metadata`` stream with :class:`ExactUnpickler`.

    Raises:
        UnsafePickleError: a global outside :func:`dcp_metadata_globals` (names it and ``file``).
        CorruptCheckpointError: any other unpickling failure (a damaged file).
    """
    try:
        return ExactUnpickler(f, dcp_metadata_globals(), file).load()
    except UnsafePickleError:
        raise
    except Exception as e:  # noqa: BLE001 - any unpickling failure: a damaged file
        raise CorruptCheckpointError(file, f"unreadable DCP metadata: {type(e).__name__}: {e}") from None


def torch_load(
    f: str | BinaryIO | io.BytesIO, file: str, trusted: Iterable[Any] = (), mmap: bool = False,
    map_location: str | None = None,
) -> Any:
    """``torch.load(f, weights_only=True)`` with ``trusted`` (objects) allowed through
    ``torch.serialization.safe_globals``. ``map_location="meta"``: structure only, no tensor bytes
    read (each storage carries ``_checkpoint_offset``, its record's offset in the file).

    Raises:
        NotImplementedError: with ``map_location="meta"``, a tensor kind torch cannot build on the
            meta device (quantized, nested): load it another way.
        UnsafePickleError: torch's ``weights_only`` unpickler refused (its message names the global).
        CorruptCheckpointError: a damaged file (torch's zip reader, a malformed pickle).
    """
    try:
        with torch.serialization.safe_globals(list(trusted)), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return torch.load(f, mmap=mmap, weights_only=True, map_location=map_location)
    except NotImplementedError:
        if map_location == "meta":
            raise
        raise CorruptCheckpointError(file, "damaged torch.save file: NotImplementedError") from None
    except pickle.UnpicklingError as e:
        raise UnsafePickleError(file, _refused_globals(f, trusted), why=str(e).splitlines()[0]) from None
    except RuntimeError as e:  # torch's zip reader on a damaged archive
        raise CorruptCheckpointError(file, f"damaged torch.save file: {e}") from None
    except Exception as e:  # noqa: BLE001 - a malformed pickle surfaces as any error type
        raise CorruptCheckpointError(
            file, f"damaged torch.save file: {type(e).__name__}: {' '.join(str(e).split())}"
        ) from None





def _refused_globals(f: Any, trusted: Iterable[Any]) -> list[str]:
    """Best effort, for the message: globals of ``f`` outside torch's ``weights_only`` table and
    ``trusted`` (the pickle inside a zip archive, or a stream / legacy file)."""
    import zipfile

    from torch import _weights_only_unpickler as wou

    ok = set(wou._get_allowed_globals()) | {f"{t.__module__}.{t.__qualname__}" for t in trusted}
    try:
        if isinstance(f, (str, bytes)) or hasattr(f, "__fspath__"):
            if zipfile.is_zipfile(f):
                with zipfile.ZipFile(f) as z:
                    name = next(n for n in z.namelist() if n.endswith("data.pkl"))
                    found = scan_globals(z.read(name))
            else:
                with open(f, "rb") as fh:
                    found = scan_globals(fh)
        else:
            f.seek(0)
            found = scan_globals(f)
    except Exception:  # noqa: BLE001 - only the message is at stake
        return []
    return sorted(f"{m}.{n}" for m, n in found if "." in n or f"{m}.{n}" not in ok)


_STRINGS = ("SHORT_BINUNICODE", "BINUNICODE", "UNICODE", "BINUNICODE8", "SHORT_BINSTRING", "BINSTRING", "STRING")


_EXT = ("EXT1", "EXT2", "EXT4")


def _extension(code: int) -> tuple[str, str]:
    """The global copyreg's extension registry gives ``code`` (what ``EXT1/2/4`` would load), or
    a stand-in naming the code when none is registered (nothing is looked up by name)."""
    import copyreg

    return copyreg._inverted_registry.get(code, ("copyreg-extension", f"code-{code}"))


def extension_globals(f: BinaryIO | bytes) -> list[str]:
    """``module.name`` of every ``EXT1`` / ``EXT2`` / ``EXT4`` opcode of one pickle (see
    :func:`_extension`), read with ``pickletools``. Raises ValueError on a malformed pickle."""
    import pickletools

    return sorted({".".join(_extension(arg)) for op, arg, _ in pickletools.genops(f) if op.name in _EXT})


def scan_globals(f: BinaryIO | bytes) -> set[tuple[str, str]]:
    """``(module, name)`` of every global one pickle reaches (``GLOBAL``, ``INST``,
    ``STACK_GLOBAL`` with its two strings, through the memo too; ``EXT1/2/4`` by the copyreg
    registry), read with ``pickletools``: nothing runs. Raises ValueError on a truncated or
    malformed pickle."""
    import pickletools

    found: set[tuple[str, str]] = set()
    stack: list[Any] = []  # last pushed values (strings, else None), enough for STACK_GLOBAL
    memo: dict[Any, Any] = {}
    for op, arg, _pos in pickletools.genops(f):
        name = op.name
        if name in _STRINGS:
            stack.append(arg if isinstance(arg, str) else arg.decode("latin-1"))
        elif name in ("GLOBAL", "INST"):
            mod, _, n = arg.partition(" ")
            found.add((mod, n))
            stack.append(None)
        elif name in _EXT:
            found.add(_extension(arg))
            stack.append(None)
        elif name == "STACK_GLOBAL":
            mod, n = (stack[-2], stack[-1]) if len(stack) >= 2 else (None, None)
            found.add((str(mod), str(n)))
            stack.append(None)
        elif name == "MEMOIZE":
            memo[len(memo)] = stack[-1] if stack else None
        elif name in ("PUT", "BINPUT", "LONG_BINPUT"):
            memo[arg] = stack[-1] if stack else None
        elif name in ("GET", "BINGET", "LONG_BINGET"):
            stack.append(memo.get(arg))
        else:
            stack.append(None)
    return found
__all__ = [
    "ExactUnpickler", "dcp_metadata_globals", "extension_globals", "load_dcp_metadata", "scan_globals", "torch_load",
]  # fmt: skip
