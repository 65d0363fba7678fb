"""The shared test helpers (tests/helpers.py) say what they promise: ``assert_same_state`` is exact
(bits, dtypes, key sets, value types), ``trained`` is deterministic, ``run_cli`` returns the
command's exit code and streams."""

from __future__ import annotations

import collections
import json

import pytest
import torch

from tests.helpers import assert_same_state, run_cli, same_state, tiny_model, trained


@pytest.mark.parametrize(
    "a, b, message",
    [
        ({"w": torch.tensor([0.0])}, {"w": torch.tensor([-0.0])}, "state.w: tensor values differ"),
        ({"w": torch.ones(2)}, {"w": torch.ones(2, dtype=torch.float64)}, "state.w: dtype"),
        ({"w": torch.ones(2)}, {"w": torch.ones(1, 2)}, "state.w: shape"),
        ({"w": torch.ones(2)}, {"w": torch.ones(2), "b": torch.ones(1)}, "state: keys"),
        ({"lr": 1}, {"lr": 1.0}, "state.lr: int != float"),
        ({"betas": (0.9, 0.99)}, {"betas": [0.9, 0.99]}, "state.betas: tuple != list"),
        ({"x": float("nan"), "y": 0.0}, {"x": float("nan"), "y": -0.0}, "state.y: 0.0 != -0.0"),
        ({"w": torch.ones(2)}, {"w": [1.0, 1.0]}, "state.w: Tensor != list"),
    ],
)
def test_assert_same_state_names_each_difference(a, b, message):
    with pytest.raises(AssertionError, match=message.replace("(", r"\(").replace(")", r"\)")):
        assert_same_state(a, b)
    assert not same_state(a, b)


def test_assert_same_state_accepts_exact_copies():
    m = tiny_model(norm=True)
    snapshot = {k: v.clone() for k, v in m.state_dict().items()}  # a dict beside an OrderedDict
    assert_same_state(m, tiny_model(norm=True))
    assert_same_state(m.state_dict(), snapshot)
    nan = {"w": torch.tensor([float("nan"), -0.0]), "f": float("nan"), "n": None, "s": "x"}
    assert_same_state(nan, {"w": torch.tensor([float("nan"), -0.0]), "f": float("nan"), "n": None, "s": "x"})
    assert same_state(collections.OrderedDict(a=1, b=2), {"b": 2, "a": 1})
    with pytest.raises(AssertionError, match="keys"):
        assert_same_state(collections.OrderedDict(a=1, b=2), {"b": 2, "a": 1}, ordered=True)


def test_trained_is_deterministic_and_steps():
    m1, o1 = trained(steps=2)
    m2, o2 = trained(steps=2)
    assert_same_state(m1, m2)
    assert_same_state(o1.state_dict(), o2.state_dict())
    assert o1.state_dict()["state"][0]["step"].item() == 2.0
    assert not same_state(m1, tiny_model())  # the steps moved the values
    _, _, sched = trained(tiny_model(3, 2), torch.optim.SGD, steps=3, scheduler=True, lr=0.5)
    assert sched.last_epoch == 3 and sched.get_last_lr() == [0.5 * 0.5**3]
    assert list(tiny_model(3, 2).state_dict()) == ["weight", "bias"]
    assert list(tiny_model(4, 8, 2, relu=True).state_dict()) == ["0.weight", "0.bias", "2.weight", "2.bias"]


def test_run_cli_returns_code_stdout_and_stderr(tmp_path, capsys):
    import checkpoint

    checkpoint.save(tiny_model(), tmp_path / "ck")
    code, out, err = run_cli("inspect", tmp_path / "ck", capsys=capsys)
    assert code == 0 and "tensors: 4, 92 B" in out and err == "", (out, err)
    code, info, _ = run_cli("inspect", tmp_path / "ck", capsys=capsys, as_json=True)
    assert code == 0 and info["tensors"] == 4
    code, out, err = run_cli("inspect", tmp_path / "missing")  # without capsys: redirected
    assert code != 0 and out == "" and "missing" in err
    assert json.loads(run_cli("inspect", tmp_path / "ck", "--json")[1])["tensors"] == 4
