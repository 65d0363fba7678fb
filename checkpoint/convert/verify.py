"""Checks a planned conversion makes on itself before anything is written: the dimensions against
the tensors, and each side file it writes (``params.json``, ``config.json``,
``generation_config.json``) re-read by the reader of its format and compared with the tensors and
dims it describes. Every check made is listed in ``conversion_report.json`` (``checks``); a
failing one is a :class:`~checkpoint.convert.report.Problem` and the conversion stops.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from .catalog import HF_CONFIG_NAME, PARAMS_NAME, parse_hf_config, parse_params, hf_dims, meta_ffn_dim, params_dims
from .dims import shape_dims, tensor_problems
from .report import Problem

GENERATION_CONFIG_NAME = "generation_config.json"


def hf_side_shapes(plan) -> dict[str, tuple[int, ...]]:
    """Shapes of the Hugging Face-named side of the plan: its targets when it writes HF, else its
    source (one file: HF checkpoints are not model-parallel shards)."""
    if plan.recipe.writes in ("hf", "hf-model"):
        return {s.fqn: tuple(s.shape) for s in plan.specs}
    if plan.recipe.reads in ("hf", "hf-model") and plan.catalog.shards == 1:
        return {k: tuple(plan.catalog.specs(k)[0].shape) for k in plan.catalog.keys()}
    return {}


def _against(stated: Mapping[str, int], want: Mapping[str, int], what: str, by: str) -> list[str]:
    return [f"{what} gives {k}={v}, {by} {want[k]}" for k, v in stated.items() if k in want and want[k] != v]


def dims_problems(plan, sources: Mapping[str, Mapping[str, int]]) -> list[Problem]:
    """The tensors against the dims: embedding width / rows against ``dim`` / ``vocab_size`` (each
    source that states them named), Q / K / V rows against heads x head_dim."""
    shapes = hf_side_shapes(plan)
    seen = shape_dims(shapes)
    bad = []
    for name, stated in sources.items():
        bad += _against(stated, seen, name, "the tensors have")
    if "qk_rope_head_dim" not in plan.dims:  # DeepSeek-V3 MLA: q rows are heads x (nope + rope)
        bad += tensor_problems(shapes, plan.dims)
    plan.report.checks.append(f"dims {sorted(plan.dims)} from {sorted(sources) or ['(none)']} agree with each other"
                              + (f" and with the tensors ({sorted(seen)}, attention rows)" if shapes else ""))  # fmt: skip
    return [Problem(kind="dims", keys=[], message=m) for m in bad]


def _gate_rows(shapes: Mapping[str, tuple[int, ...]]) -> int | None:
    s = shapes.get("model.layers.0.mlp.gate_proj.weight")
    return int(s[0]) if s is not None else None


def check_params_json(data: bytes, plan) -> list[str]:
    """``params.json`` as written, read back by :class:`~checkpoint.convert.catalog.MetaParams`
    (the reader ``meta-llama-to-hf`` uses): its dims equal the plan's, its ``dim`` / ``vocab_size``
    the tensors', its ``multiple_of`` / ``ffn_dim_multiplier`` give the MLP rows."""
    try:
        params = parse_params(data, PARAMS_NAME)
    except Exception as e:  # noqa: BLE001 - the reader's refusal is the finding
        return [f"{PARAMS_NAME} as written is refused by its reader: {e}"]
    shapes = hf_side_shapes(plan)
    got = params_dims(params)
    bad = _against(got, plan.dims, PARAMS_NAME, "the conversion used")
    bad += _against(got, shape_dims(shapes), PARAMS_NAME, "the tensors have")
    rows = _gate_rows(shapes)
    if params.multiple_of is not None and rows is not None:
        ffn = meta_ffn_dim(params.dim, params.multiple_of, params.ffn_dim_multiplier)
        if ffn != rows:
            bad.append(f"{PARAMS_NAME}'s multiple_of / ffn_dim_multiplier give an MLP of {ffn} rows, the tensors have {rows}")
    return bad


def _transformers_reads(data: dict[str, Any]) -> dict[str, int] | str:
    """The dims as the installed transformers reads ``config.json`` (its own config class), or why
    it cannot; {} without transformers."""
    try:
        import transformers
    except ImportError:
        return {}
    try:
        cfg = transformers.AutoConfig.for_model(**{k: v for k, v in data.items() if k != "auto_map"})
    except Exception as e:  # noqa: BLE001 - transformers' refusal is the finding
        return f"{type(e).__name__}: {e}"
    text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    out = {}
    for ours, theirs in (("n_heads", "num_attention_heads"), ("n_kv_heads", "num_key_value_heads"), ("dim", "hidden_size"),
                         ("n_layers", "num_hidden_layers"), ("vocab_size", "vocab_size")):  # fmt: skip
        v = getattr(text, theirs, None)
        if isinstance(v, int) and not isinstance(v, bool):
            out[ours] = v
    return out


def check_hf_config(data: bytes, plan) -> list[str]:
    """``config.json`` as written, read back by fqnckpt's reader and by the installed transformers:
    dims equal the plan's and the tensors' (hidden size, vocab, heads, layers, MLP rows)."""
    try:
        cfg = parse_hf_config(data, HF_CONFIG_NAME)
    except Exception as e:  # noqa: BLE001
        return [f"{HF_CONFIG_NAME} as written is refused by its reader: {e}"]
    shapes = hf_side_shapes(plan)
    got = {k: v for k, v in hf_dims(cfg).items() if k not in ("rope_interleave", "qk_rope_head_dim")}
    bad = _against(got, plan.dims, HF_CONFIG_NAME, "the conversion used")
    bad += _against(got, shape_dims(shapes), HF_CONFIG_NAME, "the tensors have")
    theirs = _transformers_reads(cfg.whole)
    if isinstance(theirs, str):
        bad.append(f"transformers cannot read the {HF_CONFIG_NAME} written: {theirs}")
    else:
        bad += _against(theirs, got, f"{HF_CONFIG_NAME} as transformers reads it", "as written")
    rows = _gate_rows(shapes)
    if cfg.intermediate_size and rows is not None and cfg.intermediate_size != rows:
        bad.append(f"{HF_CONFIG_NAME} gives intermediate_size={cfg.intermediate_size}, the tensors have {rows} MLP rows")
    return bad


def check_generation_config(data: bytes) -> list[str]:
    """``generation_config.json`` read back: a JSON object (transformers' ``GenerationConfig``
    accepts it when installed)."""
    try:
        parsed = json.loads(data)
        if not isinstance(parsed, dict):
            return [f"{GENERATION_CONFIG_NAME} is not a JSON object"]
    except ValueError as e:
        return [f"{GENERATION_CONFIG_NAME} is not JSON: {e}"]
    try:
        from transformers import GenerationConfig
    except ImportError:
        return []
    try:
        GenerationConfig.from_dict(parsed)
    except Exception as e:  # noqa: BLE001
        return [f"transformers cannot read the {GENERATION_CONFIG_NAME} written: {type(e).__name__}: {e}"]
    return []


class PlannedCatalog:
    """A plan's targets seen as a source: their specs as meta tensors, no byte read or written
    (what :func:`inverse_problems` plans the inverse recipe over). Meta targets of several
    model-parallel shards are seen as that many shards again."""

    format = "planned"
    params = None
    hf_config = None

    def __init__(self, plan):
        from ..sources.base import SourceSpec
        from .meta_files import split_shard_target

        n = plan.out_shards
        self.shards = n
        self.path = "(the planned output)"
        self._specs: dict[str, list] = {}
        for s in plan.specs:
            shard, key = split_shard_target(s.fqn) if n > 1 else (0, s.fqn)
            self._specs.setdefault(key, [None] * n)[shard] = SourceSpec(key, tuple(s.shape), s.dtype)

    def keys(self) -> list[str]:
        return list(self._specs)

    def specs(self, key: str) -> list:
        return self._specs[key]

    def get(self, key: str, shard: int = 0):
        import torch

        s = self._specs[key][shard]
        return torch.empty(s.shape, dtype=s.dtype, device="meta")

    def nbytes(self, key: str) -> int:
        return sum(s.nbytes for s in self._specs[key])

    def close(self) -> None:
        pass


def inverse_problems(plan) -> list[Problem]:
    """The inverse recipe planned over the planned output (names, shapes, dtypes, the same dims)
    must give back exactly the source's keys (less those the recipe drops as not weights), each
    with its shape and dtype, shard by shard."""
    from .meta_files import shard_target
    from .plan import plan_conversion
    from .report import ConversionError

    inv = plan.recipe.inverse()
    try:
        back = plan_conversion(PlannedCatalog(plan), inv, plan.dims, source="(the planned output)")
    except (ConversionError, ValueError) as e:
        why = e.report.summary() if isinstance(e, ConversionError) else str(e)
        return [Problem(kind="inverse", keys=[], message=f"{inv.name} does not apply to the planned output: {why}")]
    cat = plan.catalog
    dropped = set(plan.report.dropped)
    want: dict[str, tuple] = {}
    for k in cat.keys():
        if k in dropped:
            continue
        for i, s in enumerate(cat.specs(k)):
            want[shard_target(i, k) if cat.shards > 1 else k] = (tuple(s.shape), str(s.dtype))
    got = {s.fqn: (tuple(s.shape), str(s.dtype)) for s in back.specs}
    copies = {t for a in plan.aliases for t in back.report.mapping.get(a, [])} - set(want)
    got = {k: v for k, v in got.items() if k not in copies}  # a tied copy the forward filled goes back to nothing
    bad = [f"{k}: source {want[k]}, inverse gives {got.get(k, 'nothing')}" for k in sorted(want) if got.get(k) != want[k]]
    bad += [f"{k}: inverse gives {got[k]}, not in the source" for k in sorted(set(got) - set(want))]
    plan.report.checks.append(f"the inverse recipe {inv.name} applied to the planned output gives back the source's "
                              f"{len(want)} tensors (names, shapes, dtypes)")  # fmt: skip
    return [Problem(kind="inverse", keys=[], message=m) for m in bad[:10]]


def side_round_trip_problems(files: Mapping[str, bytes], plan) -> list[Problem]:
    """Side files by the inverse: the ``params.json`` a Meta -> HF conversion's ``config.json``
    gives back must hold every key of the source's params.json with its value; the
    ``config.json`` an HF -> Meta conversion's ``params.json`` gives back must say what the
    source's config said (sizes, heads, layers, norm eps, vocab, RoPE theta and scaling)."""
    from .catalog import HFTextConfig, write_params_json
    from .hf_files import llama_config_from_meta

    bad = []
    cat = plan.catalog
    if cat.params is not None and HF_CONFIG_NAME in files:
        src = json.loads(cat.params.model_dump_json(exclude_none=True))
        back = json.loads(write_params_json(plan.dims, HFTextConfig.of(json.loads(files[HF_CONFIG_NAME]))))
        bad += [f"{PARAMS_NAME} {k}: source {v!r}, written {HF_CONFIG_NAME} gives back {back.get(k)!r}" for k, v in src.items() if back.get(k) != v]
        plan.report.checks.append(f"{HF_CONFIG_NAME} as written gives back every key of the source's {PARAMS_NAME}")
    src_cfg = cat.hf_config if cat.hf_config is not None else None
    if PARAMS_NAME in files and src_cfg is not None:
        from .catalog import hf_config_of

        src_cfg = hf_config_of(plan.model) or src_cfg
        shapes = hf_side_shapes(plan)
        emb, rows = shapes.get("model.embed_tokens.weight"), _gate_rows(shapes)
        if emb is not None and rows is not None:
            params = json.loads(files[PARAMS_NAME])
            back = HFTextConfig.of(json.loads(llama_config_from_meta(params, rows, emb[0], "float32")))
            for f in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "num_hidden_layers",
                      "rms_norm_eps", "vocab_size"):  # fmt: skip
                want = getattr(src_cfg, f)
                if want is not None and getattr(back, f) != want:
                    bad.append(f"{HF_CONFIG_NAME} {f}: source {want!r}, written {PARAMS_NAME} gives back {getattr(back, f)!r}")
            if _rope(back) != _rope(src_cfg):
                bad.append(f"{HF_CONFIG_NAME} RoPE: source {_rope(src_cfg)}, written {PARAMS_NAME} gives back {_rope(back)}")
            plan.report.checks.append(f"{PARAMS_NAME} as written gives back the source {HF_CONFIG_NAME}'s sizes, norm eps and RoPE")
    return [Problem(kind="side-file", keys=[], message=m) for m in bad]


def _rope(cfg) -> dict[str, Any]:
    """RoPE as transformers 5 reads it (``rope_parameters``, else 4.x's ``rope_scaling`` +
    ``rope_theta``): theta, type, and the llama3 factors."""
    p = dict(cfg.rope_parameters or {})
    if not p:
        p = dict(cfg.rope_scaling or {}) | {"rope_theta": cfg.rope_theta if cfg.rope_theta is not None else 10000.0}
    kind = p.get("rope_type") or p.get("type") or "default"
    out = {"rope_theta": float(p.get("rope_theta") or 10000.0), "rope_type": kind}
    if kind == "llama3":
        out |= {k: float(p[k]) for k in ("factor", "low_freq_factor", "high_freq_factor") if k in p}
    return out


_READERS = {PARAMS_NAME: check_params_json, HF_CONFIG_NAME: check_hf_config}


def side_file_problems(files: Mapping[str, bytes], plan) -> list[Problem]:
    """Every side file re-read by its format's reader and compared (see the functions above)."""
    out = []
    for name, data in files.items():
        if name in _READERS:
            bad = _READERS[name](data, plan)
        elif name == GENERATION_CONFIG_NAME:
            bad = check_generation_config(data)
        else:
            continue
        plan.report.checks.append(f"{name} re-read by its reader and compared with the tensors and dims")
        out += [Problem(kind="side-file", keys=[name], message=m) for m in bad]
    return out + side_round_trip_problems(files, plan)


__all__ = ["inverse_problems", "PlannedCatalog", "dims_problems", "side_file_problems", "hf_side_shapes", "GENERATION_CONFIG_NAME"]
