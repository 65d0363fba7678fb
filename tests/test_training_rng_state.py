"""RNGState: every generator of the process restored exactly; re-derived per rank on another world size."""

import random

import numpy as np
import pytest
import torch

from checkpoint.training.rng_state import RNGState


def _draws():
    return (torch.rand(4).tolist(), random.random(), float(np.random.rand()))


def test_roundtrip_every_generator():
    torch.manual_seed(1), random.seed(2), np.random.seed(3)
    _draws()
    sd = RNGState().state_dict()
    expected = _draws()
    torch.manual_seed(9), random.seed(9), np.random.seed(9)
    RNGState().load_state_dict(sd)
    assert _draws() == expected


def test_malformed_state_refused_before_any_generator_is_set():
    sd = RNGState().state_dict()
    before = RNGState().state_dict()
    for bad in ({**sd, "device": [torch.zeros(3, dtype=torch.uint8)] * 7}, {**sd, "python": [3]},
                {k: v for k, v in sd.items() if k != "numpy"}, {**sd, "torch": torch.zeros(3)}):
        with pytest.raises(ValueError, match="RNGState"):
            RNGState().load_state_dict(bad)
        after = RNGState().state_dict()
        assert torch.equal(after["torch"], before["torch"]) and after["python"] == before["python"]
        assert after["numpy"] == before["numpy"]


def test_reshard_distinct_per_rank_deterministic_and_pure():
    saved = []
    for r in range(2):
        torch.manual_seed(100 + r), random.seed(100 + r), np.random.seed(100 + r)
        saved.append(RNGState().state_dict())
    before = RNGState().state_dict()
    derived = [RNGState.reshard(saved, r, 4) for r in range(4)]
    after = RNGState().state_dict()
    assert torch.equal(before["torch"], after["torch"]) and before["python"] == after["python"]
    streams = []
    for d in derived:
        RNGState().load_state_dict(d)
        streams.append(_draws())
    assert len({str(s) for s in streams}) == 4  # every new rank its own stream
    again = RNGState.reshard(saved, 3, 4)
    RNGState().load_state_dict(again)
    assert _draws() == streams[3]  # the same on every rerun of the resume
