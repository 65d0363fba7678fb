"""Capture cost (seconds) of autoparallel's strict dynamo capture vs a plain torch.compile, same run.

Run: ``python tests/bench/capture_cost.py``. Every measurement is the first call on a fresh
TinyTransformer after ``torch._dynamo.reset()``; the ratio is capture / reference.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from autoparallel import MixedPrecisionPolicy, capture  # noqa: E402
from tests.models import TinyConfig, TinyTransformer  # noqa: E402


def _timed(fn) -> float:
    torch._dynamo.reset()
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def main(repeats: int = 3) -> None:
    cfg = TinyConfig()
    tokens = torch.randint(0, cfg.vocab, (4, cfg.seq))
    bf16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16)

    def real():
        m = TinyTransformer(cfg)
        m.init_weights()
        return m

    def on_meta():
        with torch.device("meta"):
            return TinyTransformer(cfg)

    cases = {
        "autoparallel capture (fp32)": lambda: capture(real(), (tokens,)),
        "autoparallel capture (bf16 casts)": lambda: capture(real(), (tokens,), mp_policy=bf16),
        "autoparallel capture (meta model)": lambda: capture(on_meta(), (tokens,)),
        "torch.compile backend=eager (dynamo only)": lambda: torch.compile(real(), backend="eager")(tokens),
        "torch.compile default (inductor)": lambda: torch.compile(real())(tokens),
    }
    _timed(cases["autoparallel capture (fp32)"])  # warm imports once
    best = {name: min(_timed(fn) for _ in range(repeats)) for name, fn in cases.items()}
    ref = best["torch.compile default (inductor)"]
    ref_dynamo = best["torch.compile backend=eager (dynamo only)"]
    for name, sec in best.items():
        print(
            f"{name:45s} {sec:7.2f} s   x{sec / ref:5.2f} vs inductor   x{sec / ref_dynamo:5.2f} vs dynamo-only"
        )


if __name__ == "__main__":
    main()
