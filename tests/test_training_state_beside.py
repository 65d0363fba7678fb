"""Training state beside the model in a pickle or DCP checkpoint (``step`` / ``epoch`` tensors,
RNG states, a scheduler, an optimizer), at the top or nested (``{"state": {"model": sd}, "step":
t}``), is not model state: ``load`` reports no unexpected key for it and ``open_source`` lists
only the model's tensors. Names decide (``checkpoint/sources/training_state.py``): a top-level
tensor not named like training state keeps the level a state_dict, so ``{**sd, "ema": sd}``
stays ambiguous and never loads the EMA silently."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp

import checkpoint
from checkpoint.errors import AmbiguousSourceError, TiedValuesMismatchError
from checkpoint.sources import open_source
from snapshot import Snapshot
from tests.helpers import tiny_model, trained


def _layouts(m, opt):
    sd, osd = m.state_dict(), opt.state_dict()
    sched = torch.optim.lr_scheduler.StepLR(opt, 2).state_dict()
    return {  # layout -> (object, container picked, training state left beside)
        "top": ({"model": sd, "step": torch.tensor(5), "rng": torch.get_rng_state(), "epoch": 2},
                "model", ["epoch", "rng", "step"]),
        "nested": ({"state": {"model": sd}, "step": torch.tensor(5)}, "state", ["step"]),  # then "model." resolved
        "nested_opt": ({"state": {"model": sd, "optimizer": osd}, "step": torch.tensor(5)}, "state", ["step"]),
        "inner_step": ({"state": {"model": sd, "step": torch.tensor(3)}, "rng": {"cpu": torch.get_rng_state()},
                        "cuda_rng_state": torch.get_rng_state()}, "state/model", ["cuda_rng_state", "rng", "state/step"]),
        "deep": ({"ckpt": {"state": {"model": sd}, "global_step": torch.tensor(5)}}, "ckpt/state",
                 ["ckpt/global_step"]),
        "lightning_like": ({"state_dict": sd, "optimizer": osd, "lr_scheduler": sched, "iteration": torch.tensor(7)},
                           "state_dict", ["iteration", "lr_scheduler"]),
    }  # fmt: skip


@pytest.mark.parametrize("layout", ["top", "nested", "nested_opt", "inner_step", "deep", "lightning_like"])
def test_pickle_training_state_beside_the_model_is_not_unexpected(tmp_path, layout):
    m, opt = trained(tiny_model(2, 2), torch.optim.SGD, lr=0.1, momentum=0.9)
    obj, container, beside = _layouts(m, opt)[layout]
    path = tmp_path / f"{layout}.pt"
    torch.save(obj, path)
    target = torch.nn.Linear(2, 2)
    report = checkpoint.load(target, path)
    assert (report.unexpected_keys, report.missing_keys, sorted(report.loaded_keys)) == ([], [], ["bias", "weight"])
    assert torch.equal(target.weight, m.weight) and torch.equal(target.bias, m.bias)
    with open_source(path) as src:
        assert src.container == container
        assert sorted(k for k in src.keys()) in (["bias", "weight"], ["model.bias", "model.weight"])
        assert f"training state beside the model, not model keys (not migrated): {beside}" in src.notes


def test_pickle_optimizer_nested_beside_the_model_loads(tmp_path):
    m, opt = trained(tiny_model(2, 2), torch.optim.SGD, lr=0.1, momentum=0.9)
    torch.save(_layouts(m, opt)["nested_opt"][0], tmp_path / "c.pt")
    target = torch.nn.Linear(2, 2)
    topt = torch.optim.SGD(target.parameters(), lr=0.5, momentum=0.9)
    checkpoint.load(target, tmp_path / "c.pt", optimizer=topt)
    assert topt.param_groups[0]["lr"] == 0.1
    buf = opt.state[m.weight]["momentum_buffer"]
    assert torch.equal(topt.state[target.weight]["momentum_buffer"], buf)


def test_dcp_training_state_beside_the_model_is_extra_state(tmp_path):
    m, _ = trained(tiny_model(2, 2), torch.optim.SGD, lr=0.1, momentum=0.9)
    d = tmp_path / "dcp"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP: "assuming the intent is to save in a single process"
        dcp.save({"model": m.state_dict(), "step": torch.tensor(5), "rng": torch.get_rng_state()}, checkpoint_id=str(d))
    target = torch.nn.Linear(2, 2)
    report = checkpoint.load(target, d)
    assert (report.unexpected_keys, report.missing_keys) == ([], [])
    assert torch.equal(target.weight, m.weight)
    with open_source(d) as src:
        assert sorted(src.keys()) == ["bias", "weight"] and src.container == "model"
        assert src.extra_state == {"rng": "other", "step": "other"}


@pytest.mark.parametrize("fmt", ["pickle", "dcp"])
def test_model_named_top_level_tensors_keep_the_level_a_state_dict(tmp_path, fmt):
    """Negative control: ``{"weight", "bias", "ema": {...}}`` is a state_dict beside another
    container; the EMA must not be picked (pickle: two values for each target; DCP: ambiguous)."""
    m, _ = trained(tiny_model(2, 2), torch.optim.SGD, lr=0.1, momentum=0.9)
    obj = {**m.state_dict(), "ema": {k: v + 1 for k, v in m.state_dict().items()}}
    path = tmp_path / "c"
    if fmt == "pickle":
        path = tmp_path / "c.pt"
        torch.save(obj, path)
    else:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.save(obj, checkpoint_id=str(path))
    target = torch.nn.Linear(2, 2)
    snap = Snapshot(target)
    err = TiedValuesMismatchError if fmt == "pickle" else AmbiguousSourceError
    with pytest.raises(err) as e:
        checkpoint.load(target, path)
    if fmt == "pickle":  # "ema." is resolved as a container prefix: two values for one target
        assert "tied names ['weight', 'ema.weight'] (one tensor in the target)" in str(e.value)
    else:
        assert e.value.choices == ["ema"]
    snap.assert_unchanged()
