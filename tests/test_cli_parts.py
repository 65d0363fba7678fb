"""The CLI reads everything fqnckpt writes: ``inspect`` shows each part (model,
optimizer, extra state) of a checkpoint and a CheckpointManager root's steps; ``diff --part``
compares model, optimizer and extra state; the names of one tied tensor are one tensor; every
dtype and shape the formats hold compares without a crash (0-dim, bool, complex, conj / neg
views, float8)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

import checkpoint
from tests.helpers import run_cli
from tests.helpers import tiny_model, trained


@pytest.fixture
def manager_root(tmp_path):
    m, opt = trained(tiny_model(3, 4, norm=True))
    with pytest.warns(checkpoint.ForeignEntryWarning):
        (tmp_path / "root" / "step-abc").mkdir(parents=True)
        mgr = checkpoint.CheckpointManager(tmp_path / "root", async_save=False)
    mgr.save(1, m, opt, {"step": 1, "note": "x"})
    with torch.no_grad():
        opt.state[m[0].weight]["exp_avg"].add_(1)  # optimizer state only: the model is the same
    opt.param_groups[0]["lr"] = 0.5
    mgr.save(2, m, opt, {"step": 2, "note": "x"})
    return tmp_path / "root", m, opt


def test_inspect_shows_every_part_and_a_manager_roots_steps(manager_root, capsys):
    root, m, opt = manager_root
    step = root / "step-00000002"
    rc, out, _ = run_cli("inspect", step, "--json", capsys=capsys)
    info = json.loads(out)
    assert rc == 0 and info["tensors"] == 7  # the model part: 0.weight/bias, BatchNorm's 5
    assert info["parts"]["model"] == "model.safetensors.index.json"
    o = info["parts"]["optimizer"]
    assert o["optimizer_class"] == "AdamW" and o["tensors"] == 12 and o["params"] == 4
    assert o["state_slots"] == ["exp_avg", "exp_avg_sq", "step"]
    assert o["bytes"] == 2 * (12 + 4 + 4 + 4) * 4 + 4 * 4  # exp_avg + exp_avg_sq, 4 float32 steps
    assert o["param_groups"][0]["lr"] == 0.5 and o["param_groups"][0]["betas"] == [0.9, 0.999]
    # the manager's per-rank RNG entry is shown with its rank (extra_state.rank-00000-of-00001.json)
    assert info["parts"]["extra_state"] == {"step": "int", "note": "str", "fqnckpt.rng [rank 0 of 1]": "stateful RNGState"}
    rc, out, _ = run_cli("inspect", step, capsys=capsys)
    assert "optimizer: AdamW, 12 state tensors (exp_avg, exp_avg_sq, step) for 4 params" in out
    assert "lr=0.5" in out and "extra state: 3 entries" in out and "step: int" in out

    rc, out, _ = run_cli("inspect", step, "--key", "optimizer", "--keys", "--json", capsys=capsys)
    keys = json.loads(out)["keys"]
    assert rc == 0 and set(keys) == {f"state.{p}.{s}" for p in ("0.weight", "0.bias", "1.weight", "1.bias")
                                     for s in ("exp_avg", "exp_avg_sq", "step")}  # fmt: skip
    assert keys["state.0.weight.exp_avg"] == {"shape": [4, 3], "dtype": "torch.float32"}
    rc, _, err = run_cli("inspect", step, "--key", "ema", capsys=capsys)
    assert rc == 2 and "--key" in err and "model and optimizer" in err

    rc, out, _ = run_cli("inspect", root, "--json", capsys=capsys)
    info = json.loads(out)
    assert rc == 0 and info["format"] == "checkpoint-manager"
    assert info["steps"] == [
        {"step": 1, "path": str(root / "step-00000001"), "complete": True},
        {"step": 2, "path": str(root / "step-00000002"), "complete": True},
    ]
    assert info["latest"] == str(step) and info["foreign"] == ["step-abc"]
    rc, out, _ = run_cli("inspect", root, capsys=capsys)
    assert f"fqnckpt inspect {step}" in out and "['step-abc']" in out


def test_verify_of_a_manager_root_names_its_latest_step(manager_root, capsys):
    root, _, _ = manager_root
    before = sorted(p.name for p in root.iterdir())
    rc, out, err = run_cli("verify", root, capsys=capsys)
    assert rc == 2 and out == ""
    assert err.strip() == (
        f"fqnckpt verify: error: {root} is a CheckpointManager root (2 steps), not one checkpoint; "
        f"verify a step: fqnckpt verify {root / 'step-00000002'}"
    )
    assert sorted(p.name for p in root.iterdir()) == before


def test_diff_part_model_optimizer_extra_state(manager_root, capsys, tmp_path):
    root, m, _ = manager_root
    a, b = root / "step-00000001", root / "step-00000002"
    rc, out, _ = run_cli("diff", a, b, "--part", "model", "--json", capsys=capsys)
    d = json.loads(out)
    assert rc == 0 and d["same"] and d["common"] == 7 and list(d["parts"]) == ["model"]
    rc, out, _ = run_cli("diff", a, b, "--part", "optimizer", "--json", capsys=capsys)
    o = json.loads(out)["parts"]["optimizer"]
    assert rc == 1 and o["value_differs"] == ["state.0.weight.exp_avg"] and o["common"] == 12
    assert o["param_groups_compared"] and o["param_groups_differ"]
    rc, out, _ = run_cli("diff", a, b, "--part", "extra_state", "--json", capsys=capsys)
    e = json.loads(out)["parts"]["extra_state"]
    assert rc == 1 and e["value_differs"] == ["step"] and e["common"] == 3  # step, note, fqnckpt.rng [rank 0 of 1]
    rc, out, _ = run_cli("diff", a, b, capsys=capsys)  # default: every part
    assert rc == 1 and "optimizer: DIFFERENT" in out and "extra_state: DIFFERENT" in out
    assert run_cli("diff", a, a, capsys=capsys)[0] == 0
    # A side without an optimizer: the part is only in one side; asking for a part neither has is bad input.
    save_file({k: v.contiguous() for k, v in m.state_dict().items()}, tmp_path / "m.safetensors")
    rc, out, _ = run_cli("diff", a, tmp_path / "m.safetensors", "--json", capsys=capsys)
    d = json.loads(out)
    assert rc == 1 and d["parts"]["model"]["same"] and d["parts"]["optimizer"]["present_only_in"] == "a"
    assert run_cli("diff", a, tmp_path / "m.safetensors", "--part", "model", capsys=capsys)[0] == 0
    rc, _, err = run_cli("diff", tmp_path / "m.safetensors", tmp_path / "m.safetensors", "--part", "optimizer", capsys=capsys)
    assert rc == 2 and "--part" in err


def test_diff_treats_the_names_of_one_tied_tensor_as_one(tmp_path, capsys, monkeypatch):
    """GPT-2's tied ``lm_head.weight``: a compiled model's state_dict holds both names, the
    migrated checkpoint stores the tensor once (index alias groups): the same, exit 0."""
    from tests.models import hf_gpt2

    monkeypatch.chdir(tmp_path.parent)
    (tmp_path / "gmodel.py").write_text("from tests.models import hf_gpt2 as build\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.syspath_prepend(str(__import__("pathlib").Path(__file__).resolve().parents[1]))
    torch.manual_seed(0)
    sd = torch.compile(hf_gpt2()).state_dict()
    assert sd["_orig_mod.lm_head.weight"].data_ptr() == sd["_orig_mod.transformer.wte.weight"].data_ptr()
    torch.save(sd, tmp_path / "compiled.pt")
    rc, _, err = run_cli("migrate", tmp_path / "compiled.pt", tmp_path / "mig", "--model", "gmodel:build", capsys=capsys)
    assert rc == 0, err
    rc, out, _ = run_cli("diff", tmp_path / "compiled.pt", tmp_path / "mig", "--model", "gmodel:build", "--json", capsys=capsys)
    d = json.loads(out)
    assert rc == 0 and d["same"], out
    assert d["tied_in_a"] == [["_orig_mod.lm_head.weight", "_orig_mod.transformer.wte.weight"]]
    assert d["common"] == len(sd) - 1 and d["values_compared"] == len(sd) - 1
    rc, out, _ = run_cli("diff", tmp_path / "compiled.pt", tmp_path / "mig", "--canonical", "--json", capsys=capsys)
    d = json.loads(out)
    assert rc == 0 and d["common"] == len(sd) and "lm_head.weight" not in d["only_in_a"]
    # Two names of one side with different bytes are two tensors under one name: a conflict.
    untied = {k: v.clone() for k, v in sd.items()}
    untied["_orig_mod.lm_head.weight"] += 1
    torch.save(untied, tmp_path / "untied.pt")
    rc, out, _ = run_cli("diff", tmp_path / "untied.pt", tmp_path / "mig", "--model", "gmodel:build", "--json", capsys=capsys)
    d = json.loads(out)
    assert rc == 1 and len(d["conflicting_in_a"]) == 1 and "_orig_mod.lm_head.weight" in d["conflicting_in_a"][0]


DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int8, torch.int16, torch.int32,
          torch.int64, torch.uint8, torch.uint16, torch.uint32, torch.uint64, torch.bool, torch.float8_e4m3fn,
          torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz, torch.float8_e8m0fnu, torch.complex64]  # fmt: skip


def _every_dtype(bump: str | None = None) -> dict[str, torch.Tensor]:
    out = {}
    for dt in DTYPES:
        name = str(dt).removeprefix("torch.")
        for shape in ((3, 2), ()):
            key = f"{name}{'_0d' if not shape else ''}"
            t = torch.ones(shape, dtype=dt) if dt.is_complex or dt == torch.bool else torch.ones(shape).to(dt)
            if key == bump:
                t = torch.zeros_like(t)
            out[key] = t
    return out


@pytest.mark.parametrize("fmt", ["fqnckpt", "safetensors", "pickle"])
def test_diff_compares_every_dtype_and_shape(tmp_path, capsys, fmt):
    def write(name, sd):
        if fmt == "fqnckpt":
            checkpoint.save(sd, tmp_path / name)
            return tmp_path / name
        if fmt == "safetensors":
            save_file(sd, tmp_path / f"{name}.safetensors")
            return tmp_path / f"{name}.safetensors"
        torch.save(sd, tmp_path / f"{name}.pt")
        return tmp_path / f"{name}.pt"

    extra_a, extra_b = {}, {}
    if fmt == "pickle":  # views a pickle keeps: conjugate and negative bits, complex128
        z = torch.tensor([1 + 2j, 3 - 1j], dtype=torch.complex128)
        extra_a = {"conj": z.conj(), "neg": torch._neg_view(torch.arange(3.0)), "c128_0d": z[0]}
        extra_b = {"conj": z.conj().resolve_conj(), "neg": -torch.arange(3.0), "c128_0d": z[0].clone()}
    a = write("a", _every_dtype() | extra_a)
    b = write("b", _every_dtype() | extra_b)
    rc, out, err = run_cli("diff", a, b, "--json", capsys=capsys)
    d = json.loads(out)
    assert rc == 0 and d["same"] and d["values_compared"] == 2 * len(DTYPES) + len(extra_a), err
    for bump in ("bool_0d", "float8_e5m2", "complex64_0d", "uint64"):
        c = write(f"c-{bump}", _every_dtype(bump) | extra_b)
        rc, out, err = run_cli("diff", a, c, "--json", capsys=capsys)
        assert rc == 1 and json.loads(out)["value_differs"] == [bump], (bump, out, err)
    if fmt == "pickle":
        c = write("c-conj", _every_dtype() | extra_b | {"conj": extra_b["conj"].conj()})
        assert json.loads(run_cli("diff", a, c, "--json", capsys=capsys)[1])["value_differs"] == ["conj"]


def test_inspect_counts_read_in_the_singular_for_one(tmp_path, capsys):
    m = torch.nn.Linear(1, 1, bias=False)
    opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    m(torch.ones(1, 1)).sum().backward()
    opt.step()
    checkpoint.save(m, tmp_path / "one", optimizer=opt)
    rc, out, _ = run_cli("inspect", tmp_path / "one", capsys=capsys)
    assert rc == 0
    assert "    model-00001-of-00001.safetensors: 1 tensor, 4 B\n" in out
    assert "optimizer: SGD, 1 state tensor (momentum_buffer) for 1 param, 1 param group" in out
