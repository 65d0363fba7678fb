"""Conversions as a user meets them: round trips that come back as they went, dimensions nobody
can check said to be unchecked, refusals in one line that name the fix, side files beside every
layout, and the CLI's verify / inspect / plans / recipes on every layout migrate reads."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

import checkpoint
from checkpoint.cli.main import main as cli

transformers = pytest.importorskip("transformers")

H, NH, NKV, FF, V, L = 32, 4, 2, 64, 61, 2


def _llama(seed=0):
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=V, hidden_size=H, intermediate_size=FF, num_hidden_layers=L, num_attention_heads=NH,
                                   num_key_value_heads=NKV, max_position_embeddings=64, tie_word_embeddings=False)  # fmt: skip
    return transformers.LlamaForCausalLM(cfg).eval()


@pytest.fixture(scope="module")
def titan_dir(tmp_path_factory):
    """A torchtitan Llama checkpoint as torchtitan writes it: safetensors, no config, no report."""
    d = tmp_path_factory.mktemp("titan")
    checkpoint.save(_llama(), d / "hf")
    checkpoint.migrate(d / "hf", d / "tt", recipe="hf-to-torchtitan-llama3")
    (d / "tt" / "conversion_report.json").unlink()
    return d / "tt"


def test_dims_refusal_is_one_line_naming_the_fix(titan_dir, tmp_path, capsys):
    capsys.readouterr()
    assert cli(["migrate", str(titan_dir), str(tmp_path / "out"), "--recipe", "torchtitan-llama3-to-hf"]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and len(err) < 500, err
    assert "--dim n_heads=N --dim n_kv_heads=N" in err and "--model" in err and "params.json / config.json" in err
    assert err.count("n_heads") == 2 and "needs the model dimension" not in err
    assert not (tmp_path / "out").exists()


def test_dims_from_dim_alone_are_said_unchecked_and_config_json_absence_explained(titan_dir, tmp_path, capsys):
    capsys.readouterr()
    argv = ["migrate", str(titan_dir), str(tmp_path / "out"), "--recipe", "torchtitan-llama3-to-hf", "--dim", "n_heads=8", "--dim", "n_kv_heads=4"]
    assert cli(argv) == 0
    err = capsys.readouterr().err.strip().splitlines()
    assert [ln for ln in err if "unchecked" in ln] == [
        "fqnckpt migrate: unchecked: n_heads=8, n_kv_heads=4 come from --dim alone; no config, model or params.json states them "
        "and the tensors' shapes fit other head counts too, so a wrong value converts without error (pass --model, or put "
        "config.json / params.json beside the source, to check them)"]  # fmt: skip
    assert any("no config.json written" in ln and "--model" in ln for ln in err)
    on_disk = json.loads((tmp_path / "out" / "conversion_report.json").read_text())
    assert on_disk["unchecked"] == ["n_heads=8", "n_kv_heads=4"] and "no config.json written" in on_disk["notes"][0]
    assert not (tmp_path / "out" / "config.json").exists()
    # the same dims stated by the source's config.json are checked: nothing said
    rep = checkpoint.migrate(titan_dir, tmp_path / "out2", recipe="torchtitan-llama3-to-hf", model=_llama())
    assert rep.unchecked == [] and rep.notes == [] and (tmp_path / "out2" / "config.json").exists()


def test_recipes_lists_without_importing_torch_or_transformers():
    """``fqnckpt recipes`` is data: listing it imports neither torch nor transformers (it took
    seconds building every recipe, transformers' experts one included)."""
    import subprocess
    import sys
    import textwrap

    probe = textwrap.dedent("""
        import contextlib, io, json, sys
        from checkpoint.cli.main import main
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            rc = main(["--json", "recipes"])
        heavy = [m for m in ("torch", "torch.distributed", "transformers") if m in sys.modules]
        print(json.dumps({"rc": rc, "heavy": heavy, "rows": json.loads(out.getvalue())}))
    """)  # fmt: skip
    r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    assert got["rc"] == 0 and got["heavy"] == []
    rows = {row["name"]: row for row in got["rows"]}
    assert rows["experts-to-fused"]["needs_model"] is True and rows["experts-to-fused"]["versions"] == []
    assert rows["hf-to-torchtitan-llama3"]["versions"][-1] == "3101b42" and rows["hf-to-meta-llama"]["versions"] == ["llama2", "llama3"]
