"""The ``fqnckpt`` command line: run as a subprocess (console script and ``python -m checkpoint``)
and in-process through ``checkpoint.cli.main`` for the remaining exit codes."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch
from safetensors.torch import save_file

from checkpoint.cli.main import _COMMANDS, main

MODEL_SRC = textwrap.dedent(
    """
    import torch
    import torch.nn as nn

    def build():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    """
)


@pytest.fixture
def compiled_ckpt(tmp_path):
    (tmp_path / "tinymodel.py").write_text(MODEL_SRC)
    sys.path.insert(0, str(tmp_path))
    try:
        import tinymodel

        model = tinymodel.build()
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("tinymodel", None)
    sd = {"_orig_mod." + k: v for k, v in model.state_dict().items()}
    torch.save({"model": sd, "epoch": 4}, tmp_path / "compiled.pt")
    return tmp_path, model


def test_console_script_migrate_verify_diff(compiled_ckpt):
    d, model = compiled_ckpt
    exe = shutil.which("fqnckpt")
    cmd = [exe] if exe else [sys.executable, "-m", "checkpoint"]
    r = subprocess.run(
        [*cmd, "migrate", "compiled.pt", "out", "--model", "tinymodel:build", "--json"],
        cwd=d, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    assert report["ok"] and report["container"] == "model"
    assert {e["source"]: e["target"] for e in report["entries"]} == {
        "_orig_mod.0.weight": "0.weight", "_orig_mod.0.bias": "0.bias",
        "_orig_mod.2.weight": "2.weight", "_orig_mod.2.bias": "2.bias",
    }  # fmt: skip

    # Flip one data byte of the shard: verify finds it (exit 1); python -m checkpoint works too.
    shard = next((d / "out").glob("model-*.safetensors"))
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF
    shard.write_bytes(bytes(data))
    r = subprocess.run(
        [sys.executable, "-m", "checkpoint", "verify", "out", "--json"], cwd=d, capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip
    assert r.returncode == 1, r.stdout + r.stderr
    assert json.loads(r.stdout)["ok"] is False


def test_inspect_reports_format_schemes_and_files(compiled_ckpt, capsys):
    d, _ = compiled_ckpt
    assert main(["inspect", str(d / "compiled.pt"), "--keys", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["format"] == "torch-zip" and info["container"] == "model"
    assert info["tensors"] == 4 and info["total_bytes"] == (12 + 4 + 8 + 2) * 4
    assert info["dtypes"] == {"float32": 4} and info["wrapper_segments"] == {"_orig_mod": 4}
    assert info["per_file"] == {"compiled.pt": {"tensors": 4, "bytes": 104}}
    assert info["keys"]["_orig_mod.0.weight"] == {"shape": [4, 3], "dtype": "torch.float32"}
    assert main(["inspect", str(d / "compiled.pt")]) == 0
    text = capsys.readouterr().out
    assert "torch-zip" in text and "_orig_mod x4" in text


def test_migrate_dry_run_rules_and_unresolved_exit_codes(tmp_path, capsys):
    save_file({"L__self___fc_weight": torch.ones(2, 2), "enc.w": torch.zeros(2)}, tmp_path / "w.safetensors")
    args = ["migrate", str(tmp_path / "w.safetensors"), str(tmp_path / "out")]
    assert main([*args, "--rule", r"^enc=dec", "--dry-run"]) == 1  # flattened name, no model: refused
    out = capsys.readouterr()
    assert "unresolved: L__self___fc_weight" in out.out and "stopped" in out.err
    assert main([*args, "--rule", r"^enc=dec", "--allow-unresolved", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert {e["source"]: e["target"] for e in report["entries"]} == {"enc.w": "dec.w"}
    assert [u["source"] for u in report["unresolved"]] == ["L__self___fc_weight"]
    assert (tmp_path / "out" / "migration_report.json").is_file()


def test_diff_and_bad_input(tmp_path, capsys):
    a = {"x": torch.arange(4.0), "y": torch.ones(2)}
    save_file(a, tmp_path / "a.safetensors")
    save_file(dict(a), tmp_path / "same.safetensors")
    save_file({"x": torch.arange(4.0) + 1, "z": torch.ones(2)}, tmp_path / "b.safetensors")
    assert main(["diff", str(tmp_path / "a.safetensors"), str(tmp_path / "same.safetensors")]) == 0
    capsys.readouterr()
    assert main(["diff", str(tmp_path / "a.safetensors"), str(tmp_path / "b.safetensors"), "--json"]) == 1
    diff = json.loads(capsys.readouterr().out)
    assert diff["only_in_a"] == ["y"] and diff["only_in_b"] == ["z"] and diff["value_differs"] == ["x"]

    assert main(["inspect", str(tmp_path / "missing.pt")]) == 2
    assert "missing.pt" in capsys.readouterr().err
    (tmp_path / "lfs.safetensors").write_text("version https://git-lfs.github.com/spec/v1\n")
    assert main(["migrate", str(tmp_path / "lfs.safetensors"), str(tmp_path / "o")]) == 2
    assert "git lfs pull" in capsys.readouterr().err
    torch.save({"model": {"w": torch.ones(1)}, "ema": {"w": torch.ones(1)}}, tmp_path / "two.pt")
    assert main(["migrate", str(tmp_path / "two.pt"), str(tmp_path / "o")]) == 2
    assert "['model', 'ema']" in capsys.readouterr().err
    assert main(["migrate", str(tmp_path / "two.pt"), str(tmp_path / "o"), "--model", "nomodule:build"]) == 2


def test_command_registry_has_the_four_commands():
    assert {"inspect", "migrate", "verify", "diff"} <= set(_COMMANDS)  # "demo" is added elsewhere


def test_migrate_table_is_short_unless_keys_asked(tmp_path, capsys):
    sd = {f"_orig_mod.layers.{i}.weight": torch.full((2,), float(i)) for i in range(15)}
    save_file(sd, tmp_path / "many.safetensors")
    assert main(["migrate", str(tmp_path / "many.safetensors"), str(tmp_path / "a")]) == 0
    out = capsys.readouterr().out
    assert "renamed 15," in out and "... 5 more" in out
    assert out.count(" -> layers.") == 10
    assert main(["migrate", "--keys", str(tmp_path / "many.safetensors"), str(tmp_path / "b")]) == 0
    out = capsys.readouterr().out
    assert out.count(" -> layers.") == 15 and "more (--keys" not in out


def test_migrate_new_user_mistakes_are_exit_2_with_the_cli_spelling(tmp_path, capsys):
    save_file({"_orig_mod.w": torch.ones(2)}, tmp_path / "c.safetensors")
    src, dst = str(tmp_path / "c.safetensors"), str(tmp_path / "out")
    # a class that needs arguments (transformers' BertModel needs a config): message, not a traceback
    assert main(["migrate", src, dst, "--model", "torch.nn:Linear"]) == 2
    err = capsys.readouterr().err
    assert "--model 'torch.nn:Linear': calling Linear() failed: TypeError" in err
    assert "Traceback" not in err and not (tmp_path / "out").exists()
    assert main(["migrate", src, dst]) == 0
    capsys.readouterr()
    # a second run names the flag, not the Python keyword
    assert main(["migrate", src, dst]) == 2
    err = capsys.readouterr().err
    assert f"{dst} already exists; pass --overwrite to replace it" in err and "overwrite=True" not in err
    assert main(["migrate", src, dst, "--overwrite"]) == 0
