"""Run the complete Python snippets of README.md and the guides, each in a fresh empty directory.

    python docs/check_snippets.py [FILE.md ...]     # default: README.md and docs/guides/*.md

A complete snippet is a ```` ```python ```` block whose first line is an ``import``; other blocks
are excerpts and are skipped. A snippet that builds a device mesh (``init_device_mesh(``) runs
under ``torchrun --nproc-per-node 2``; the others under ``python``. Prints one line per snippet
and exits 1 when one fails (its output is shown). Takes a few minutes on 2 cores (transformers,
peft and two ranks start several times), so it is not part of the test suite.
"""

from __future__ import annotations

import glob
import os
import re
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BLOCK = re.compile(r"```python\n(.*?)```", re.S)


def snippets(path: str) -> list[tuple[int, str]]:
    """``(line number, code)`` of every complete snippet of the Markdown file ``path``."""
    text = open(path, encoding="utf-8").read()
    out = []
    for m in BLOCK.finditer(text):
        code = m.group(1)
        if code.lstrip().startswith(("import ", "from ")):
            out.append((text.count("\n", 0, m.start()) + 1, code))
    return out


def run(code: str) -> subprocess.CompletedProcess:
    with tempfile.TemporaryDirectory(prefix="fqnckpt-snippet-") as tmp:
        script = os.path.join(tmp, "snippet.py")
        with open(script, "w", encoding="utf-8") as f:
            f.write(code)
        if "init_device_mesh(" in code:
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", script]
        else:
            cmd = [sys.executable, script]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))}
        return subprocess.run(cmd, cwd=tmp, capture_output=True, text=True, timeout=600, env=env)


def main() -> int:
    files = sys.argv[1:] or [os.path.join(ROOT, "README.md"), *sorted(glob.glob(os.path.join(ROOT, "docs", "guides", "*.md")))]
    failed = 0
    for path in files:
        for line, code in snippets(path):
            r = run(code)
            where = f"{os.path.relpath(path, ROOT)}:{line}"
            print(f"{'ok  ' if r.returncode == 0 else 'FAIL'} {where}", flush=True)
            if r.returncode != 0:
                failed += 1
                print(r.stdout[-3000:], r.stderr[-3000:], sep="\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
