"""Start-up cost without a clock: ``import checkpoint`` and ``fqnckpt --version``
/ ``--help`` import no torch, and ``fqnckpt inspect`` of a safetensors checkpoint (one file, one
of ours with an index) imports no torch at all, and prints what the torch path prints. The times
are in tests/bench/cli_startup.py."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch
from safetensors.torch import save_file

import checkpoint

HEAVY = ("torch", "torch.distributed", "torch.distributed.tensor", "transformers", "pydantic", "numpy", "safetensors")

PROBE = textwrap.dedent(
    """
    import contextlib, io, json, sys
    heavy = json.loads(sys.argv[2])
    seen = {}
    import checkpoint
    seen["import checkpoint"] = [m for m in heavy if m in sys.modules]
    from checkpoint.cli import main
    for flag in ("--version", "--help"):
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            try:
                main([flag])
            except SystemExit as e:
                assert e.code == 0, e.code
        seen[flag] = [m for m in heavy if m in sys.modules]
        seen[flag + " output"] = out.getvalue()
    for i, path in enumerate(sys.argv[3:]):
        with contextlib.redirect_stdout(io.StringIO()):
            seen[f"inspect {i} rc"] = main(["inspect", "--keys", path])
        seen[f"inspect {i}"] = [m for m in heavy if m in sys.modules]
    print(json.dumps(seen))
    """
)


def test_version_help_and_safetensors_inspect_import_no_torch(tmp_path):
    path = tmp_path / "m.safetensors"
    sd = {"fc.weight": torch.ones(2, 3), "fc.bias": torch.zeros(3, dtype=torch.bfloat16)}
    save_file(sd, str(path))
    checkpoint.save(sd, tmp_path / "ckpt", max_shard_size=8)  # two shard files and an index
    paths = [path, tmp_path / "ckpt", tmp_path / "ckpt" / "model.safetensors.index.json"]
    r = subprocess.run(
        [sys.executable, "-c", PROBE, "", json.dumps(HEAVY), *map(str, paths)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    seen = json.loads(r.stdout)
    assert seen["import checkpoint"] == []
    assert seen["--version"] == [] and seen["--help"] == []
    assert seen["--version output"].startswith("fqnckpt ") and "torch" in seen["--version output"]
    for cmd in ("inspect", "migrate", "verify", "diff", "recipes", "demo"):
        assert f"    {cmd} " in seen["--help output"], cmd
    for i in range(len(paths)):  # header and index read by safetensors and pydantic, no torch
        assert seen[f"inspect {i} rc"] == 0
        assert seen[f"inspect {i}"] == ["pydantic", "numpy", "safetensors"], paths[i]


def test_no_public_name_is_also_a_submodule():
    """Importing a submodule binds it on the package: a submodule named like a public function
    (``checkpoint/verify.py`` beside ``checkpoint.verify``) would replace the function for every
    caller once anything imported the module."""
    import pkgutil

    import checkpoint

    subpackages = {m.name for m in pkgutil.iter_modules(checkpoint.__path__)}
    assert subpackages & set(checkpoint.__all__) == set()


def test_lazy_package_names_resolve_to_their_modules():
    import checkpoint.cli.main  # noqa: F401 - the CLI imports the implementing modules itself
    import checkpoint.loading
    import checkpoint.migrating
    import checkpoint.saving

    # Importing the implementing modules never rebinds the public functions.
    assert (checkpoint.load, checkpoint.save, checkpoint.migrate) == (
        checkpoint.loading.load, checkpoint.saving.save, checkpoint.migrating.migrate
    )  # fmt: skip
    assert callable(checkpoint.migrate) and checkpoint.migrate.__module__ == "checkpoint.migrating"
    for name in checkpoint.__all__:
        assert getattr(checkpoint, name).__name__ == name
    assert set(checkpoint.__all__) <= set(dir(checkpoint))
    assert checkpoint.storage.opening.open_checkpoint is checkpoint.open_checkpoint  # submodule fallback (URLs and paths)
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        checkpoint.nope  # noqa: B018


def _inspect_text(capsys, *argv) -> tuple[int, str, str]:
    from checkpoint.cli import main

    rc = main(list(map(str, argv)))
    out = capsys.readouterr()
    return rc, out.out, out.err


def _both_paths(monkeypatch, capsys, *argv):
    """``fqnckpt ARGV`` through the torch-free headers path, then through ``open_source``."""
    from checkpoint.cli import parts
    from checkpoint.sources import open_source

    fast = _inspect_text(capsys, *argv)
    with monkeypatch.context() as m:
        m.setattr(parts, "open_inspected", lambda p, key=None, trusted=None: open_source(p, key=key))
        slow = _inspect_text(capsys, *argv)
    return fast, slow


def test_inspect_without_torch_prints_what_open_source_prints(tmp_path, monkeypatch, capsys):
    from checkpoint.sources.st_headers import HEADER_DTYPES
    from checkpoint.storage.layout import ST_TO_DTYPE

    # Every dtype safetensors stores, each its own tensor, over several shard files, plus an optimizer part.
    assert set(HEADER_DTYPES) == set(ST_TO_DTYPE)
    # (torch has no conversion to float4_e2m1fn_x2: F4 is made directly)
    sd = {f"layers.{i}.{st.lower()}": torch.zeros(2, 3).to(ST_TO_DTYPE[st]) if st != "F4"
          else torch.zeros(2, 3, dtype=ST_TO_DTYPE[st]) for i, st in enumerate(sorted(ST_TO_DTYPE))}  # fmt: skip
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    checkpoint.save(sd, tmp_path / "all", max_shard_size=64)
    checkpoint.save(model, tmp_path / "opt", optimizer=opt)
    save_file(sd, str(tmp_path / "one.safetensors"))
    for target in ("all", "opt", "one.safetensors", "all/model.safetensors.index.json"):
        for argv in (("inspect",), ("inspect", "--keys"), ("--json", "inspect", "--keys")):
            fast, slow = _both_paths(monkeypatch, capsys, *argv, tmp_path / target)
            assert fast == slow and fast[0] == 0, (target, argv)
    text = _inspect_text(capsys, "inspect", "--keys", tmp_path / "all")[1]
    for st, dtype in ST_TO_DTYPE.items():  # real dtypes, not stand-ins
        assert f"  (2, 3)  {dtype}" in text and HEADER_DTYPES[st].itemsize == dtype.itemsize, st
    assert "files:\n    model-00001-of-" in text and "model-00002-of-" in text


def test_inspect_without_torch_gives_the_same_errors(tmp_path, monkeypatch, capsys):
    import struct

    def st_file(name: str, header: dict, data: bytes) -> str:
        raw = json.dumps(header).encode()
        (tmp_path / name).write_bytes(struct.pack("<Q", len(raw)) + raw + data)
        return str(tmp_path / name)

    bad = [
        st_file("span.safetensors", {"x": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}}, b"\0" * 8),
        st_file("f4.safetensors", {"x": {"dtype": "F4", "shape": [3], "data_offsets": [0, 2]}}, b"\0\0"),
        st_file("cut.safetensors", {"x": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 5),
    ]
    checkpoint.save({"a": torch.ones(4), "b": torch.ones(4)}, tmp_path / "ckpt", max_shard_size=16)
    shard = sorted((tmp_path / "ckpt").glob("model-*.safetensors"))[1]
    shard.write_bytes(shard.read_bytes()[:20])
    for path in (*bad, tmp_path / "ckpt"):
        fast, slow = _both_paths(monkeypatch, capsys, "inspect", path)
        assert fast == slow and fast[0] == 2, path
        assert fast[2].startswith(f"fqnckpt inspect: error: {shard if path == tmp_path / 'ckpt' else path}: ")
    assert "data_offsets span 4 bytes" in _inspect_text(capsys, "inspect", bad[0])[2]
    assert "tensor 'x': dtype F4 holds 2 elements per byte: shape [3] does not end in whole bytes" in _inspect_text(capsys, "inspect", bad[1])[2]
