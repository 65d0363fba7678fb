"""Migration never drops a tensor: every tensor of a pickle, however deep in dicts, lists and
tuples, is migrated, or the migration stops naming it; non-tensor values are reported as such."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import checkpoint
from checkpoint.errors import AmbiguousSourceError, MigrationError
from checkpoint.migrating import migrate


def _keys_and_values(dst) -> dict[str, torch.Tensor]:
    with checkpoint.open_checkpoint(dst) as r:
        return {k: r.get(k) for k in r.keys()}


def test_deep_dicts_lists_tuples_all_migrated(tmp_path):
    deep = torch.arange(3.0)
    for i in reversed(range(40)):  # 40 levels: far past any fixed depth limit
        deep = {f"l{i}": deep}
    src = {
        "top.weight": torch.ones(2),
        "enc": deep,
        "blocks": [{"w": torch.full((2,), 1.0)}, ({"w": torch.full((2,), 2.0)}, torch.full((1,), 3.0))],
        "epoch": 3,
        "config": {"lr": 0.1, "names": ["a", "b"]},
        "empty": {},
    }
    path = tmp_path / "m.pt"
    torch.save(src, path)
    report = migrate(path, tmp_path / "out")
    deep_key = "enc." + ".".join(f"l{i}" for i in range(40))
    want = {
        "top.weight": torch.ones(2),
        deep_key: torch.arange(3.0),
        "blocks.0.w": torch.full((2,), 1.0),
        "blocks.1.0.w": torch.full((2,), 2.0),
        "blocks.1.1": torch.full((1,), 3.0),
    }
    got = _keys_and_values(tmp_path / "out")
    assert set(got) == set(want)
    assert all(torch.equal(got[k], v) for k, v in want.items())
    assert report.ok and set(report.mapping) == set(want)
    # Non-tensors are named with their type; no tensor-holding branch is among them.
    assert report.skipped == {"epoch": "int", "config": "dict", "empty": "dict"}


def test_optimizer_beside_model_in_a_pickle_goes_to_optimizer_files(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(2, 3)).sum().backward()
    opt.step()
    path = tmp_path / "ckpt.pt"
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "epoch": 1}, path)

    # Positional optimizer state and no model: its names are unknown, so the migration stops
    # (never a "successful" migration that leaves the momentum buffers out).
    with pytest.raises(MigrationError, match="keyed by position") as e:
        migrate(path, tmp_path / "out")
    assert "key='model'" in str(e.value)
    assert not (tmp_path / "out").exists()

    # Choosing the model container explicitly leaves the optimizer out, and the report says so.
    report = migrate(path, tmp_path / "only-model", key="model")
    assert any("not migrated" in n and "optimizer" in n for n in report.notes)

    fresh = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    report = migrate(path, tmp_path / "out", model=fresh)
    assert [e.target for e in report.optimizer_entries] == [
        "state.0.weight.momentum_buffer", "state.0.bias.momentum_buffer",
        "state.1.weight.momentum_buffer", "state.1.bias.momentum_buffer",
    ]  # fmt: skip
    new_opt = torch.optim.SGD(fresh.parameters(), lr=0.5, momentum=0.0)
    checkpoint.load(fresh, tmp_path / "out", optimizer=new_opt)
    for a, b in zip(model.parameters(), fresh.parameters()):
        assert torch.equal(a, b)
        assert torch.equal(opt.state[a]["momentum_buffer"], new_opt.state[b]["momentum_buffer"])
    assert new_opt.param_groups[0]["lr"] == 0.1 and new_opt.param_groups[0]["momentum"] == 0.9


def test_several_optimizers_beside_the_model_refused(tmp_path):
    model = nn.Linear(2, 2)
    o1 = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    o2 = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(1, 2)).sum().backward()
    o1.step()
    o2.step()
    path = tmp_path / "ckpt.pt"
    torch.save({"model": model.state_dict(), "opt_g": o1.state_dict(), "opt_d": o2.state_dict()}, path)
    with pytest.raises(AmbiguousSourceError) as e:
        migrate(path, tmp_path / "out", model=nn.Linear(2, 2))
    assert e.value.choices == ["opt_d", "opt_g"]
    assert not (tmp_path / "out").exists()
