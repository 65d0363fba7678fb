"""``max_shard_size`` edge cases: the signed and underscored numbers transformers' own
``convert_file_size_to_int`` takes (``int()`` of the digits) give the same bytes; array-like
values that are not one integer (a float tensor, a 1-element list-like array, a bool tensor) are
refused as :class:`UnsavableTypeError`, not a bare ``TypeError``, with nothing written; async_save
and the DCP StorageWriter name the checkpoint in the refusal as save does."""

from __future__ import annotations


import numpy as np
import pytest
import torch

import checkpoint
from checkpoint.errors import UnsavableError, UnsavableTypeError
from checkpoint.storage.format import parse_size
from tests.helpers import tiny_model
from tests.snapshot import dir_snapshot



@pytest.mark.parametrize("size", ["+5GB", "+5gb", "+20KiB", "5_0MB", "1_000kb", "+1_0 GiB", " +5MB"])
def test_signed_and_underscored_sizes_match_transformers(size):
    from transformers.utils.hub import convert_file_size_to_int

    assert parse_size(size) == convert_file_size_to_int(size)


@pytest.mark.parametrize("size", ["5__0MB", "_5MB", "5_MB", "++5MB", "+-5MB", "+ 5MB", "5._5MB"])
def test_malformed_signs_and_underscores_are_refused(size):
    with pytest.raises(UnsavableError, match="'max_shard_size'"):
        parse_size(size)


@pytest.mark.parametrize(
    "size",
    [torch.tensor(5.0), torch.tensor([5, 6]), torch.tensor(True), np.array([5]), np.array(True)],
    ids=["float_tensor", "two_elem_tensor", "bool_tensor", "1d_array", "bool_array"],
)
def test_a_non_integer_array_size_is_refused_by_type_before_anything_is_written(tmp_path, size):
    ck = tmp_path / "ck"
    checkpoint.save(tiny_model(), ck)
    before = dir_snapshot(tmp_path, with_mtime=True)
    with pytest.raises(UnsavableTypeError) as e:
        checkpoint.save(tiny_model(seed=1), ck, max_shard_size=size, overwrite=True)
    assert e.value.key == "max_shard_size" and e.value.path == str(ck)
    assert dir_snapshot(tmp_path, with_mtime=True) == before


def test_async_save_and_dcp_writer_name_the_checkpoint(tmp_path):
    from checkpoint.dcp import StorageWriter

    before = dir_snapshot(tmp_path, with_mtime=True)
    for call in (
        lambda p: checkpoint.async_save(tiny_model(), p, max_shard_size="1.5XB"),
        lambda p: StorageWriter(p, max_shard_size="1.5XB"),
    ):
        target = tmp_path / "new"
        with pytest.raises(UnsavableError) as e:
            call(target)
        assert e.value.key == "max_shard_size" and e.value.path == str(target), str(e.value)
        assert str(e.value).startswith(f"saving {target}: 'max_shard_size': '1.5XB'")
        assert dir_snapshot(tmp_path, with_mtime=True) == before and not target.exists()
