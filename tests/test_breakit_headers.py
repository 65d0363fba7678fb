"""Shard headers safetensors accepts or refuses, read through every reader's header check
(``checkpoint.storage.st_header.header_of_bytes``): a header safetensors refuses is refused as
:class:`CorruptCheckpointError` naming the file (never a bare error from building the message),
and one safetensors accepts loads exactly what ``safetensors.torch.load_file`` gives, repeated
keys inside a tensor's entry or ``__metadata__`` included (only a repeated tensor name is
refused, whatever escapes the header holds)."""

from __future__ import annotations

import struct

import pytest
import torch
from safetensors.torch import load_file

import checkpoint
from checkpoint.errors import CorruptCheckpointError

E = '{"dtype":"F32","shape":[1],"data_offsets":[0,4]}'
DATA = struct.pack("<f", 1.0)


def _write(tmp_path, header: str):
    p = tmp_path / "model.safetensors"
    h = header.encode()
    p.write_bytes(struct.pack("<Q", len(h)) + h + DATA)
    return p


def _ours(p) -> dict[str, torch.Tensor]:
    r = checkpoint.open_checkpoint(p)
    try:
        return {k: r.get(k) for k in r.keys()}
    finally:
        r.close()


@pytest.mark.parametrize(
    "header",
    [
        '{"a":{"dtype":"F32","shape":[Infinity],"data_offsets":[0,4]}}',
        '{"a":{"dtype":"F32","shape":[-Infinity],"data_offsets":[0,4]}}',
        '{"a":{"dtype":{},"shape":[1],"data_offsets":[0,4]}}',
        '{"a":{"dtype":["F32"],"shape":[1],"data_offsets":[0,4]}}',
    ],
    ids=["inf_dim", "neg_inf_dim", "dict_dtype", "list_dtype"],
)
def test_a_header_safetensors_refuses_is_refused_by_name(tmp_path, header):
    p = _write(tmp_path, header)
    with pytest.raises(Exception, match="Error while deserializing header"):
        load_file(p)
    with pytest.raises(CorruptCheckpointError) as e:
        _ours(p)
    assert str(p) in str(e.value)


@pytest.mark.parametrize(
    "header",
    [
        '{"\\u0061":{"dtype":"F32","shape":[1],"data_offsets":[0,4],"x":{"k":1,"k":2}}}',
        '{"__metadata__":{"x":"1","x":"2"},"\\u0061":%s}' % E,
        '{"__metadata__":{"x":"1","x":"2"},"a":%s}' % E,
        '{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4],"x":{"a":1,"a":[{"b":1,"b":2}]}}}',
    ],
    ids=["dup_in_entry_escaped", "dup_metadata_escaped", "dup_metadata", "dup_nested_plain"],
)
def test_repeated_keys_below_the_top_level_load_as_safetensors_does(tmp_path, header):
    p = _write(tmp_path, header)
    want = load_file(p)
    got = _ours(p)
    assert list(got) == list(want) == ["a"]
    assert got["a"].dtype == want["a"].dtype and torch.equal(got["a"], want["a"])


@pytest.mark.parametrize(
    "header",
    ['{"a":%s,"a":%s}' % (E, E), '{"a":%s,"\\u0061":%s}' % (E, E), '{"__metadata__":{"k":"\\u0061"},"a":%s,"a":%s}' % (E, E)],
    ids=["plain", "escaped", "escape_elsewhere"],
)
def test_a_repeated_tensor_name_is_refused_by_name(tmp_path, header):
    p = _write(tmp_path, header)
    assert list(load_file(p)) == ["a"]  # safetensors keeps the last silently
    with pytest.raises(CorruptCheckpointError, match="header names tensor 'a' twice") as e:
        _ours(p)
    assert str(p) in str(e.value)
