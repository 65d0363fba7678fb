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
from tests.helpers import run_cli

transformers = pytest.importorskip("transformers")

H, NH, NKV, FF, V, L = 32, 4, 2, 64, 61, 2


def _llama(seed=0, vocab=V):
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=H, intermediate_size=FF, num_hidden_layers=L, num_attention_heads=NH,
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
    """``fqnckpt recipes`` is data: listing it imports neither torch nor transformers (building
    every recipe, transformers' experts one included, would take seconds)."""
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
    assert rows["hf-to-torchtitan-llama3"]["versions"][-2:] == ["3101b42", "fused-qkv"] and rows["hf-to-meta-llama"]["versions"] == ["llama2", "llama3"]


def _meta_dir(path, shards=2):
    """Meta Llama 2 shards: tok_embeddings split by columns (dim 1), wq and output by rows
    (Meta's own names, which are torchtitan's legacy ones too)."""
    path.mkdir()
    g = torch.Generator().manual_seed(0)
    emb, wq = torch.randn(8, 4, generator=g), torch.randn(4, 4, generator=g)
    for i in range(shards):
        torch.save({"tok_embeddings.weight": emb.chunk(shards, 1)[i].clone(), "layers.0.attention.wq.weight": wq.chunk(shards, 0)[i].clone(),
                    "norm.weight": torch.ones(4), "output.weight": emb.chunk(shards, 0)[i].clone()}, path / f"consolidated.{i:02d}.pth")  # fmt: skip
    (path / "params.json").write_text(json.dumps({"dim": 4, "n_layers": 1, "n_heads": 2}))
    return path


def test_verify_names_the_files_it_checked_for_every_layout(tmp_path, capsys):
    import warnings

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageWriter

    sd = {"a.weight": torch.randn(4, 3), "b.bias": torch.randn(3)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(dict(sd), checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
        dcp.save(dict(sd), storage_writer=HuggingFaceStorageWriter(str(tmp_path / "hf_ranks"), save_distributed=True), no_dist=True)
    (tmp_path / "adapter").mkdir()
    save_file({"base_model.model.lin.lora_A.weight": torch.randn(2, 3)}, tmp_path / "adapter" / "adapter_model.safetensors")
    (tmp_path / "adapter" / "adapter_config.json").write_text(json.dumps({"r": 2, "lora_alpha": 4, "peft_type": "LORA"}))
    _meta_dir(tmp_path / "meta")
    want = {"dcp": [".metadata", "__0_0.distcp"], "hf_ranks": ["shard-00001-model-00001-of-00001.safetensors"],
            "adapter": ["adapter_model.safetensors"], "meta": ["consolidated.00.pth", "consolidated.01.pth"]}  # fmt: skip
    for name, files in want.items():
        rc, out, _ = run_cli("verify", str(tmp_path / name), capsys=capsys, as_json=True)
        assert rc == 0 and out["ok"] and [f["file"] for f in out["files"]] == files, (name, out)
        assert [f["size"] for f in out["files"]] == [(tmp_path / name / f).stat().st_size for f in files]
        assert all(f["algorithm"] == "none" and f["expected_digest"] is None for f in out["files"])
        assert cli(["verify", str(tmp_path / name)]) == 0
        text = capsys.readouterr().out
        assert f"{len(files)} file" in text and f"  files: {', '.join(files)}" in text, text


def test_inspect_reads_a_meta_shard_directory_as_migrate_does(tmp_path, capsys):
    d = _meta_dir(tmp_path / "meta")
    rc, out, _ = run_cli("inspect", "--keys", str(d), capsys=capsys, as_json=True)
    assert rc == 0 and out["format"] == "meta-shards" and out["layout"] == "meta llama2 (2 model-parallel shards)"
    assert out["tensors"] == 4 and out["total_bytes"] == 2 * (8 * 2 + 2 * 4 + 4 + 4 * 4) * 4
    assert sorted(out["per_file"]) == ["consolidated.00.pth", "consolidated.01.pth"]
    assert out["keys"]["tok_embeddings.weight"] == {"shape": [8, 2], "dtype": "torch.float32"}  # one shard's piece
    rc, one, _ = run_cli("inspect", str(d / "consolidated.00.pth"), capsys=capsys, as_json=True)
    assert rc == 0 and one["layout"] == "meta (one model-parallel shard: the same in Llama 2 and 3)"


def test_plans_print_the_names_of_the_source_version(titan_dir, tmp_path, capsys):
    """A torchtitan checkpoint in today's names (3101b42: lm_head, qkv_linear) is planned in those
    names, not the legacy names the rules are written in; the legacy version keeps its own."""
    rc, out, _ = run_cli("migrate", str(titan_dir), str(tmp_path / "x"), "--recipe", "torchtitan-llama3-to-hf",
                         "--dim", "n_heads=4", "--dim", "n_kv_heads=2", "--dry-run", capsys=capsys, as_json=True)  # fmt: skip
    rules = [u["rule"].split(" [")[0] for u in out["rules"]]
    assert rc == 0 and out["layouts"] == {"source": "torchtitan 70dd945..3101b42 (read as 3101b42)"}
    assert "lm_head.weight -> lm_head.weight" in rules and "output.weight -> lm_head.weight" not in rules
    assert "layers.{i}.attention.qkv_linear.wq.weight -> model.layers.{i}.self_attn.q_proj.weight" in rules
    rc, out, _ = run_cli("migrate", str(titan_dir.parent / "hf"), str(tmp_path / "y"), "--recipe",
                         "hf-to-torchtitan-llama3@legacy", "--dry-run", capsys=capsys, as_json=True)  # fmt: skip
    assert rc == 0 and "model.norm.weight -> norm.weight" in [u["rule"] for u in out["rules"]]
    assert "lm_head.weight -> output.weight" in [u["rule"] for u in out["rules"]]


def test_hf_to_megatron_writes_config_json_and_comes_back_without_a_model(tmp_path):
    """Megatron-Bridge builds its model from the HF config: hf-to-megatron-gpt writes config.json
    beside its output; megatron-gpt-to-hf then needs no model (dims and config.json from it)."""
    hf = _llama(3)
    checkpoint.save(hf, tmp_path / "hf")
    checkpoint.migrate(tmp_path / "hf", tmp_path / "mg", recipe="hf-to-megatron-gpt")
    src_cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    mg_cfg = json.loads((tmp_path / "mg" / "config.json").read_text())
    assert mg_cfg == src_cfg | {k: mg_cfg[k] for k in ("rope_scaling", "rope_theta") if k in mg_cfg and k not in src_cfg}
    assert mg_cfg["num_key_value_heads"] == NKV and mg_cfg["architectures"] == ["LlamaForCausalLM"]
    rep = checkpoint.migrate(tmp_path / "mg", tmp_path / "back", recipe="megatron-gpt-to-hf")
    assert rep.notes == [] and rep.dims["n_kv_heads"] == NKV
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back")
    sd = hf.state_dict()
    assert sorted(again.state_dict()) == sorted(sd) and all(torch.equal(again.state_dict()[k], sd[k]) for k in sd)


from tests.backends import fresh, moto_fixture, put  # noqa: E402

moto_opts = moto_fixture("trustconvert")


@pytest.mark.parametrize("backend", ["memory", "s3"])
def test_meta_layout_on_object_storage_is_read_back_from_there(backend, tmp_path, request, monkeypatch):
    """Meta's shards written to memory:// or s3:// (fqnckpt's record, or uploaded by another tool
    with no record) convert back from there: the same tensors, the local copies removed (in a
    temporary directory of this test's own: other processes' conversions may run beside it)."""
    import glob
    import tempfile

    from checkpoint.sources import open_source

    own = tmp_path / "tmp"
    own.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(own))

    opts = request.getfixturevalue("moto_opts") if backend == "s3" else {}
    hf = _llama(5, vocab=V + 1)  # Meta splits the vocabulary evenly
    checkpoint.save(hf, tmp_path / "hf")
    url, so = fresh(backend, tmp_path, opts, "trustconvert")
    checkpoint.migrate(tmp_path / "hf", url, recipe="hf-to-meta-llama", dims={"shards": 2}, storage_options=so)
    rep = checkpoint.migrate(url, tmp_path / "back", recipe="meta-llama-to-hf", storage_options=so)
    assert rep.shards == 2 and rep.layouts == {"source": "meta llama3"}
    sd = hf.state_dict()
    with open_source(tmp_path / "back") as got:
        assert sorted(got.keys()) == sorted(sd) and all(torch.equal(got.get(k), sd[k]) for k in sd)
    assert glob.glob(f"{tempfile.gettempdir()}/.fqnckpt-remote-meta-*") == []
    # another tool's upload: plain objects, no record
    url2, _ = fresh(backend, tmp_path, opts, "trustconvert")
    checkpoint.migrate(tmp_path / "hf", tmp_path / "meta", recipe="hf-to-meta-llama", dims={"shards": 2})
    for name in ("consolidated.00.pth", "consolidated.01.pth", "params.json"):
        put(url2, so, name, (tmp_path / "meta" / name).read_bytes())
    checkpoint.migrate(url2, tmp_path / "back2", recipe="meta-llama-to-hf", model=_llama(vocab=V + 1), storage_options=so)
    with open_source(tmp_path / "back2") as got:
        assert all(torch.equal(got.get(k), sd[k]) for k in sd)


def test_torchtitan_round_trip_writes_back_the_version_it_read(tmp_path):
    """torchtitan legacy (output.weight, attention.wq) -> HF -> torchtitan with no version asked:
    legacy again, the same tensors (the newest names only when nothing recorded the version)."""
    from checkpoint.sources import open_source

    hf = _llama(7)
    checkpoint.save(hf, tmp_path / "hf")
    checkpoint.migrate(tmp_path / "hf", tmp_path / "tt", recipe="hf-to-torchtitan-llama3@legacy")
    fwd = checkpoint.migrate(tmp_path / "tt", tmp_path / "hf2", recipe="torchtitan-llama3-to-hf")
    assert fwd.layouts == {"source": "torchtitan legacy"}
    rep = checkpoint.migrate(tmp_path / "hf2", tmp_path / "tt2", recipe="hf-to-torchtitan-llama3")
    assert rep.layouts == {"target": "torchtitan legacy"}
    with open_source(tmp_path / "tt") as a, open_source(tmp_path / "tt2") as b:
        assert sorted(a.keys()) == sorted(b.keys()) and "output.weight" in a.keys()
        assert all(torch.equal(a.get(k), b.get(k)) for k in a.keys())
    (tmp_path / "hf2" / "conversion_report.json").unlink()
    rep = checkpoint.migrate(tmp_path / "hf2", tmp_path / "tt3", recipe="hf-to-torchtitan-llama3", dims={"n_heads": NH, "n_kv_heads": NKV})
    assert rep.layouts == {"target": "torchtitan 3101b42"}


def test_torchtitan_fused_qkv_is_one_more_layout_version(tmp_path):
    """torchtitan's FusedQKVLinear saved unsplit (attention.qkv_linear.wqkv: per KV group
    [q heads of the group; k; v], as its _merge_qkv_on_load builds it from wq / wk / wv): written
    as @fused-qkv, read back to the HF tensors with no version asked, and HF -> torchtitan
    writes it fused again (the forward recorded it)."""
    from checkpoint.sources import open_source

    hf = _llama(8)
    checkpoint.save(hf, tmp_path / "hf")
    checkpoint.migrate(tmp_path / "hf", tmp_path / "tt", recipe="hf-to-torchtitan-llama3")
    rep = checkpoint.migrate(tmp_path / "hf", tmp_path / "fused", recipe="hf-to-torchtitan-llama3@fused-qkv")
    assert rep.layouts == {"target": "torchtitan fused-qkv (3101b42 names, layers.{i}.attention.qkv_linear.wqkv.weight)"}
    with open_source(tmp_path / "tt") as sep, open_source(tmp_path / "fused") as fused:
        hd = H // NH
        for i in range(L):
            p = f"layers.{i}.attention.qkv_linear."
            q, k, v = (sep.get(p + f"{w}.weight") for w in ("wq", "wk", "wv"))
            want = torch.cat([q.reshape(NKV, NH // NKV, hd, H), k.reshape(NKV, 1, hd, H), v.reshape(NKV, 1, hd, H)], 1).reshape(-1, H)
            assert torch.equal(fused.get(p + "wqkv.weight"), want)
        assert set(fused.keys()) == {k for k in sep.keys() if not k.endswith((".wq.weight", ".wk.weight", ".wv.weight"))} | {
            f"layers.{i}.attention.qkv_linear.wqkv.weight" for i in range(L)}
    back = checkpoint.migrate(tmp_path / "fused", tmp_path / "hf2", recipe="torchtitan-llama3-to-hf")
    assert back.layouts["source"].startswith("torchtitan fused-qkv (")
    sd = hf.state_dict()
    with open_source(tmp_path / "hf2") as got:
        assert sorted(got.keys()) == sorted(sd) and all(torch.equal(got.get(k), sd[k]) for k in sd)
    again = checkpoint.migrate(tmp_path / "hf2", tmp_path / "fused2", recipe="hf-to-torchtitan-llama3")
    assert again.layouts == rep.layouts
    assert cli(["inspect", str(tmp_path / "fused")]) == 0
