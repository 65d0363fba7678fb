"""Dequantizing load of a DeepSeek-style FP8 checkpoint (float8_e4m3fn weights, a float32
``weight_scale_inv`` per 128x128 block, ``config.json`` ``quantization_config``) into bfloat16
targets: ``checkpoint.load`` against torch's ``QuantizedHuggingFaceStorageReader`` through
``dcp.load`` on the same files, the same targets, rotating rounds, warm page cache (not collected
by pytest). Both results are checked equal bit for bit before timing.

Goal: ``checkpoint.load`` >= 1.0x torch's quantized reader (ratio = torch's time / ours).

    python tests/bench/fp8_load.py [--mib 512] [--rows 4096] [--pairs 5] [--dir /dev/shm/fqnckpt-fp8]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import warnings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from torch.distributed.checkpoint.quantized_hf_storage import QuantizedHuggingFaceStorageReader  # noqa: E402

import checkpoint  # noqa: E402
from checkpoint.convert.quant import fp8_quantize  # noqa: E402
from checkpoint_bench import gbs, ratio_line, rounds, warm  # noqa: E402


def write_fp8(root: str, mib: int, rows: int) -> dict[str, tuple[int, int]]:
    """About ``mib`` MiB of FP8 weights of ``rows`` x ``rows`` (the last 37 columns narrower: edge blocks), in
    shards of about 256 MiB with an index and config.json. Returns {key: shape}."""
    os.makedirs(root, exist_ok=True)
    count = max(1, (mib << 20) // (rows * rows))
    shapes = {f"layers.{i}.w.weight": (rows, rows - 37 if i == count - 1 else rows) for i in range(count)}
    g = torch.Generator().manual_seed(0)
    weight_map, shard, size, n = {}, {}, 0, 0

    def flush():
        nonlocal shard, size, n
        if shard:
            name = f"model-{n:05d}.safetensors"
            save_file(shard, os.path.join(root, name))
            weight_map.update(dict.fromkeys(shard, name))
            shard, size, n = {}, 0, n + 1

    for k, shape in shapes.items():
        q, s = fp8_quantize(torch.randn(shape, generator=g))
        shard[k], shard[k + "_scale_inv"] = q, s
        size += q.nbytes
        if size >= 256 << 20:
            flush()
    flush()
    with open(os.path.join(root, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    with open(os.path.join(root, "config.json"), "w") as f:
        json.dump({"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}}, f)
    return shapes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mib", type=int, default=512)
    ap.add_argument("--rows", type=int, default=4096)
    ap.add_argument("--pairs", type=int, default=5)
    ap.add_argument("--dir", default="/dev/shm/fqnckpt-fp8")
    a = ap.parse_args()
    try:
        shapes = write_fp8(a.dir, a.mib, a.rows)
        ours = {k: torch.empty(s, dtype=torch.bfloat16) for k, s in shapes.items()}
        theirs = {k: torch.empty(s, dtype=torch.bfloat16) for k, s in shapes.items()}
        warm(ours)
        warm(theirs)

        def fqnckpt():
            checkpoint.load(ours, a.dir)

        def torch_quantized():
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # single process, no process group
                dcp.load(theirs, storage_reader=QuantizedHuggingFaceStorageReader(a.dir, target_dtype=torch.bfloat16),
                         no_dist=True)  # fmt: skip

        fqnckpt()
        torch_quantized()
        assert all(torch.equal(ours[k], theirs[k]) for k in shapes), "results differ"
        t = rounds({"fqnckpt": fqnckpt, "torch": torch_quantized}, a.pairs)
        size = sum(r * c for r, c in shapes.values())
        print(f"FP8 {size / 2**20:.0f} MiB ({len(shapes)} weights, bf16 targets) in {a.dir}, "
              f"{torch.get_num_threads()} torch threads:")  # fmt: skip
        print(f"  checkpoint.load: {gbs(size, t['fqnckpt'])} of FP8")
        print(f"  torch QuantizedHuggingFaceStorageReader: {gbs(size, t['torch'])} of FP8")
        print(ratio_line("checkpoint.load vs torch's quantized reader", t["torch"], t["fqnckpt"], 1.0))
        print(f"  load average {os.getloadavg()}")
    finally:
        shutil.rmtree(a.dir, ignore_errors=True)


if __name__ == "__main__":
    main()
