"""``fqnckpt ... | head``: the reader closing stdout early ends the command quietly with
141 (128 + SIGPIPE, as shell tools), never a BrokenPipeError traceback or error line."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import checkpoint

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("args", [["inspect", "--keys"], ["inspect", "--keys", "--json"]])
def test_closed_stdout_ends_quietly(tmp_path, args):
    checkpoint.save({f"layers.{i}.weight": torch.zeros(2) for i in range(4000)}, tmp_path / "ck")  # >64 KiB listed
    code = f"import sys; from checkpoint.cli import main; sys.exit(main({[*args, str(tmp_path / 'ck')]!r}))"
    env = {**os.environ, "PYTHONPATH": ROOT}
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    first = proc.stdout.readline()
    proc.stdout.close()  # what head does after its lines
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 141, err
    assert first and "BrokenPipe" not in err and "Traceback" not in err and "error" not in err, err
