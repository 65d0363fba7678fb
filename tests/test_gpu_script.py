"""tests/gpu/run.sh and its helper on a machine without CUDA: the script says so and
exits 0; the helper's checkpoint checks run on one CPU rank (gloo) through the same code the GPU
run uses, so the script stays runnable where a GPU is lent."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests", "gpu"))

import checks  # noqa: E402


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA machine runs the checks themselves")
def test_run_sh_without_cuda_says_so_and_exits_0():
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    p = subprocess.run(["bash", os.path.join(ROOT, "tests", "gpu", "run.sh")], env=env, capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    assert "no CUDA device visible" in p.stdout and "GPU checks skipped" in p.stdout
    assert checks.main(["--device", "cuda"]) == 0  # the helper alone says the same


def test_checks_cpu_side_pass_on_one_cpu_rank(tmp_path, capsys):
    assert checks.main(["--device", "cpu", "--world", "1", "--mib", "1", "--rounds", "1", "--only", "checkpoint",
                        "--dir", str(tmp_path)]) == 0  # fmt: skip
    out = capsys.readouterr().out
    for check in ("OK save from cpu DTensors + verify", "OK load into cpu DTensors", "OK async_save from cpu",
                  "INFO load into cpu DTensors", "all checks OK"):  # fmt: skip
        assert check in out, out
    assert "FAIL" not in out
