"""Start-up cost without a clock (issue 22, item 5): ``import checkpoint`` and ``fqnckpt --version``
/ ``--help`` import no torch, and ``fqnckpt inspect`` of a safetensors file imports neither
torch.distributed.tensor nor transformers. The times are in tests/bench/cli_startup.py."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch
from safetensors.torch import save_file

import checkpoint

HEAVY = ("torch", "torch.distributed", "torch.distributed.tensor", "transformers", "pydantic", "numpy", "safetensors")

PROBE = textwrap.dedent(
    """
    import contextlib, io, json, sys
    heavy = json.loads(sys.argv[2])
    seen = {}
    import checkpoint
    seen["import checkpoint"] = [m for m in heavy if m in sys.modules]
    from checkpoint.cli import main
    for flag in ("--version", "--help"):
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            try:
                main([flag])
            except SystemExit as e:
                assert e.code == 0, e.code
        seen[flag] = [m for m in heavy if m in sys.modules]
        seen[flag + " output"] = out.getvalue()
    with contextlib.redirect_stdout(io.StringIO()):
        seen["inspect rc"] = main(["inspect", sys.argv[1]])
    seen["inspect"] = [m for m in heavy if m in sys.modules]
    print(json.dumps(seen))
    """
)


def test_version_and_help_import_no_torch_and_inspect_no_distributed(tmp_path):
    path = tmp_path / "m.safetensors"
    save_file({"fc.weight": torch.ones(2, 3)}, str(path))
    r = subprocess.run(
        [sys.executable, "-c", PROBE, str(path), json.dumps(HEAVY)], capture_output=True, text=True, timeout=300
    )
    assert r.returncode == 0, r.stderr
    seen = json.loads(r.stdout)
    assert seen["import checkpoint"] == []
    assert seen["--version"] == [] and seen["--help"] == []
    assert seen["--version output"].startswith("fqnckpt ") and "torch" in seen["--version output"]
    for cmd in ("inspect", "migrate", "verify", "diff", "recipes", "demo"):
        assert f"    {cmd} " in seen["--help output"], cmd
    assert seen["inspect rc"] == 0
    assert "torch.distributed.tensor" not in seen["inspect"] and "transformers" not in seen["inspect"]
    assert "torch" in seen["inspect"]  # the probe saw the module it was meant to see


def test_no_public_name_is_also_a_submodule():
    """Importing a submodule binds it on the package: a submodule named like a public function
    (``checkpoint/verify.py`` beside ``checkpoint.verify``) would replace the function for every
    caller once anything imported the module."""
    import pkgutil

    import checkpoint

    subpackages = {m.name for m in pkgutil.iter_modules(checkpoint.__path__)}
    assert subpackages & set(checkpoint.__all__) == set()


def test_lazy_package_names_resolve_to_their_modules():
    import checkpoint.cli.main  # noqa: F401 - the CLI imports the implementing modules itself
    import checkpoint.loading
    import checkpoint.migrating
    import checkpoint.saving

    # Importing the implementing modules never rebinds the public functions.
    assert (checkpoint.load, checkpoint.save, checkpoint.migrate) == (
        checkpoint.loading.load, checkpoint.saving.save, checkpoint.migrating.migrate
    )  # fmt: skip
    assert callable(checkpoint.migrate) and checkpoint.migrate.__module__ == "checkpoint.migrating"
    for name in checkpoint.__all__:
        assert getattr(checkpoint, name).__name__ == name
    assert set(checkpoint.__all__) <= set(dir(checkpoint))
    assert checkpoint.storage.opening.open_checkpoint is checkpoint.open_checkpoint  # submodule fallback (URLs and paths)
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        checkpoint.nope  # noqa: B018
