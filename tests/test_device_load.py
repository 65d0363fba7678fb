"""The accelerator load path (checkpoint/device_load.py) run on CPU targets: pieces cut to the
host buffer's size, row ranges read as byte ranges, blocks of DTensor-like slices, two buffers
alternating, and refusals (another dtype, a block that is not one byte range) left to the caller.
Values are compared with safetensors' own reader (the oracle)."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open

import checkpoint
from checkpoint.device_load import _pieces, read_to_device
from checkpoint.storage.opening import open_checkpoint


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    g = torch.Generator().manual_seed(0)
    sd = {
        "big": torch.randn(37, 50, generator=g),  # 7,400 bytes: cut into row ranges
        "wide": torch.randn(3, 2000, generator=g),  # one row (8,000 bytes) over the chunk: cut in a row
        "ints": torch.randint(-9, 9, (5, 4), generator=g),
        "bf": torch.randn(6, 3, generator=g).to(torch.bfloat16),
        "scalar": torch.tensor(1.5),
        "flags": torch.rand(11, generator=g) > 0.5,
    }
    path = tmp_path_factory.mktemp("dl") / "ck"
    checkpoint.save(sd, path, max_shard_size=20_000)
    return path, sd


def _oracle(path, key):
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(f, framework="pt") as h:
            if key in h.keys():
                return h.get_tensor(key)
    raise KeyError(key)


def test_pieces_cut_along_the_first_long_dim_within_the_chunk():
    out = torch.empty(10, 4, 6)  # 96 bytes a row of dim 0
    pieces = list(_pieces(out, (slice(0, 10), slice(0, 4), slice(0, 6)), 4, 200))
    assert [p.shape[0] for p, _ in pieces] == [2, 2, 2, 2, 2]
    assert [s[0] for _, s in pieces] == [slice(0, 2), slice(2, 4), slice(4, 6), slice(6, 8), slice(8, 10)]
    deep = list(_pieces(out[3:4], (slice(3, 4), slice(0, 4), slice(0, 6)), 4, 50))  # a row over 50 bytes
    assert [tuple(p.shape) for p, _ in deep] == [(1, 2, 6), (1, 2, 6)]
    assert [s[:2] for _, s in deep] == [(slice(3, 4), slice(0, 2)), (slice(3, 4), slice(2, 4))]
    assert list(_pieces(torch.empty(()), (), 4, 1))[0][1] == ()


def test_read_to_device_path_on_cpu_targets(saved):
    path, sd = saved
    with open_checkpoint(path) as rd:
        outs = {k: torch.full_like(v, 0) for k, v in sd.items()}
        items = [(k, outs[k]) for k in sd]
        # a Shard(0)-like block, a non-contiguous target view, a Shard(1)-like block (not one range)
        block = torch.zeros(20, 50)
        items.append(("big", block, (slice(10, 30), slice(0, 50))))
        strided = torch.zeros(50, 37).t()
        items.append(("big", strided))
        col = torch.zeros(37, 10)
        items.append(("big", col, (slice(0, 37), slice(5, 15))))
        items.append(("ints", torch.zeros(5, 4, dtype=torch.float64)))  # another dtype than stored
        done = read_to_device(rd, items, chunk=1024)
    assert done == [True] * len(sd) + [True, True, False, False]
    for k in sd:
        assert torch.equal(outs[k], _oracle(path, k)), k
    assert torch.equal(block, _oracle(path, "big")[10:30]) and torch.equal(strided, _oracle(path, "big"))
    assert torch.equal(col, torch.zeros(37, 10))  # refused: nothing was copied into it


class _Off(torch.Tensor):
    """A CPU tensor that says it is not on the CPU: stands for an accelerator target here."""

    is_cpu = property(lambda self: False)


def test_load_routes_accelerator_targets_through_device_load(saved, monkeypatch):
    """checkpoint.load sends targets off the CPU to read_to_device (small chunks here, so pieces
    alternate between the two host buffers) and CPU targets to read_many only."""
    import checkpoint.device_load as dl

    path, sd = saved
    seen = []
    real = dl.read_to_device

    def spy(reader, items, chunk=dl.CHUNK):
        seen.extend(it[0] for it in items)
        return real(reader, items, chunk=512)

    monkeypatch.setattr(dl, "read_to_device", spy)
    plain = {k: torch.zeros_like(v) for k, v in sd.items()}
    assert checkpoint.load(plain, path).ok and seen == []  # CPU targets never take the device path
    off = {k: torch.zeros_like(v).as_subclass(_Off) for k, v in sd.items()}
    assert checkpoint.load(off, path).ok
    assert sorted(seen) == sorted(sd)
    for k, v in sd.items():
        assert torch.equal(off[k].as_subclass(torch.Tensor), v), k
