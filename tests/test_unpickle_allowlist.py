"""Every entry point that unpickles (DCP ``.metadata`` through ``load`` and
``fqnckpt inspect``; ``torch.save`` pickles, zip and legacy, through ``load``, ``migrate`` and
``inspect``; an optimizer state_dict inside a pickle) refuses a crafted payload for every opcode
that reaches a global: GLOBAL, STACK_GLOBAL, INST, OBJ, REDUCE / BUILD on allowed classes, and
EXT1 / EXT2 / EXT4 (copyreg extension codes, registered and already cached). Each is an
UnsafePickleError naming the global and the file; the payload's side effect (``touch MARKER``)
never happens; model and optimizer are unchanged."""

from __future__ import annotations

import copyreg
import io
import pickle
import struct
import warnings
import zipfile

import pytest
import torch
import torch.nn as nn
from snapshot import Snapshot

import checkpoint
from checkpoint.cli.main import main as cli
from checkpoint.errors import UnsafePickleError

# Extension codes registered for the test, each for a global that runs a shell command.
_EXTS = {"EXT1": (0xF1, "os", "system"), "EXT2": (0x1F01, "posix", "system"), "EXT4": (0x01F0_0001, "subprocess", "getoutput")}
_CODES = {k: v[0] for k, v in _EXTS.items()}
_GLOBAL = {k: f"{m}.{n}" for k, (_, m, n) in _EXTS.items()}
_SLOT = "FQNCKPT_PAYLOAD_SLOT_0123456789"


def _str(s: str) -> bytes:
    b = s.encode()
    return b"X" + struct.pack("<I", len(b)) + b


_TORCH_OK = (b"collections\nOrderedDict\n", b"collections\nOrderedDict\n")  # torch's weights_only table
_DCP_OK = (b"torch.serialization\n_get_layout\n", b"torch.distributed.checkpoint.metadata\nMetadata\n")  # DCP's


def _bodies(marker, allowed: tuple[bytes, bytes] = _TORCH_OK) -> dict[str, bytes]:
    """Pickle fragments leaving one value on the stack; each would run ``touch marker``.
    ``allowed``: (a callable, a class) the unpickler under test allows, for REDUCE / BUILD."""
    args = b"(" + _str(f"touch {marker}") + b"t"
    return {
        "GLOBAL": b"cos\nsystem\n" + args + b"R",
        "STACK_GLOBAL": _str("os") + _str("system") + b"\x93" + args + b"R",
        "INST": b"(" + _str(f"touch {marker}") + b"ios\nsystem\n",
        "OBJ": b"(cos\nsystem\n" + _str(f"touch {marker}") + b"o",
        # allowed classes fed a hostile global
        "REDUCE": b"c" + allowed[0] + b"(cos\nsystem\ntR",
        "BUILD": b"c" + allowed[1] + b")\x81}" + _str("__class__") + b"cos\nsystem\nsb",
        "EXT1": b"\x82" + bytes([_CODES["EXT1"]]) + args + b"R",
        "EXT2": b"\x83" + struct.pack("<H", _CODES["EXT2"]) + args + b"R",
        "EXT4": b"\x84" + struct.pack("<i", _CODES["EXT4"]) + args + b"R",
    }


OPCODES = list(_bodies("x"))


@pytest.fixture(autouse=True)
def extensions():
    """``os.system`` registered under each code and already in copyreg's cache (a plain
    unpickler met it): CPython's C unpickler then serves it without ``find_class``."""
    import importlib

    for code, mod, name in _EXTS.values():
        copyreg.add_extension(mod, name, code)
        op = b"\x82" + bytes([code]) if code < 256 else b"\x83" + struct.pack("<H", code) if code < 65536 else (
            b"\x84" + struct.pack("<i", code))  # fmt: skip
        # resolves (into the cache), runs nothing
        assert pickle.loads(b"\x80\x02" + op + b".") is getattr(importlib.import_module(mod), name)
    yield
    for code, mod, name in _EXTS.values():
        copyreg.remove_extension(mod, name, code)


def _splice_zip(path, body: bytes) -> None:
    """Replace the pickled ``_SLOT`` string inside a ``torch.save`` zip's data.pkl with ``body``."""
    with zipfile.ZipFile(path) as z:
        members = [(i.filename, z.read(i.filename)) for i in z.infolist()]
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED) as z:
        for name, data in members:
            if name.endswith("data.pkl"):
                assert data.count(_str(_SLOT)) == 1
                data = data.replace(_str(_SLOT), body)
            z.writestr(name, data)
    path.write_bytes(buf.getvalue())


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(2, 2)


def _check(e: pytest.ExceptionInfo, file: str, opcode: str) -> None:
    assert isinstance(e.value, UnsafePickleError), e.value
    assert file in str(e.value)
    assert _GLOBAL.get(opcode, "os.system") in e.value.globals, e.value.globals


@pytest.mark.parametrize("opcode", OPCODES)
def test_dcp_metadata_payload_refused_by_load_and_inspect(tmp_path, opcode, capsys):
    import torch.distributed.checkpoint as dcp

    d = tmp_path / "dcp"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(Net().state_dict(), checkpoint_id=str(d), no_dist=True)
    marker = tmp_path / "MARKER"
    (d / ".metadata").write_bytes(b"\x80\x02" + _bodies(marker, _DCP_OK)[opcode] + b".")
    target = Net()
    snap = Snapshot(target)
    with pytest.raises(Exception) as e:
        checkpoint.load(target, d)
    _check(e, ".metadata", opcode)
    assert cli(["inspect", str(d)]) == 2 and "refused to unpickle" in capsys.readouterr().err
    assert not marker.exists()
    snap.assert_unchanged()


def _model_pickle(path, zip_: bool, body: bytes) -> None:
    if zip_:
        torch.save({"lin.weight": torch.zeros(2, 2), "lin.bias": _SLOT}, path)
        _splice_zip(path, body)
    else:  # a legacy pickle is the payload itself
        path.write_bytes(b"\x80\x02" + body + b".")


def _refused_by_load_and_migrate(tmp_path, f, opcode: str, key: str | None = None) -> Snapshot:
    """``load`` (with an optimizer) and ``migrate`` of ``f`` both refuse, naming the global and
    the file; nothing is written. Returns the snapshot of the untouched target."""
    target = Net()
    opt = torch.optim.SGD(target.parameters(), lr=0.1)
    snap = Snapshot(target, opt)
    with pytest.raises(Exception) as e:
        checkpoint.load(target, f, optimizer=opt)
    _check(e, f.name, opcode)
    with pytest.raises(Exception) as e:
        checkpoint.migrate(f, tmp_path / "out", key=key)
    _check(e, f.name, opcode)
    assert not (tmp_path / "out").exists()
    return snap


@pytest.mark.parametrize("opcode", OPCODES)
@pytest.mark.parametrize("zip_", [True, False], ids=["zip", "legacy"])
def test_torch_save_payload_refused_by_load_migrate_and_inspect(tmp_path, opcode, zip_, capsys):
    marker = tmp_path / "MARKER"
    f = tmp_path / "model.pt"
    _model_pickle(f, zip_, _bodies(marker)[opcode])
    snap = _refused_by_load_and_migrate(tmp_path, f, opcode)
    assert cli(["inspect", str(f)]) == 2 and "refused to unpickle" in capsys.readouterr().err
    assert not marker.exists()
    snap.assert_unchanged()


@pytest.mark.parametrize("opcode", OPCODES)
def test_optimizer_pickle_payload_refused(tmp_path, opcode):
    """The payload sits in the optimizer's param groups of ``{"model": ..., "optimizer": ...}``."""
    marker = tmp_path / "MARKER"
    f = tmp_path / "ck.pt"
    m = Net()
    torch.save({"model": m.state_dict(),
                "optimizer": {"state": {}, "param_groups": [{"lr": _SLOT, "params": [0, 1]}]}}, f)  # fmt: skip
    _splice_zip(f, _bodies(marker)[opcode])
    snap = _refused_by_load_and_migrate(tmp_path, f, opcode, key="optimizer")
    assert not marker.exists()
    snap.assert_unchanged()


def test_dcp_metadata_without_copyreg_extensions_skips_the_scan_and_still_refuses_ext(tmp_path, monkeypatch):
    """No extension registered or cached (the usual process): a DCP load runs no opcode scan
    (a pure-Python pass over every opcode), and an EXT opcode still fails as an
    UnsafePickleError naming the code and the file, its payload never run."""
    import torch.distributed.checkpoint as dcp

    from checkpoint.sources import unpickle

    for code, mod, name in _EXTS.values():  # back to a process with none (restored for the fixture)
        copyreg.remove_extension(mod, name, code)
    try:
        assert not unpickle._extensions_known()
        scans, real = [], unpickle.extension_globals
        monkeypatch.setattr(unpickle, "extension_globals", lambda data: scans.append(1) or real(data))
        d = tmp_path / "dcp"
        src = Net()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.save(src.state_dict(), checkpoint_id=str(d), no_dist=True)
        target = Net()
        assert checkpoint.load(target, d).ok and scans == []
        assert torch.equal(target.lin.weight, src.lin.weight)
        marker = tmp_path / "MARKER"
        for opcode in ("EXT1", "EXT2", "EXT4"):
            (d / ".metadata").write_bytes(b"\x80\x02" + _bodies(marker, _DCP_OK)[opcode] + b".")
            snap = Snapshot(target)
            with pytest.raises(UnsafePickleError, match=r"\.metadata") as e:
                checkpoint.load(target, d)
            assert e.value.globals == [f"copyreg-extension.code-{_CODES[opcode]}"], e.value.globals
            snap.assert_unchanged()
        assert len(scans) == 3 and not marker.exists()
    finally:
        for code, mod, name in _EXTS.values():
            copyreg.add_extension(mod, name, code)
