"""``max_shard_size``: the forms transformers' ``max_shard_size`` takes give the same bytes here
(``transformers.utils.hub.convert_file_size_to_int``); anything else is refused by
:class:`checkpoint.errors.UnsavableError` naming the argument, its value and the checkpoint,
before a byte is written (the directory, an earlier checkpoint in it included, stays as it was)."""

from __future__ import annotations


import pytest

import checkpoint
from checkpoint.errors import UnsavableError, UnsavableTypeError
from checkpoint.storage.format import parse_size
from tests.helpers import tiny_model
from tests.snapshot import dir_snapshot



@pytest.mark.parametrize(
    "size, typed",
    [("abc", False), ("-1GB", False), ("1.5XB", False), ("", False), ("0.5B", False), (0, False),
     (-1, False), (-(2**40), False), (True, True), (False, True), (1.5, True), (b"5GB", True)],
)  # fmt: skip
def test_a_bad_size_is_refused_by_name_before_anything_is_written(tmp_path, size, typed):
    ck = tmp_path / "ck"
    checkpoint.save(tiny_model(), ck)
    before = dir_snapshot(tmp_path, with_mtime=True)
    with pytest.raises(UnsavableError) as e:
        checkpoint.save(tiny_model(seed=1), ck, max_shard_size=size, overwrite=True)
    assert isinstance(e.value, UnsavableTypeError) is typed
    assert e.value.key == "max_shard_size" and e.value.path == str(ck)
    msg = str(e.value)
    assert msg.startswith(f"saving {ck}: 'max_shard_size': ") and repr(size) in msg, msg
    assert dir_snapshot(tmp_path, with_mtime=True) == before
    with pytest.raises(UnsavableError, match="'max_shard_size'"):  # a new directory is not made either
        checkpoint.save(tiny_model(), tmp_path / "new", max_shard_size=size)
    assert not (tmp_path / "new").exists()
    with pytest.raises(UnsavableError, match="'max_shard_size'"):
        checkpoint.async_save(tiny_model(), tmp_path / "new", max_shard_size=size)
    assert not (tmp_path / "new").exists()


@pytest.mark.parametrize(
    "size", [5, 123456, "5GB", "500MB", "20KB", "1GiB", "3MiB", "2KiB", "7gib", "5Gb", "500mb", "20kb", "8Kb"]
)
def test_transformers_sizes_give_the_same_bytes(size):
    from transformers.utils.hub import convert_file_size_to_int

    assert parse_size(size) == convert_file_size_to_int(size)
