"""What a user of the ``fqnckpt`` command line meets: verify on checkpoints
of other tools, diff across naming schemes, tensor counts, ambiguous folders, progress bars,
the demo printing as it goes, and nothing left behind."""

from __future__ import annotations

import io
import json
import os
import sys
import textwrap

import pytest
import torch
from safetensors.torch import save_file

import checkpoint
from checkpoint import progress as progress_mod
from checkpoint.cli import demo
from checkpoint.cli.main import main
from tests.helpers import run_cli

TINY = textwrap.dedent(
    """
    import torch
    import torch.nn as nn

    def build():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    """
)


# -- verify ----------------------------------------------------------------------------------------


@pytest.fixture
def hf_dir(tmp_path):
    """A transformers ``save_pretrained(max_shard_size=...)`` directory: index without checksums."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.BertConfig(
        vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=64, max_position_embeddings=32,
    )  # fmt: skip
    torch.manual_seed(0)
    d = tmp_path / "hf"
    transformers.BertModel(cfg).save_pretrained(d, max_shard_size="20KB")
    assert (d / "model.safetensors.index.json").is_file() and len(list(d.glob("*.safetensors"))) > 2
    return d


def test_verify_foreign_index_is_ok_with_a_note_and_truncation_is_a_mismatch(hf_dir, capsys):
    rc, out, _ = run_cli("verify", str(hf_dir), capsys=capsys)
    assert rc == 0, out
    assert out.startswith(f"{hf_dir}: OK (safetensors-sharded") and "not checksummed" in out
    assert "note: " in out and "MISMATCH" not in out
    rep = checkpoint.verify(hf_dir)
    assert rep.ok and rep.checksummed is False and rep.problems == [] and len(rep.notes) == 1
    assert rep.tensors == len(json.loads((hf_dir / "model.safetensors.index.json").read_text())["weight_map"])

    shard = sorted(hf_dir.glob("model-*.safetensors"))[1]
    shard.write_bytes(shard.read_bytes()[:-10])
    rc, out, _ = run_cli("verify", str(hf_dir), "--json", capsys=capsys)
    data = json.loads(out)
    assert rc == 1 and data["ok"] is False and str(shard) in data["problems"][0]


def test_verify_fqnckpt_checkpoint_is_checksummed_and_names_a_flipped_file(tmp_path, capsys):
    ck = tmp_path / "ck"
    checkpoint.save({"a": torch.arange(6.0), "b": torch.ones(3)}, ck, max_shard_size=24)
    rc, out, _ = run_cli("verify", str(ck), capsys=capsys)
    assert rc == 0 and "xxh3_128 checked" in out and "note" not in out
    shard = sorted(ck.glob("model-*.safetensors"))[0]
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0x01
    shard.write_bytes(bytes(data))
    rc, out, _ = run_cli("verify", str(ck), capsys=capsys)
    assert rc == 1 and "MISMATCH" in out and f"problem: {shard}: xxh3_128" in out


def test_verify_pickle_reads_every_tensor_and_names_a_truncated_one(tmp_path, capsys):
    p = tmp_path / "m.pt"
    torch.save({"w": torch.arange(4096.0)}, p)
    rep = checkpoint.verify(p)
    assert rep.ok and rep.format == "torch-zip" and rep.tensors == 1 and rep.total_size == 4096 * 4
    assert rep.checksummed is False and "no checksums" in rep.notes[0]
    assert run_cli("verify", str(p), capsys=capsys)[0] == 0
    p.write_bytes(p.read_bytes()[:2000])
    rc, out, _ = run_cli("verify", str(p), "--json", capsys=capsys)
    assert rc == 1 and str(p) in json.loads(out)["problems"][0]
    rc, out, err = run_cli("verify", str(tmp_path / "nothing"), capsys=capsys)
    assert rc == 2 and "nothing" in err


# -- ambiguous folders and tensor counts --------------------------------------------------------------


@pytest.mark.parametrize("cmd", ["inspect", "migrate", "verify"])
def test_folder_with_several_pickles_lists_them(tmp_path, capsys, cmd):
    d = tmp_path / "d"
    d.mkdir()
    torch.save({"w": torch.ones(1)}, d / "a.pt")
    torch.save({"w": torch.ones(1)}, d / "b.bin")
    argv = [cmd, str(d)] + ([str(tmp_path / "out")] if cmd == "migrate" else [])
    rc, out, err = run_cli(*argv, "--json", capsys=capsys)
    data = json.loads(out)
    assert rc == 2 and data["error"] == "AmbiguousSourceError" and data["file"] == str(d)
    assert "['a.pt', 'b.bin']" in err and len(err.strip().splitlines()) == 1


def test_inspect_counts_tensors_not_segments(tmp_path, capsys):
    sd = {f"module._orig_mod.layers.{i}.weight": torch.ones(2) for i in range(3)}
    sd["head.weight"] = torch.ones(1)
    save_file(sd, tmp_path / "w.safetensors")
    rc, out, _ = run_cli("inspect", str(tmp_path / "w.safetensors"), "--json", capsys=capsys)
    data = json.loads(out)
    assert rc == 0 and data["tensors"] == 4
    assert data["naming_schemes"] == {"wrapper": 3}
    assert data["wrapper_segments"] == {"module": 3, "_orig_mod": 3}
    rc, out, _ = run_cli("inspect", str(tmp_path / "w.safetensors"), capsys=capsys)
    assert "naming (tensors): wrapper x3" in out and "_orig_mod x3, module x3" in out
    assert json.loads(run_cli("--json", "inspect", str(tmp_path / "w.safetensors"), capsys=capsys)[1]) == data


# -- diff across naming schemes -----------------------------------------------------------------------


@pytest.fixture
def compiled_and_migrated(tmp_path, monkeypatch):
    name = f"tiny_{tmp_path.name}".replace("-", "_")
    (tmp_path / f"{name}.py").write_text(TINY)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    model = __import__(name).build()
    sd = {"_orig_mod." + k: v for k, v in model.state_dict().items()}
    torch.save(sd, tmp_path / "compiled.pt")
    checkpoint.migrate(tmp_path / "compiled.pt", tmp_path / "migrated", model=model)
    yield tmp_path, f"{name}:build"
    sys.modules.pop(name, None)


def test_diff_resolves_names_with_model_or_canonical(compiled_and_migrated, capsys):
    d, factory = compiled_and_migrated
    a, b = str(d / "compiled.pt"), str(d / "migrated")
    rc, out, _ = run_cli("diff", a, b, capsys=capsys)
    assert rc == 1 and "DIFFERENT (0 common tensors by raw names" in out and "--canonical" in out
    for flags in (["--model", factory], ["--canonical"]):
        rc, out, _ = run_cli("diff", a, b, *flags, capsys=capsys)
        assert rc == 0, out
        assert "same (4 common tensors" in out and "values compared by sha256 for 4 tensors" in out
    rc, out, _ = run_cli("diff", a, b, "--model", factory, "--no-values", capsys=capsys)
    assert rc == 0 and "values not compared (--no-values)" in out

    # a changed value is found after the names are resolved
    sd = torch.load(d / "compiled.pt")
    sd["_orig_mod.2.bias"] = sd["_orig_mod.2.bias"] + 1
    torch.save(sd, d / "compiled.pt")
    rc, out, _ = run_cli("diff", a, b, "--model", factory, "--json", capsys=capsys)
    data = json.loads(out)
    assert rc == 1 and data["value_differs"] == ["2.bias"] and data["common"] == 4
    assert data["only_in_a"] == data["only_in_b"] == [] and data["compared_values"] is True


def test_diff_reports_keys_the_model_cannot_resolve(compiled_and_migrated, capsys):
    d, factory = compiled_and_migrated
    save_file({"0.weight": torch.zeros(4, 3), "nope.weight": torch.ones(1)}, d / "x.safetensors")
    rc, out, _ = run_cli("diff", str(d / "x.safetensors"), str(d / "migrated"), "--model", factory, "--json", capsys=capsys)
    data = json.loads(out)
    assert rc == 1 and data["unresolved_in_a"] == ["nope.weight"] and data["value_differs"] == ["0.weight"]


# -- progress ----------------------------------------------------------------------------------------


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_policy_and_hooks(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(progress_mod, "DELAY_S", 0.0)  # show at once: no timing in the test
    m = torch.nn.Linear(4, 4)
    checkpoint.save(m, tmp_path / "quiet")  # None and stderr not a terminal: nothing
    checkpoint.load(m, tmp_path / "quiet", progress=False)
    assert capsys.readouterr().err == ""
    checkpoint.save(m, tmp_path / "a", progress=True)
    checkpoint.load(m, tmp_path / "a", progress=True)
    checkpoint.verify(tmp_path / "a", progress=True)
    checkpoint.migrate(tmp_path / "a", tmp_path / "b", progress=True)
    err = capsys.readouterr().err
    for desc in ("save", "load", "verify", "migrate"):
        assert f"{desc}:" in err, err
    tty = _Tty()
    monkeypatch.setattr(sys, "stderr", tty)
    assert progress_mod.progress_enabled(None) and not progress_mod.progress_enabled(False)
    checkpoint.verify(tmp_path / "a")  # None on a terminal: a bar
    assert "verify:" in tty.getvalue()


# -- the demo prints as it goes -------------------------------------------------------------------------


def test_demo_prints_each_check_as_it_finishes(tmp_path, monkeypatch, capsys):
    rows = [demo.Check("first check", "1", "-", True), demo.Check("second check", "2", "-", True)]
    seen_before_end: list[str] = []

    def job(source, workdir, batch=8, world_size=2, on_check=None, on_step=None):
        on_step("a long step")
        on_check(rows[0])
        seen_before_end.append(capsys.readouterr().out)  # printed while the job still runs
        on_check(rows[1])
        return rows

    monkeypatch.setattr(demo, "run_main_job", job)
    assert main(["demo", "--builtin", "--workdir", str(tmp_path / "w")]) == 0
    assert "first check" in seen_before_end[0] and "second check" not in seen_before_end[0]
    out = capsys.readouterr().out
    assert out.count("second check") == 1 and "first check" not in out and "all checks passed" in out


# -- nothing left behind -----------------------------------------------------------------------------


def test_minilm_example_removes_its_temporary_folder(tmp_path, monkeypatch, capsys):
    import importlib.util
    import tempfile

    spec = importlib.util.spec_from_file_location(
        "minilm_example", os.path.join(os.path.dirname(__file__), "..", "examples", "minilm_end_to_end.py")
    )
    ex = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ex)
    used: list[str] = []

    def job(source, workdir, batch, world_size):
        used.append(str(workdir))
        os.makedirs(workdir, exist_ok=True)  # run_main_job creates it
        open(os.path.join(workdir, "big.bin"), "wb").close()
        return [demo.Check("c", "1", "-", True)]

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(ex.demo, "minilm_source", lambda: demo.Source("m", "w", None, "f", "1MB", True))
    monkeypatch.setattr(ex.demo, "run_main_job", job)
    assert ex.main([]) == 0
    assert used and not os.path.exists(used[0])
    assert "temporary files removed" in capsys.readouterr().out
    keep = tmp_path / "keep"
    assert ex.main(["--workdir", str(keep)]) == 0
    assert (keep / "big.bin").exists() and f"files kept in {keep}" in capsys.readouterr().out


def test_successful_save_leaves_only_the_checkpoint(tmp_path):
    checkpoint.save({"w": torch.ones(2)}, tmp_path / "ck")
    assert sorted(os.listdir(tmp_path)) == ["ck"]
    checkpoint.save({"w": torch.zeros(2)}, tmp_path / "ck", overwrite=True)  # in place: same
    assert sorted(os.listdir(tmp_path)) == ["ck"]
    assert sorted(os.listdir(tmp_path / "ck")) == [
        "model-00001-of-00001.safetensors",
        "model.safetensors.index.json",
    ]


@pytest.mark.parametrize("sharded", [False, True], ids=["single", "sharded"])
def test_every_command_reads_a_hub_cache_snapshot(tmp_path, capsys, sharded):
    """What ``snapshot_download`` leaves: every file of ``snapshots/<rev>/`` a symlink into
    ``../../blobs/``. inspect, verify, diff and migrate read it like the plain folder."""
    plain = tmp_path / "plain"
    sd = {"a.weight": torch.arange(6.0), "b.weight": torch.ones(3)}
    if sharded:
        checkpoint.save(sd, plain, max_shard_size=24)
    else:
        plain.mkdir()
        save_file(sd, str(plain / "model.safetensors"))
    repo = tmp_path / "hub" / "models--org--m"
    (repo / "blobs").mkdir(parents=True)
    snap = repo / "snapshots" / ("0" * 40)
    snap.mkdir(parents=True)
    for i, f in enumerate(sorted(plain.iterdir())):
        blob = repo / "blobs" / f"blob{i}"
        blob.write_bytes(f.read_bytes())
        os.symlink(os.path.join("..", "..", "blobs", blob.name), snap / f.name)
    assert run_cli("inspect", str(snap), capsys=capsys)[0] == 0
    rc, out, _ = run_cli("verify", str(snap), capsys=capsys)
    assert rc == 0, out
    rc, out, _ = run_cli("diff", str(snap), str(plain), capsys=capsys)
    assert rc == 0 and "same (2 common tensors" in out
    assert run_cli("migrate", str(snap), str(tmp_path / "out"), capsys=capsys)[0] == 0
    target = {"a.weight": torch.zeros(6), "b.weight": torch.zeros(3)}
    checkpoint.load(target, tmp_path / "out")
    assert torch.equal(target["a.weight"], sd["a.weight"]) and torch.equal(target["b.weight"], sd["b.weight"])
