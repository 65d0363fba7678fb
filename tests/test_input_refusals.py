"""Crafted inputs that a reader must refuse: each test pins one kind of bad input (it raises our
specific error naming the file / key, never loads wrong values, never hangs, and the CLI exits 2
with one line). Inputs are crafted in tmp_path per the safetensors / HF index specs.
"""

from __future__ import annotations

import json
import os
import struct

import pytest
import torch

import checkpoint
import fqn
from checkpoint import CorruptCheckpointError
from checkpoint.cli import main as cli_main
from checkpoint.cli.main import EXIT_BAD_INPUT
from tests.helpers import run_cli

INDEX = "model.safetensors.index.json"


def write_st(p, header_bytes: bytes, data: bytes = b"") -> None:
    """A safetensors file by hand: u64 LE header length, header bytes, data."""
    p.write_bytes(struct.pack("<Q", len(header_bytes)) + header_bytes + data)


# -- deeply nested JSON ------------------------------------------------------------------------------

DEEP = b"[" * 100_000 + b"]" * 100_000


@pytest.mark.parametrize("where", ["index", "header"])
def test_deeply_nested_json_is_corrupt_not_recursion_error(tmp_path, capsys, where):
    path = tmp_path / "ck"
    checkpoint.save({"w": torch.arange(3.0)}, path)
    if where == "index":
        bad = path / INDEX
        bad.write_bytes(b'{"weight_map": ' + DEEP + b"}")
    else:
        os.remove(path / INDEX)
        bad = path / "model.safetensors"
        write_st(bad, b'{"w": ' + DEEP + b"}")
        os.remove(path / "model-00001-of-00001.safetensors")
    target = {"w": torch.zeros(3)}
    with pytest.raises(CorruptCheckpointError) as ei:
        checkpoint.load(target, path)
    assert str(bad) in str(ei.value)
    assert torch.equal(target["w"], torch.zeros(3))
    rep = checkpoint.verify(path)
    assert not rep.ok and str(bad) in rep.problems[0]
    rc, _, _ = run_cli("verify", str(path), capsys=capsys)
    assert rc == 1


# -- alias groups of the index -----------------------------------------------------------------------


def _rewrite_index(path, fn) -> None:
    p = path / INDEX
    data = json.loads(p.read_text())
    fn(data["metadata"]["fqnckpt"])
    p.write_text(json.dumps(data))


def test_alias_group_never_overrides_a_stored_tensor(tmp_path):
    """An index claiming ``w`` is an alias of ``v`` while ``w`` is stored with its own values must
    not fill ``w`` from ``v`` (it did: a silent wrong load)."""
    path = tmp_path / "ck"
    checkpoint.save({"v": torch.full((3,), 1.0), "w": torch.full((3,), 2.0)}, path)
    _rewrite_index(path, lambda m: m.__setitem__("alias_groups", [["v", "w"]]))
    target = {"v": torch.zeros(3), "w": torch.zeros(3)}
    rep = checkpoint.load(target, path)
    assert torch.equal(target["v"], torch.full((3,), 1.0))
    assert torch.equal(target["w"], torch.full((3,), 2.0))
    assert rep.filled_from == {} and rep.loaded_keys == ["v", "w"]


@pytest.mark.parametrize("groups", [[[]], [["w"]]], ids=["empty", "single"])
def test_alias_group_shorter_than_two_is_corrupt(tmp_path, groups):
    path = tmp_path / "ck"
    checkpoint.save({"w": torch.arange(3.0)}, path)
    _rewrite_index(path, lambda m: m.__setitem__("alias_groups", groups))
    with pytest.raises(CorruptCheckpointError, match="alias_groups") as ei:
        checkpoint.load({"w": torch.zeros(3)}, path)
    assert str(path / INDEX) in str(ei.value)


# -- FIFOs and other non-regular files ---------------------------------------------------------------


def _cli_with_fifo_writers(capsys, argv, fifos):
    """Run the CLI while a shell waits to write each FIFO: opening a FIFO for reading blocks until
    a writer comes, so the writers keep a buggy reader from hanging the test. A writer still
    waiting afterwards proves nothing opened its FIFO. Returns (rc, stderr, FIFOs opened)."""
    import subprocess

    logs = [f"{f}.opened" for f in fifos]
    writers = [
        subprocess.Popen(["sh", "-c", 'while :; do : > "$0"; echo >> "$1"; done', str(f), log])
        for f, log in zip(fifos, logs)
    ]
    try:
        rc, _, err = run_cli(*argv, capsys=capsys)
    finally:
        for w in writers:
            w.kill()
            w.wait()
    opened = [f for f, log in zip(fifos, logs) if os.path.exists(log)]
    return rc, err, opened


@pytest.mark.parametrize("cmd", ["inspect", "migrate"])
def test_fifo_named_safetensors_never_blocks(tmp_path, capsys, cmd):
    d = tmp_path / "src"
    d.mkdir()
    fifo, fifo_index = d / "x.safetensors", d / "x.safetensors.index.json"
    os.mkfifo(fifo)
    os.mkfifo(fifo_index)
    argv = [cmd, str(d)] + ([str(tmp_path / "out")] if cmd == "migrate" else [])
    rc, err, opened = _cli_with_fifo_writers(capsys, argv, [fifo, fifo_index])
    assert opened == []
    assert rc == EXIT_BAD_INPUT and "no checkpoint" in err and str(d) in err
    assert len(err.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists()
    # A real checkpoint next to the FIFO still reads (the FIFO is not a shard).
    from safetensors.torch import save_file

    save_file({"w": torch.arange(3.0)}, str(d / "model.safetensors"))
    rc, err, opened = _cli_with_fifo_writers(capsys, ["inspect", str(d)], [fifo, fifo_index])
    assert rc == 0 and opened == [], err


@pytest.mark.parametrize("name", ["fifo", "fifo.safetensors"])
def test_fifo_as_source_path_is_bad_input(tmp_path, capsys, name):
    fifo = tmp_path / name
    os.mkfifo(fifo)
    rc, err, opened = _cli_with_fifo_writers(capsys, ["inspect", str(fifo)], [fifo])
    assert opened == [] and rc == EXIT_BAD_INPUT and str(fifo) in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1


# -- CLI: bad input is exit 2 with one line, never a traceback ---------------------------------------


@pytest.fixture
def pickle_src(tmp_path):
    p = tmp_path / "m.pt"
    torch.save({"l.weight": torch.ones(2, 3), "l.bias": torch.ones(2)}, p)
    return p


@pytest.mark.parametrize(
    "body,needle",
    [
        ('raise RuntimeError("boom at import")\n', "boom at import"),
        ("def (:\n", "SyntaxError"),
    ],
    ids=["raises_at_import", "syntax_error"],
)
def test_cli_model_module_failing_at_import(tmp_path, capsys, monkeypatch, pickle_src, body, needle):
    name = f"adv_mod_{tmp_path.name}"
    (tmp_path / f"{name}.py").write_text(body)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("sys.path", list(os.sys.path))  # load_model puts the cwd on sys.path
    rc, _, err = run_cli("migrate", str(pickle_src), str(tmp_path / "out"), "--model", f"{name}:f", capsys=capsys)
    assert rc == EXIT_BAD_INPUT
    assert needle in err and f"{name}:f" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("kind", ["directory", "not_json", "wrong_schema"])
def test_cli_bad_fqn_map_file(tmp_path, capsys, pickle_src, kind):
    fm = tmp_path / "map.json"
    if kind == "directory":
        fm.mkdir()
    elif kind == "not_json":
        fm.write_text("hello")
    else:
        fm.write_text('{"version": 2, "records": []}')
    rc, _, err = run_cli("migrate", str(pickle_src), str(tmp_path / "out"), "--fqn-map", str(fm), capsys=capsys)
    assert rc == EXIT_BAD_INPUT and str(fm) in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "out").exists()


def test_cli_rule_with_bad_group_reference(tmp_path, capsys, pickle_src):
    rc, _, err = run_cli("migrate", str(pickle_src), str(tmp_path / "out"), "--rule", r"l=\9", capsys=capsys)
    assert rc == EXIT_BAD_INPUT and "invalid group reference" in err and r"'l'" in err
    assert len(err.strip().splitlines()) == 1 and not (tmp_path / "out").exists()


# -- checkpoints with zero tensors ---------------------------------------------------------------------


def test_empty_state_dict_round_trips(tmp_path):
    """Saving a state_dict with no tensors wrote a shard file the index did not name, so the
    checkpoint it committed could not be loaded or verified."""
    path = tmp_path / "ck"
    idx = checkpoint.save({}, path)
    assert idx.weight_map == {} and idx.files() == [] and idx.metadata.total_size == 0
    assert sorted(os.listdir(path)) == [INDEX]
    assert checkpoint.load({}, path).loaded_keys == []
    rep = checkpoint.verify(path)
    assert rep.ok and rep.tensors == 0, rep.problems


# -- pickle entries whose flattened names collide --------------------------------------------------------


@pytest.mark.parametrize(
    "obj,name",
    [
        ({"a": {"b": torch.ones(2)}, "a.b": torch.zeros(2)}, "a.b"),
        ({1: torch.ones(2), "1": torch.zeros(2)}, "1"),
    ],
    ids=["nested_vs_dotted", "int_vs_str_key"],
)
def test_pickle_entries_flattening_to_one_name_are_refused(tmp_path, obj, name):
    """Two entries that flatten to one tensor name are refused: one of them would be dropped silently."""
    from checkpoint.migrating import migrate

    src = tmp_path / "m.pt"
    torch.save(obj, src)
    with pytest.raises(CorruptCheckpointError) as ei:
        migrate(src, tmp_path / "out")
    assert repr(name) in str(ei.value) and str(src) in str(ei.value)
    assert not (tmp_path / "out").exists()


def test_complex64_checkpoint_inspect_and_migrate(tmp_path, capsys):
    """fqnckpt saves complex64 (C64) but its source reader did not know the dtype, so its own
    checkpoints could not be inspected, diffed or migrated."""
    from checkpoint.migrating import migrate

    c = torch.tensor([1 + 2j, -3.5 - 0.25j], dtype=torch.complex64)
    checkpoint.save({"c": c, "w": torch.arange(2.0)}, tmp_path / "ck")
    rc, _, err = run_cli("inspect", str(tmp_path / "ck"), capsys=capsys)
    assert rc == 0, err
    rep = migrate(tmp_path / "ck", tmp_path / "out")
    assert rep.mapping == {"c": "c", "w": "w"}
    target = {"c": torch.zeros(2, dtype=torch.complex64), "w": torch.zeros(2)}
    checkpoint.load(target, tmp_path / "out")
    assert torch.equal(target["c"], c) and torch.equal(target["w"], torch.arange(2.0))


def test_sparse_tensor_is_a_typeerror_naming_the_key(tmp_path):
    with pytest.raises(TypeError, match="'s'.*sparse"):
        checkpoint.save({"w": torch.ones(2), "s": torch.eye(3).to_sparse()}, tmp_path / "ck")
    assert not (tmp_path / "ck").exists()


def test_resolve_rejects_a_single_string_and_a_non_module():
    model = torch.nn.Linear(2, 2)
    with pytest.raises(TypeError, match="iterable of names"):
        fqn.resolve("weight", model)
    with pytest.raises(TypeError, match="nn.Module"):
        fqn.resolve(["weight"], None)


def test_header_naming_a_tensor_twice_is_refused(tmp_path):
    """safetensors keeps the last of two same-named header entries silently; we refuse the file."""
    entry = '"w":{"dtype":"F32","shape":[%d],"data_offsets":[0,%d]}'
    # The last entry covers all the data, so safetensors itself accepts the file.
    header = ("{" + entry % (1, 4) + "," + entry % (2, 8) + "}").encode()
    header += b" " * (-len(header) % 8)
    path = tmp_path / "dup.safetensors"
    path.write_bytes(struct.pack("<Q", len(header)) + header + struct.pack("<2f", 1.0, 2.0))
    with pytest.raises(CorruptCheckpointError, match=r"dup\.safetensors.*'w' twice"):
        checkpoint.load({"w": torch.zeros(1)}, path)
    assert cli_main(["inspect", str(path)]) == EXIT_BAD_INPUT
