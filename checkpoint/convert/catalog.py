"""What a conversion reads: one source, or Meta's model-parallel ``consolidated.NN.pth`` shards
seen as one (every key in every shard), and the model dimensions the ops need (``params.json``
beside the source, or the target model's config).

Meta layout: transformers ``convert_llama_weights_to_hf.py`` (shards ``consolidated.00.pth``,
``consolidated.01.pth``, ... and ``params.json`` with ``dim``, ``n_layers``, ``n_heads``,
``n_kv_heads``, ``norm_eps``, ``rope_theta``).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable, Mapping
from pathlib import Path, PurePosixPath
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, PositiveFloat, PositiveInt, PrivateAttr, ValidationError

from .report import CONVERSION_REPORT_NAME, ForwardRecord
from ..errors import AmbiguousSourceError, CorruptCheckpointError, external_errors
from ..sources import Source, SourceSpec, open_source
from ..storage.location import local_path, options_for, resolve

PARAMS_NAME = "params.json"
HF_CONFIG_NAME = "config.json"
PARAMS_DIMS = ("dim", "n_layers", "n_heads", "n_kv_heads")  # what params.json needs
_SHARD = re.compile(r"^consolidated\.(\d+)\.pth$")


class MetaParams(BaseModel):
    """Meta's ``params.json`` (fields fqnckpt uses; others are kept). ``multiple_of`` and
    ``ffn_dim_multiplier`` give the MLP width as Meta's ``FeedForward`` computes it."""

    model_config = ConfigDict(extra="allow")

    dim: PositiveInt
    n_layers: PositiveInt
    n_heads: PositiveInt
    n_kv_heads: PositiveInt | None = None
    vocab_size: int | None = None
    norm_eps: float | None = None
    rope_theta: float | None = None
    multiple_of: PositiveInt | None = None
    ffn_dim_multiplier: float | None = None
    use_scaled_rope: bool | None = None  # Llama 3.1's RoPE scaling (config.json from params.json)
    rope_scaling_factor: PositiveFloat | None = None


class HFTextConfig(BaseModel):
    """The fields of a transformers ``config.json`` (its ``text_config`` for a multimodal model)
    that give a conversion its dims and Meta's ``params.json``; others are kept."""

    model_config = ConfigDict(extra="allow")

    num_attention_heads: int | None = None
    num_key_value_heads: int | None = None
    hidden_size: int | None = None
    head_dim: int | None = None
    num_hidden_layers: int | None = None
    intermediate_size: int | None = None
    vocab_size: int | None = None
    rms_norm_eps: float | None = None
    rope_theta: float | None = None
    rope_parameters: dict[str, Any] | None = None
    rope_scaling: dict[str, Any] | None = None  # transformers 4.x's spelling of rope_parameters' scaling
    max_position_embeddings: int | None = None
    tie_word_embeddings: bool | None = None
    fqnckpt_meta_params: dict[str, Any] | None = None  # hf_files.META_PARAMS_KEY: Meta fields kept for the way back
    qk_rope_head_dim: int | None = None  # DeepSeek-V3 MLA
    rope_interleave: bool | None = None
    _whole: dict[str, Any] = PrivateAttr(default_factory=dict)  # the whole file (model_type, ...)

    @classmethod
    def of(cls, data: Mapping[str, Any]) -> HFTextConfig:
        text = data.get("text_config")
        out = cls.model_validate(text if isinstance(text, Mapping) else data)
        out._whole = dict(data)
        return out

    @property
    def whole(self) -> dict[str, Any]:
        """The whole ``config.json`` (not only its text part)."""
        return dict(self._whole)


class Catalog:
    """Source keys with one :class:`SourceSpec` per shard; ``get(key, shard)`` reads one.

    Raises (from :func:`open_catalog`):
        CorruptCheckpointError: shards with different keys or dtypes (the file is named).
    """

    def __init__(self, path: Path | PurePosixPath, sources: list[Source], params: MetaParams | None, hf_config: HFTextConfig | None = None,
                 record: ForwardRecord | None = None):  # fmt: skip
        self.path = path
        self.sources = sources
        self.params = params
        self.hf_config = hf_config
        self.record = record  # the conversion_report.json of the conversion that wrote the source, if any
        self.on_close: list = []  # cleanups (a remote source's local copies)
        first = sources[0]
        self._keys = first.keys()
        for s in sources[1:]:
            if s.keys() != self._keys:
                extra = sorted(set(s.keys()) ^ set(self._keys))[:5]
                raise CorruptCheckpointError(str(s.path), f"shard keys differ from {first.path.name}'s: {extra}")
            for k in self._keys:
                if s.spec(k).dtype != first.spec(k).dtype:
                    raise CorruptCheckpointError(str(s.path), f"{k!r} has dtype {s.spec(k).dtype}, not {first.spec(k).dtype}")

    @property
    def format(self) -> str:
        return self.sources[0].format

    @property
    def shards(self) -> int:
        return len(self.sources)

    def keys(self) -> list[str]:
        return list(self._keys)

    def specs(self, key: str) -> list[SourceSpec]:
        return [s.spec(key) for s in self.sources]

    def get(self, key: str, shard: int = 0) -> torch.Tensor:
        return self.sources[shard].get(key)

    def get_slice(self, key: str, slices, shard: int = 0) -> torch.Tensor:
        """Block ``tensor[slices]`` of ``key`` in one shard (only its bytes where the format allows)."""
        return self.sources[shard].get_slice(key, slices)

    def nbytes(self, key: str) -> int:
        return sum(s.nbytes(key) for s in self.sources)

    def close(self) -> None:
        for s in self.sources:
            s.close()
        while self.on_close:
            self.on_close.pop()()


def _beside(p: Path, name: str) -> Path:
    return p / name if p.is_dir() else p.parent / name


def parse_params(data: bytes, where: str) -> MetaParams:
    try:
        return MetaParams.model_validate_json(data)
    except ValidationError as e:
        err = e.errors()[0]
        raise CorruptCheckpointError(where, f"not a Meta params.json: {'.'.join(map(str, err['loc']))}: {err['msg']}") from None


def parse_hf_config(data: bytes, where: str) -> HFTextConfig:
    try:
        parsed = json.loads(data)
        if not isinstance(parsed, dict):
            raise ValueError("not a JSON object")
        return HFTextConfig.of(parsed)
    except (ValueError, ValidationError) as e:
        raise CorruptCheckpointError(where, f"not a transformers config.json: {str(e).splitlines()[0]}") from None


def _parse_record(data: bytes, where: str) -> ForwardRecord:
    try:
        return ForwardRecord.model_validate_json(data)
    except ValidationError as e:
        err = e.errors()[0]
        raise CorruptCheckpointError(where, f"not a conversion_report.json: {'.'.join(map(str, err['loc']))}: {err['msg']}") from None


def _record(read) -> ForwardRecord | None:
    """``conversion_report.json`` beside the source (written by the conversion that made it)."""
    data, where = read(CONVERSION_REPORT_NAME)
    return _parse_record(data, where) if data is not None else None


def _side_configs(read) -> tuple[MetaParams | None, HFTextConfig | None]:
    """``params.json`` (Meta) or else ``config.json`` (transformers) beside the source;
    ``read(name) -> (bytes | None, where)``."""
    data, where = read(PARAMS_NAME)
    if data is not None:
        return parse_params(data, where), None
    data, where = read(HF_CONFIG_NAME)
    return None, (parse_hf_config(data, where) if data is not None else None)


def _local_file(p: Path):
    def read(name: str) -> tuple[bytes | None, str]:
        f = _beside(p, name)
        return (f.read_bytes() if f.is_file() else None), str(f)

    return read


def _remote_meta_shards(store, view) -> list[str]:
    """Meta's ``consolidated.NN.pth`` shards of the checkpoint on ``store`` when it has no model
    index: the ones its record names (:data:`checkpoint.storage.commit.RECORD`, written last by
    :func:`~checkpoint.convert.meta_files.write_meta_checkpoint`), else, written by another tool,
    the ones listed. [] for any other layout.

    Raises:
        CorruptCheckpointError: a record that does not parse."""
    from ..storage.commit import RECORD, ObjectRecord

    if view.index_raw is not None:
        return []
    raw = store.get(RECORD)
    if raw is not None:
        try:
            names = ObjectRecord.model_validate_json(raw).objects
        except ValidationError as e:
            raise CorruptCheckpointError(store.url_of(RECORD), f"not fqnckpt's record: {str(e).splitlines()[0]}") from None
    else:
        names = list(store.listing())
    return sorted(n for n in names if _SHARD.match(n))


def _open_downloaded(store, shards: list[str], params, hf_config, record, key, trusted_globals) -> Catalog:
    """Meta's shards on object storage, each copied into a private temporary directory in ranged
    pieces (``torch.load`` reads a seekable local file), then read as local ones are; the copies
    are removed when the catalog closes (or when opening fails). Each piece is read as a load
    reads a shard (:func:`checkpoint.storage.remote_reader.pinned_range`): on S3 the first GET
    of a shard pins its version, so a shard overwritten or removed between two pieces is refused
    (:class:`~checkpoint.storage.objstore.ObjectChangedError` naming it), never copied mixed."""
    import shutil
    import tempfile

    from ..storage.remote_reader import new_pins, pinned_range, pinned_size

    tmp = tempfile.mkdtemp(prefix=".fqnckpt-remote-meta-")
    opened: list[Source] = []
    pins = new_pins(store)
    try:
        sizes = {n: size for n, (_, size) in store.listing().items() if n in shards}
        for name in shards:
            if name not in sizes:
                raise CorruptCheckpointError(store.url_of(name), "named by the checkpoint's record but not on the store")
            local = os.path.join(tmp, name)
            with external_errors(store.url_of(name), what="reading"), open(local, "wb") as f:
                # The size of the version the reads are pinned to (replaced since the listing: the
                # listed size would cut the copy short or read past its end).
                size = pinned_size(store, name, sizes[name], pins)
                for start in range(0, size, _CHUNK):
                    f.write(pinned_range(store, name, start, min(start + _CHUNK, size), pins))
            with external_errors(store.url_of(name), what="reading"):
                opened.append(open_source(local, key=key, trusted_globals=trusted_globals))
        cat = Catalog(PurePosixPath(store.url), opened, params, hf_config, record)
    except BaseException:
        for s in opened:
            s.close()
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    cat.on_close.append(lambda: shutil.rmtree(tmp, ignore_errors=True))
    return cat


_CHUNK = 64 << 20  # bytes per ranged read of a remote Meta shard


def _open_remote(url: Any, storage_options: Mapping | None, key: str | None, trusted_globals: Iterable[Any] = ()) -> Catalog:
    """A checkpoint on object storage: Meta's shards (:func:`_remote_meta_shards`) copied and read
    as local ones, else its model part through the remote source stage
    (:func:`checkpoint.sources.open_source`, the same checks as any remote read); and
    ``params.json`` / ``config.json`` from the same committed view."""
    from ..storage.views import checkpoint_view

    store = resolve(url, storage_options)
    with checkpoint_view(store) as view:
        shards = _remote_meta_shards(store, view)
        if shards:
            read = lambda n: (view.member_bytes(n), store.url_of(n))  # noqa: E731
            params, hf_config = _side_configs(read)
            return _open_downloaded(store, shards, params, hf_config, _record(read), key, trusted_globals)
        if key is not None:
            raise AmbiguousSourceError(str(url), [], f"key={key!r} applies to pickles and DCP only")
        src = open_source(store)
        try:
            read = lambda n: (view.member_bytes(n), store.url_of(n))  # noqa: E731
            params, hf_config = _side_configs(read)
            record = _record(read)
        except BaseException:
            src.close()
            raise
    return Catalog(PurePosixPath(store.url), [src], params, hf_config, record)


def open_catalog(path: Any, *, trusted_globals: Iterable[Any] = (), key: str | None = None,
                 storage_options: Mapping | None = None) -> Catalog:  # fmt: skip
    """Open ``path``: a directory of ``consolidated.NN.pth`` shards (numbered 0..n-1, no gap), or
    any single source :func:`checkpoint.sources.open_source` reads; a URL (``s3://...``, or a
    resolved object store) through the remote source stage (fqnckpt / Hugging Face safetensors;
    ``storage_options`` go to its filesystem).

    Raises:
        CorruptCheckpointError: shard numbers with a gap, shards that disagree, a bad params.json.
        and whatever :func:`open_source` raises for each file.
    """
    where = resolve(path, options_for(path, storage_options))
    if local_path(where) is None:  # a byte store: read through the remote source stage
        return _open_remote(where, None, key, trusted_globals)
    p = Path(path)
    params, hf_config = _side_configs(_local_file(p))
    record = _record(_local_file(p)) if p.is_dir() else None  # a conversion writes a directory
    shard_files = sorted((int(m.group(1)), f) for f in p.iterdir() if (m := _SHARD.match(f.name))) if p.is_dir() else []
    opened: list[Source] = []
    try:
        if len(shard_files) > 1:
            if [n for n, _ in shard_files] != list(range(len(shard_files))):
                raise CorruptCheckpointError(str(p), f"consolidated shards are not numbered 0..n-1: {[f.name for _, f in shard_files]}")
            for _, f in shard_files:
                with external_errors(str(f), what="reading"):
                    opened.append(open_source(f, key=key, trusted_globals=trusted_globals))
        else:
            with external_errors(os.fspath(p), what="reading"):
                opened.append(open_source(p, key=key, trusted_globals=trusted_globals))
        return Catalog(p, opened, params, hf_config, record)
    except BaseException:
        for s in opened:
            s.close()
        raise


def hf_config_of(model: Any) -> HFTextConfig | None:
    """The :class:`HFTextConfig` of a ``PreTrainedModel`` (its text config); None without one."""
    cfg = getattr(model, "config", None)
    if cfg is None or not hasattr(cfg, "to_dict"):
        return None
    if hasattr(cfg, "get_text_config"):
        cfg = cfg.get_text_config()
    # getattr follows the config's attribute_map (GPT-2's n_head is num_attention_heads)
    return HFTextConfig.model_validate({f: getattr(cfg, f, None) for f in HFTextConfig.model_fields})


def hf_dims(cfg: HFTextConfig | None) -> dict[str, int]:
    """``n_heads`` / ``n_kv_heads`` / ``dim`` / ``head_dim`` / ``n_layers`` (and DeepSeek-V3's
    ``qk_rope_head_dim`` / ``rope_interleave`` as 0 or 1) from a transformers config."""
    if cfg is None:
        return {}
    out: dict[str, int] = {}
    for ours, theirs in (("n_heads", "num_attention_heads"), ("n_kv_heads", "num_key_value_heads"),
                         ("dim", "hidden_size"), ("head_dim", "head_dim"), ("n_layers", "num_hidden_layers"),
                         ("qk_rope_head_dim", "qk_rope_head_dim"), ("rope_interleave", "rope_interleave"),
                         ("vocab_size", "vocab_size")):  # fmt: skip
        v = getattr(cfg, theirs)
        if isinstance(v, bool):
            out[ours] = int(v)
        elif isinstance(v, int):
            out[ours] = v
    if "n_heads" in out:
        out.setdefault("n_kv_heads", out["n_heads"])
    return out


def model_dims(model: Any) -> dict[str, int]:
    """:func:`hf_dims` of a ``PreTrainedModel``'s text config ({} for another module)."""
    return hf_dims(hf_config_of(model))


def params_dims(params: MetaParams | None) -> dict[str, int]:
    if params is None:
        return {}
    out = {"n_heads": params.n_heads, "n_kv_heads": params.n_kv_heads or params.n_heads, "dim": params.dim,
           "n_layers": params.n_layers}  # fmt: skip
    if params.dim % params.n_heads == 0:  # else refused as a non-whole head by the tensor check
        out["head_dim"] = params.dim // params.n_heads
    if params.vocab_size is not None and params.vocab_size > 0:  # Llama 2 writes -1
        out["vocab_size"] = params.vocab_size
    return out


def meta_ffn_dim(dim: int, multiple_of: int, ffn_dim_multiplier: float | None) -> int:
    """Meta ``FeedForward``'s hidden width: ``int(2 * 4 * dim / 3)``, times the multiplier, rounded
    up to a multiple of ``multiple_of`` (transformers ``convert_llama_weights_to_hf.compute_intermediate_size``)."""
    hidden = int(2 * 4 * dim / 3)
    if ffn_dim_multiplier is not None:
        hidden = int(ffn_dim_multiplier * hidden)
    return multiple_of * ((hidden + multiple_of - 1) // multiple_of)


def _ffn_params(dim: int, ffn: int) -> dict[str, Any]:
    """``multiple_of`` (+ ``ffn_dim_multiplier``) that give ``ffn`` back by :func:`meta_ffn_dim`:
    a power of two up to 1024 alone if one does, else with the multiplier of fewest decimals that
    does (Meta's own are 1.3 / 1.5: Llama 3 8B's 14336 is 1024 x 1.3); {} if none does."""
    powers = [m for m in (1024, 512, 256, 128, 64, 32, 16, 8, 4, 2, 1) if ffn % m == 0]
    for m in powers:
        if meta_ffn_dim(dim, m, None) == ffn:
            return {"multiple_of": m}
    base = int(2 * 4 * dim / 3)
    mult = ffn / base if base else 0.0
    for cand in (round(mult, 1), round(mult, 2), round(mult, 3), round(mult, 6), mult, mult + 1e-9):
        for m in powers:
            if cand > 0 and meta_ffn_dim(dim, m, cand) == ffn:
                return {"multiple_of": m, "ffn_dim_multiplier": cand}
    return {}


def _rope_fields(cfg: HFTextConfig) -> dict[str, Any]:
    """``rope_theta`` / ``use_scaled_rope`` (+ ``rope_scaling_factor``, ``rope_high_freq_factor``
    when not Meta's defaults 8 / 4) from transformers 5's ``rope_parameters`` or 4.x's
    ``rope_scaling`` + ``rope_theta``.

    Raises:
        ValueError: a RoPE scaling Meta's params.json cannot say (not ``default`` / ``llama3``)."""
    params = cfg.rope_parameters or {}
    scaling = cfg.rope_scaling or {}
    theta = params.get("rope_theta", cfg.rope_theta)
    kind = params.get("rope_type") or params.get("type") or scaling.get("rope_type") or scaling.get("type") or "default"
    out: dict[str, Any] = {"rope_theta": float(theta) if theta is not None else None}
    if kind == "llama3":
        src = params if params.get("rope_type") == "llama3" else scaling
        out["use_scaled_rope"] = True
        if float(src.get("factor", 8.0)) != 8.0:
            out["rope_scaling_factor"] = float(src["factor"])
        if float(src.get("high_freq_factor", 4.0)) != 4.0:
            out["rope_high_freq_factor"] = float(src["high_freq_factor"])
    elif kind != "default":
        raise ValueError(f"RoPE scaling {kind!r} has no Meta params.json spelling (only llama3's use_scaled_rope)")
    return out


def write_params_json(dims: Mapping[str, int], cfg: HFTextConfig | None) -> bytes:
    """Meta ``params.json`` from the dims and (where given) an HF Llama-family config: ``dim``,
    ``n_layers``, ``n_heads``, ``n_kv_heads``, ``vocab_size``, ``norm_eps``, ``rope_theta``,
    ``use_scaled_rope`` (:func:`_rope_fields`) and the ``multiple_of`` / ``ffn_dim_multiplier``
    that give back ``intermediate_size`` (the ones kept in the config by a Meta -> HF conversion,
    ``fqnckpt_meta_params``, when they still do). Fields the config does not give are left out;
    :class:`MetaParams` reads the file back. ``dims`` must hold :data:`PARAMS_DIMS` (checked when
    the conversion is opened).

    Raises:
        ValueError: a RoPE scaling params.json cannot say."""
    out: dict[str, Any] = {k: int(dims[k]) for k in PARAMS_DIMS}
    if cfg is not None:
        out.update(vocab_size=cfg.vocab_size, norm_eps=cfg.rms_norm_eps, **_rope_fields(cfg))
        kept = dict(cfg.fqnckpt_meta_params or {})
        ffn = {k: kept.pop(k) for k in ("multiple_of", "ffn_dim_multiplier") if k in kept}
        if cfg.intermediate_size:
            fits = isinstance(ffn.get("multiple_of"), int) and ffn["multiple_of"] > 0 and \
                meta_ffn_dim(out["dim"], ffn["multiple_of"], ffn.get("ffn_dim_multiplier")) == cfg.intermediate_size
            out.update(ffn if fits else _ffn_params(out["dim"], cfg.intermediate_size))
        keys = kept.pop("keys", None)
        kept.pop("layout", None)  # hf_files.META_LAYOUT_KEY: the split, not a params.json field
        if (kept.get("vocab_size") or 1) <= 0:  # Llama 2's -1: the tokenizer's size
            out["vocab_size"] = kept.pop("vocab_size")
        out.update({k: v for k, v in kept.items() if k not in out})
        if isinstance(keys, list) and set(PARAMS_DIMS) <= set(keys):  # the source params.json's own keys
            out = {k: out.get(k) for k in keys}
        elif cfg.max_position_embeddings:
            out["max_seq_len"] = cfg.max_position_embeddings  # Meta's ModelArgs.max_seq_len
    return json.dumps({k: v for k, v in out.items() if v is not None}, indent=2).encode()


__all__ = ["Catalog", "MetaParams", "HFTextConfig", "open_catalog", "hf_config_of", "hf_dims", "model_dims", "params_dims", "write_params_json", "meta_ffn_dim", "PARAMS_NAME", "HF_CONFIG_NAME"]
