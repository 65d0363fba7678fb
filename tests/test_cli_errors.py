"""Every error is ours: malformed pickles, tensors without flat bytes,
dtypes safetensors cannot hold, DCP's BaseException-derived errors. The public API raises our
exception naming file and key; the CLI exits 2 with one line on stderr and, with ``--json``
(before or after the subcommand), one JSON object on stdout with ``error``, ``file``, ``key``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings

import pytest
import torch
from safetensors.torch import save_file

import checkpoint
from checkpoint import CorruptCheckpointError, UnsupportedTensorError
from checkpoint.cli.main import EXIT_BAD_INPUT, cli_spelling
from checkpoint.sources import open_source
from tests.helpers import run_cli


def one_error(rc: int, out: str, err: str) -> dict:
    """Exit 2, exactly one stderr line, no traceback, exactly one JSON object on stdout."""
    assert rc == EXIT_BAD_INPUT, (rc, out, err)
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    data = json.loads(out)  # one object: json.loads refuses trailing data
    assert data["ok"] is False and data["message"] in err
    return data


def _nested():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch.nested.nested_tensor([torch.ones(2), torch.ones(3)])


def _qint8():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch.quantize_per_tensor(torch.ones(3), 0.1, 0, torch.qint8)


# name -> (object saved with torch.save, error type, key named in the error)
MALFORMED = {
    "opt_groups_str": (
        {"state": {0: {"exp_avg": torch.ones(1)}}, "param_groups": "oops"},
        "CorruptCheckpointError",
        "param_groups",
    ),
    "opt_state_list": ({"state": [], "param_groups": [{"params": [0]}]}, "CorruptCheckpointError", "state"),
    "opt_params_none": (
        {"state": {}, "param_groups": [{"params": None}]},
        "CorruptCheckpointError",
        "param_groups.0.params",
    ),
    "opt_names_short": (
        {"state": {0: {"m": torch.ones(1)}}, "param_groups": [{"params": [0, 1], "param_names": ["a"]}]},
        "CorruptCheckpointError",
        "param_groups.0",
    ),
    "sparse": ({"w": torch.ones(3).to_sparse()}, "UnsupportedTensorError", "w"),
    "nested": ({"v": torch.ones(1), "w": _nested()}, "UnsupportedTensorError", "w"),
    "quantized": ({"q": _qint8()}, "UnsupportedTensorError", "q"),
}


@pytest.mark.parametrize("name", sorted(MALFORMED))
@pytest.mark.parametrize("cmd", ["inspect", "migrate", "diff"])
def test_malformed_pickle_is_one_line_and_one_json_object(tmp_path, capsys, name, cmd):
    obj, error, key = MALFORMED[name]
    src = tmp_path / f"{name}.pt"
    torch.save(obj, src)
    argv = {"inspect": [str(src)], "migrate": [str(src), str(tmp_path / "out")], "diff": [str(src), str(src)]}
    data = one_error(*run_cli(cmd, *argv[cmd], "--json", capsys=capsys))
    assert (data["error"], data["file"], data["key"]) == (error, str(src), key)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("dtype", [torch.complex128, torch.complex32])
def test_dtype_safetensors_cannot_hold_is_refused_before_writing(tmp_path, capsys, dtype):
    src = tmp_path / "c.pt"
    torch.save({"ok": torch.ones(2), "w": torch.zeros(3, dtype=dtype)}, src)
    # readable: inspect and diff work on it
    assert run_cli("inspect", str(src), capsys=capsys)[0] == 0
    assert run_cli("diff", str(src), str(src), capsys=capsys)[0] == 0
    for dry in ([], ["--dry-run"]):
        data = one_error(*run_cli("migrate", str(src), str(tmp_path / "out"), *dry, "--json", capsys=capsys))
        assert (data["error"], data["file"], data["key"]) == ("UnsupportedTensorError", str(src), "w")
        assert "cannot be stored in safetensors" in data["message"]
    assert not (tmp_path / "out").exists()
    # the public API raises the same error (a TypeError too), before anything is written
    with pytest.raises(UnsupportedTensorError) as ei:
        checkpoint.migrate(src, tmp_path / "out", dry_run=True)
    assert (ei.value.file, ei.value.key) == (str(src), "w") and isinstance(ei.value, TypeError)
    with pytest.raises(UnsupportedTensorError) as ei:
        checkpoint.save({"ok": torch.ones(2), "w": torch.zeros(3, dtype=dtype)}, tmp_path / "ck")
    assert ei.value.key == "w" and ei.value.file == str(tmp_path / "ck")
    assert not (tmp_path / "ck").exists() and not (tmp_path / "out").exists()


def test_api_names_file_and_key_for_malformed_optimizer_pickle(tmp_path):
    src = tmp_path / "o.pt"
    torch.save(MALFORMED["opt_groups_str"][0], src)
    with pytest.raises(CorruptCheckpointError) as ei:
        open_source(src)
    assert (ei.value.file, ei.value.key) == (str(src), "param_groups")
    with pytest.raises(CorruptCheckpointError):
        checkpoint.migrate(src, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_dcp_checkpoint_exception_is_ours(tmp_path, capsys):
    """DCP raises ``CheckpointException`` (a BaseException, not an Exception) with a whole
    traceback in its text: it becomes our CorruptCheckpointError naming DCP, file, tensor and
    rank, in one line."""
    import torch.distributed.checkpoint as dcp

    d = tmp_path / "dcp"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"w": torch.arange(1000.0)}, checkpoint_id=str(d), no_dist=True)
    rep = checkpoint.verify(d)  # intact: every tensor read, no checksums to compare
    assert rep.ok and rep.format == "dcp" and rep.tensors == 1 and rep.checksummed is False
    data_file = next(d.glob("*.distcp"))
    data_file.write_bytes(data_file.read_bytes()[:100])  # truncated
    with pytest.raises(CorruptCheckpointError) as ei:
        checkpoint.migrate(d, tmp_path / "out")
    msg = str(ei.value)
    assert "DCP" in msg and data_file.name in msg and "'w'" in msg and "rank 0" in msg and "\n" not in msg
    data = one_error(*run_cli("migrate", str(d), str(tmp_path / "out"), "--json", capsys=capsys))
    assert data["error"] == "CorruptCheckpointError" and data_file.name in data["message"]
    assert not (tmp_path / "out").exists()
    # verify: a damaged DCP file is a finding (exit 1) naming the file
    rc, out, _ = run_cli("verify", str(d), "--json", capsys=capsys)
    rep = json.loads(out)
    assert (
        rc == 1
        and rep["ok"] is False
        and data_file.name in rep["problems"][0]
        and str(d) in rep["problems"][0]
    )


def test_subprocess_json_before_the_subcommand(tmp_path):
    src = tmp_path / "s.pt"
    torch.save(MALFORMED["sparse"][0], src)
    r = subprocess.run(
        [sys.executable, "-m", "checkpoint", "--json", "inspect", str(src)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    data = one_error(r.returncode, r.stdout, r.stderr)
    assert (data["error"], data["file"], data["key"]) == ("UnsupportedTensorError", str(src), "w")
    r = subprocess.run(
        [sys.executable, "-m", "checkpoint", "--version"], capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 0 and r.stdout.startswith("fqnckpt ") and "torch" in r.stdout


def test_usage_errors_are_bad_input_naming_the_flag(tmp_path, capsys):
    data = one_error(*run_cli("--json", "migrate", str(tmp_path / "x.pt"), capsys=capsys))
    assert data["error"] == "UsageError" and "dst" in data["message"]
    data = one_error(*run_cli("demo", "--batch", "many", "--json", capsys=capsys))
    assert data["flag"] == "--batch"
    data = one_error(*run_cli("inspect", str(tmp_path), "--nope", "--json", capsys=capsys))
    assert data["flag"] == "--nope"


def test_errors_name_flags_not_python_arguments(tmp_path, capsys):
    from safetensors.torch import save_file

    src = tmp_path / "w.safetensors"
    save_file({"L__self___fc_weight": torch.ones(2, 2)}, str(src))
    dst = str(tmp_path / "out")
    rc, out, err = run_cli("migrate", str(src), dst, capsys=capsys)
    assert rc == 1 and "--model MODULE:CALLABLE or --fqn-map FILE" in out
    assert "model=" not in out + err and "fqn_map=" not in out + err
    cases = [
        (["--max-shard-size", "lots"], "--max-shard-size"),
        (["--trust", "nosuch.Thing"], "--trust"),
        (["--rule", r"x=\9"], "--rule"),
        (["--fqn-map", str(tmp_path)], "--fqn-map"),
        (["--model", "nosuchmodule:build"], "--model"),
    ]
    for extra, flag in cases:
        data = one_error(*run_cli("migrate", str(src), dst, *extra, "--json", capsys=capsys))
        assert data["flag"] == flag and flag in data["message"], data
        assert "=" not in data["message"].split(":")[0]
    assert not os.path.exists(dst)
    assert cli_spelling("pass overwrite=True to replace it") == "pass --overwrite to replace it"
    assert cli_spelling("pick one with key=") == "pick one with --key"


def _damaged(data: bytes, kind: str, frac: float) -> bytes:
    pos = int(len(data) * frac)
    if kind == "truncate":
        return data[:pos]
    return data[:pos] + bytes(16) + data[pos + 16 :]


@pytest.mark.parametrize("fmt", ["zip", "legacy", "safetensors"])
def test_damaged_files_are_named_never_a_traceback(tmp_path, capsys, fmt):
    """Truncated or zeroed bytes anywhere in a pickle / safetensors file: every command answers
    0, 1 (verify found damage) or 2 with one JSON object, and never a foreign error type."""
    sd = {"a.w": torch.arange(64.0), "b": torch.ones(3, dtype=torch.int64)}
    src = tmp_path / ("s.safetensors" if fmt == "safetensors" else "p.pt")
    if fmt == "safetensors":
        save_file(sd, str(src))
    else:
        torch.save(sd, src, _use_new_zipfile_serialization=fmt == "zip")
    data = src.read_bytes()
    seen = set()
    for kind in ("truncate", "zero"):
        for frac in (0.0, 0.02, 0.1, 0.3, 0.6, 0.9, 0.99):
            src.write_bytes(_damaged(data, kind, frac))
            for argv in (
                ["inspect", str(src)],
                ["migrate", str(src), str(tmp_path / "o"), "--dry-run"],
                ["verify", str(src)],
            ):
                rc, out, err = run_cli(*argv, "--json", capsys=capsys)
                assert rc in (0, 1, 2) and "Traceback" not in err, (kind, frac, argv, err)
                result = json.loads(out)
                if rc == 2:
                    assert len(err.strip().splitlines()) == 1 and result["file"] == str(src), result
                    assert result["error"] in {
                        "CorruptCheckpointError", "UnsupportedFormatError", "UnsafePickleError", "CheckpointNotFoundError"
                    }, result  # fmt: skip
                    seen.add(result["error"])
                if rc == 1:
                    assert argv[0] == "verify" and str(src) in result["problems"][0]
    assert "CorruptCheckpointError" in seen


def test_recover_of_a_path_that_holds_nothing_is_bad_input(tmp_path):
    """``fqnckpt recover`` of a mistyped path (nothing there, nothing a save left beside it) or of a
    file is exit 2 naming the path, as inspect and verify are; an empty directory has nothing to
    recover (exit 0); nothing is created either way."""
    (tmp_path / "index.json").write_text("{}")
    (tmp_path / "empty").mkdir()
    before = sorted(os.listdir(tmp_path))
    for name in ("nope", "index.json"):
        rc, out, err = run_cli("recover", tmp_path / name)
        assert rc == EXIT_BAD_INPUT and f"no checkpoint at {tmp_path / name}" in err, (name, err)
    rc, out, err = run_cli("recover", tmp_path / "empty")
    assert rc == 0 and "nothing of an interrupted save to recover" in out
    assert sorted(os.listdir(tmp_path)) == before and os.listdir(tmp_path / "empty") == []


def test_verify_of_a_checkpoint_refused_while_opening_says_so(tmp_path):
    """A shard cut short is refused when verify opens it: the summary says nothing was checked
    (no tensor or file counts, no digests named), the problem line names the file; exit 1."""
    root = tmp_path / "ck"
    checkpoint.save({"a": torch.ones(64, 64), "b": torch.ones(32)}, root)
    (shard,) = [p for p in root.iterdir() if p.suffix == ".safetensors"]
    shard.write_bytes(shard.read_bytes()[:-10])
    rc, out, err = run_cli("verify", root)
    head, problem = out.splitlines()[:2]
    assert rc == 1 and head == f"{root}: MISMATCH (safetensors-index, refused while opening it, before any tensor was checked)"
    assert problem.startswith("  problem: CorruptCheckpointError: ") and str(shard) in problem
