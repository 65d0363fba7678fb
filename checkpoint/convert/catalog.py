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
from pathlib import Path
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, ValidationError

from ..errors import CorruptCheckpointError, external_errors
from ..sources import Source, SourceSpec, open_source

PARAMS_NAME = "params.json"
_SHARD = re.compile(r"^consolidated\.(\d+)\.pth$")


class MetaParams(BaseModel):
    """Meta's ``params.json`` (fields fqnckpt uses; others are kept)."""

    model_config = ConfigDict(extra="allow")

    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int | None = None
    vocab_size: int | None = None
    norm_eps: float | None = None
    rope_theta: float | None = None


class Catalog:
    """Source keys with one :class:`SourceSpec` per shard; ``get(key, shard)`` reads one.

    Raises (from :func:`open_catalog`):
        CorruptCheckpointError: shards with different keys or dtypes (the file is named).
    """

    def __init__(self, path: Path, sources: list[Source], params: MetaParams | None):
        self.path = path
        self.sources = sources
        self.params = params
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


def _read_params(p: Path) -> MetaParams | None:
    f = p / PARAMS_NAME if p.is_dir() else p.parent / PARAMS_NAME
    if not f.is_file():
        return None
    try:
        return MetaParams.model_validate_json(f.read_bytes())
    except ValidationError as e:
        err = e.errors()[0]
        raise CorruptCheckpointError(str(f), f"not a Meta params.json: {'.'.join(map(str, err['loc']))}: {err['msg']}") from None


def open_catalog(path: str | os.PathLike, *, trusted_globals: Iterable[Any] = (), key: str | None = None) -> Catalog:
    """Open ``path``: a directory of ``consolidated.NN.pth`` shards (numbered 0..n-1, no gap), or
    any single source :func:`checkpoint.sources.open_source` reads.

    Raises:
        CorruptCheckpointError: shard numbers with a gap, shards that disagree, a bad params.json.
        and whatever :func:`open_source` raises for each file.
    """
    p = Path(path)
    params = _read_params(p)
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
        return Catalog(p, opened, params)
    except BaseException:
        for s in opened:
            s.close()
        raise


def model_dims(model: Any) -> dict[str, int]:
    """``n_heads`` / ``n_kv_heads`` / ``dim`` / ``head_dim`` from a ``PreTrainedModel``'s text config."""
    cfg = getattr(model, "config", None)
    if cfg is None:
        return {}
    if hasattr(cfg, "get_text_config"):
        cfg = cfg.get_text_config()
    out: dict[str, int] = {}
    for ours, theirs in (("n_heads", "num_attention_heads"), ("n_kv_heads", "num_key_value_heads"),
                         ("dim", "hidden_size"), ("head_dim", "head_dim"), ("n_layers", "num_hidden_layers")):  # fmt: skip
        v = getattr(cfg, theirs, None)
        if isinstance(v, int):
            out[ours] = v
    if "n_heads" in out:
        out.setdefault("n_kv_heads", out["n_heads"])
    return out


def params_dims(params: MetaParams | None) -> dict[str, int]:
    if params is None:
        return {}
    out = {"n_heads": params.n_heads, "n_kv_heads": params.n_kv_heads or params.n_heads, "dim": params.dim,
           "n_layers": params.n_layers, "head_dim": params.dim // params.n_heads}  # fmt: skip
    return out


def resolve_dims(*sources: Mapping[str, int] | None) -> dict[str, int]:
    """Later mappings override earlier ones; every value an int."""
    out: dict[str, int] = {}
    for s in sources:
        out.update({k: int(v) for k, v in (s or {}).items()})
    return out


def write_params_json(dims: Mapping[str, int], model: Any) -> bytes:
    """Meta ``params.json`` for an HF Llama-family ``model`` (dims plus norm_eps / rope_theta / vocab)."""
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    rope = getattr(cfg, "rope_parameters", None) or {}
    out = {"dim": dims["dim"], "n_layers": dims["n_layers"], "n_heads": dims["n_heads"], "n_kv_heads": dims["n_kv_heads"],
           "vocab_size": cfg.vocab_size, "norm_eps": getattr(cfg, "rms_norm_eps", None),
           "rope_theta": rope.get("rope_theta", getattr(cfg, "rope_theta", None))}  # fmt: skip
    return json.dumps(out, indent=2).encode()


__all__ = ["Catalog", "MetaParams", "open_catalog", "model_dims", "params_dims", "resolve_dims", "PARAMS_NAME"]
