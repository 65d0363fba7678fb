"""One classification of extra state for every reader.
``inspect`` and ``diff`` show per-rank extra-state entries; a DCP checkpoint's extra-state
entries are never called "skipped" (migrate's report and notes, inspect); ``diff`` of a DCP
checkpoint and its migration compares their extra state as equal."""

from __future__ import annotations

import json
import warnings

import torch
import torch.nn as nn

import checkpoint
from checkpoint.cli.main import main as cli
from checkpoint.storage.extra_state import PerRank


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 2)


def _titan(tmp_path):
    """torchtitan's DCP layout: model keys at the top, flattened optimizer, training entries."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    torch.manual_seed(0)
    m = Net()
    o = torch.optim.AdamW(m.parameters(), lr=1e-2)
    s = torch.optim.lr_scheduler.LambdaLR(o, lambda e: 0.5**e)
    m.lin(torch.ones(1, 3)).sum().backward()
    o.step()
    s.step()
    osd = get_optimizer_state_dict(m, o, options=StateDictOptions(flatten_optimizer_state_dict=True))
    state = {**m.state_dict(), "optimizer": osd, "lr_scheduler": s.state_dict(),
             "train_state": {"step": 1}, "dataloader": {"sample_idx": 5}}  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    return tmp_path / "dcp"


def _json(capsys, argv) -> tuple[int, dict]:
    capsys.readouterr()
    rc = cli([*argv, "--json"])
    return rc, json.loads(capsys.readouterr().out)


def test_migrate_report_and_inspect_say_where_dcp_entries_go(tmp_path, capsys):
    d = _titan(tmp_path)
    rep = checkpoint.migrate(d, tmp_path / "out")
    assert rep.skipped == {}  # nothing of lr_scheduler / train_state / dataloader is "skipped"
    assert rep.extra_state == ["dataloader", "lr_scheduler", "train_state"]
    assert not any("skipped" in n or "not migrated" in n for n in rep.notes), rep.notes
    assert any("['dataloader', 'lr_scheduler', 'train_state'] are extra state" in n for n in rep.notes)
    on_disk = json.loads((tmp_path / "out" / "migration_report.json").read_text())
    assert on_disk["skipped"] == {} and on_disk["extra_state"] == rep.extra_state
    rc, data = _json(capsys, ["inspect", str(d)])
    assert rc == 0 and data["skipped"] == {}
    assert data["extra_state"] == {"lr_scheduler": "stateful", "train_state": "stateful", "dataloader": "stateful"}
    # a non-tensor entry of the model container is still skipped, and said so
    torch.save({"w": torch.ones(1), "note": "x"}, tmp_path / "p.pt")
    assert checkpoint.migrate(tmp_path / "p.pt", tmp_path / "p").skipped == {"note": "str"}


def test_diff_of_dcp_and_its_migration_compares_extra_state(tmp_path, capsys):
    d = _titan(tmp_path)
    checkpoint.migrate(d, tmp_path / "out")
    rc, data = _json(capsys, ["diff", str(d), str(tmp_path / "out")])
    assert rc == 0 and data["same"], data
    es = data["parts"]["extra_state"]
    assert es["same"] and es["common"] == 3 and es["only_in_a"] == es["only_in_b"] == []
    # a changed entry is a difference, named
    m2 = Net()
    extra = {"lr_scheduler": None, "train_state": None, "dataloader": None}
    checkpoint.load(m2, tmp_path / "out", extra_state=extra)
    checkpoint.save(m2, tmp_path / "same", extra_state=extra)
    checkpoint.save(m2, tmp_path / "other", extra_state={**extra, "train_state": {"step": 2}})
    rc, data = _json(capsys, ["diff", str(tmp_path / "same"), str(tmp_path / "other"), "--part", "extra_state"])
    assert rc == 1 and data["parts"]["extra_state"]["value_differs"] == ["train_state"]


def test_inspect_and_diff_show_per_rank_entries(tmp_path, capsys):
    m = Net()
    checkpoint.save(m, tmp_path / "a", extra_state={"n": PerRank(5), "step": 3})
    checkpoint.save(m, tmp_path / "b", extra_state={"n": PerRank(6), "step": 3})
    rc, data = _json(capsys, ["inspect", str(tmp_path / "a")])
    assert rc == 0 and data["parts"]["extra_state"] == {"step": "int", "n [rank 0 of 1]": "int"}
    capsys.readouterr()
    assert cli(["inspect", str(tmp_path / "a")]) == 0
    assert "    n [rank 0 of 1]: int" in capsys.readouterr().out
    rc, data = _json(capsys, ["diff", str(tmp_path / "a"), str(tmp_path / "b")])
    es = data["parts"]["extra_state"]
    assert rc == 1 and es["value_differs"] == ["n [rank 0 of 1]"] and es["common"] == 2
    rc, data = _json(capsys, ["diff", str(tmp_path / "a"), str(tmp_path / "a")])
    assert rc == 0 and data["parts"]["extra_state"]["common"] == 2


def test_a_dcp_entry_extra_state_cannot_hold_is_named(tmp_path, capsys):
    """What migrate stops on (an entry with no exact encoding) inspect shows and diff names."""
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({**Net().state_dict(), "dataloader": {"blob": {1, 2}}}, checkpoint_id=str(tmp_path / "d"), no_dist=True)
    rc, data = _json(capsys, ["inspect", str(tmp_path / "d")])
    assert rc == 0 and "set" in data["extra_state"]["(unreadable)"]
    capsys.readouterr()
    assert cli(["diff", str(tmp_path / "d"), str(tmp_path / "d")]) == 2
    assert "dataloader" in capsys.readouterr().err
    assert cli(["diff", str(tmp_path / "d"), str(tmp_path / "d"), "--part", "model"]) == 0
