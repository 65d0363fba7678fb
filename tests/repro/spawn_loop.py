"""Run test_autoparallel_ranks.py's spawn of one world size over and over until a rank dies by a signal
(a CI crash). Not a test (pytest collects ``test_*.py`` only); run by hand from the repo root::

    PYTHONPATH=$PWD PYTHONMALLOC=debug FQNCKPT_CRASH_DIR=/tmp/crash python tests/repro/spawn_loop.py 2 30

``PYTHONMALLOC=debug`` (set before the forkserver starts, so every rank has it) puts Python's small
objects on glibc's heap, where glibc checks its free lists: rank 0 of the 2-rank spawn
aborted with "malloc(): unaligned fastbin chunk detected" in the 2nd run, then in none of the
next ~78 (48 of them with ``MALLOC_PERTURB_=165``); the launcher keeps the killed rank's faulthandler stack (every thread) in ``FQNCKPT_CRASH_DIR``
and prints it with every thread's native stack.
"""

from __future__ import annotations

import sys
import tempfile
import time

from checkpoint.ranks.launch import RankFailedError, preload, run_ranks


def main() -> int:
    import tests.test_autoparallel_ranks as T

    preload("transformers", "tests.test_autoparallel_ranks")
    world, n = int(sys.argv[1]), int(sys.argv[2])
    runs, hf = T.WORLDS[world]
    for i in range(n):
        t = time.time()
        try:
            run_ranks(T._ranks_main, world, runs, hf, tempfile.mkdtemp(prefix="spawn-loop"), backend="gloo", timeout=600)
        except RankFailedError as e:
            print(f"run {i}: FAILED signals={e.signals} stacks={e.stacks}\n{e}", flush=True)
            return 1
        print(f"run {i}: ok {time.time() - t:.0f}s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
