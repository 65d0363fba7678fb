"""What the CLI reads of a checkpoint fqnckpt wrote: its parts (model, optimizer, extra state),
and the steps of a ``CheckpointManager`` root.

A checkpoint of :func:`checkpoint.save` is a directory with ``model.safetensors.index.json``
(and ``optimizer.safetensors.index.json`` / ``extra_state.json`` when saved with an optimizer /
``extra_state``; names from :mod:`checkpoint.storage.format` and
:mod:`checkpoint.training.extra_state`). Each index is a checkpoint of its own to the sources,
so a part is opened through its index file, never by guessing among several.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..storage.format import EXTRA_STATE_FILE, MODEL_PREFIX, OPTIMIZER_PREFIX, OptimizerMeta, index_name
from .errors import BadInput

PARTS = ("model", "optimizer", "extra_state", "adapter")
ADAPTER_FILE = "adapter_model.safetensors"  # peft's adapter beside the base (checkpoint.peft_state)


@dataclass
class Parts:
    """The parts of one fqnckpt checkpoint directory: index file paths (None when absent), the
    extra-state file, the model's alias groups and the optimizer's metadata from the indexes."""

    root: str
    model: str
    optimizer: str | None
    extra_state: str | None
    alias_groups: list[list[str]] = field(default_factory=list)
    optimizer_meta: OptimizerMeta | None = None
    store: Any = None  # the byte store of a checkpoint at a URL (paths above are then URLs)
    adapter: str | None = None  # peft's adapter_model.safetensors beside the model (save of a PeftModel)


def meta_shard_dir(path: str | os.PathLike) -> bool:
    """True for a local directory of Meta's model-parallel shards (:func:`checkpoint.sources.sniffing.meta_shards`)."""
    from ..sources.sniffing import meta_shards

    return bool(meta_shards(path))


class MetaShards:
    """Meta's model-parallel shards of one directory as ``inspect`` shows them: opened the way
    ``migrate --recipe meta-llama-to-hf`` opens them (:func:`checkpoint.convert.catalog.open_catalog`:
    shards numbered 0..n-1, the same keys and dtypes in each), keys once, each shape the piece one
    shard holds, bytes and files over every shard; ``split`` the version of the split
    (:func:`checkpoint.convert.layouts.meta_split`)."""

    format = "meta-shards"
    container = None
    optimizer = None
    extra_state: dict = {}

    def __init__(self, path: str | os.PathLike, trusted: list[str] | None = None):
        from ..convert.catalog import open_catalog
        from ..convert.layouts import LayoutError, meta_split

        self.catalog = open_catalog(path, trusted_globals=trusted or ())
        self.path = Path(path)
        self.files = [s.path.name for s in self.catalog.sources]
        self.skipped = {k: v for s in self.catalog.sources for k, v in s.skipped.items()}
        try:
            self.split, widths = meta_split(self.catalog)
        except LayoutError as e:
            self.split, widths = None, []
            self.notes = [str(e)]
        else:
            self.notes = []
        how = {"llama2": "by columns (Llama 1 / 2)", "llama3": "by vocabulary (Llama 3)"}.get(self.split or "", "")
        self.notes.insert(0, f"Meta model-parallel shards {self.files[0]} .. {self.files[-1]}: each shape is one shard's piece"
                             + (f"; tok_embeddings split {how}, widths {widths}" if how else "")
                             + "; `migrate --recipe meta-llama-to-hf` joins them")  # fmt: skip

    def keys(self) -> list[str]:
        return self.catalog.keys()

    def spec(self, key: str):
        return self.catalog.specs(key)[0]

    def nbytes(self, key: str) -> int:
        return self.catalog.nbytes(key)

    def total_bytes(self) -> int:
        return sum(self.catalog.nbytes(k) for k in self.catalog.keys())

    def optimizer_bytes(self) -> int:
        return 0

    def per_file(self) -> dict[str, dict[str, int]]:
        return {name: v for s in self.catalog.sources for name, v in s.per_file().items()}

    def close(self) -> None:
        self.catalog.close()

    def __enter__(self) -> MetaShards:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def open_inspected(path: str | os.PathLike, key: str | None = None, trusted: list[str] | None = None):
    """The :class:`~checkpoint.sources.base.Source` ``inspect`` reads: a safetensors checkpoint
    (one file, or shards with or without an index) opened for its headers only, without
    importing torch (``import torch`` takes seconds); a directory of Meta shards as
    :class:`MetaShards` (what ``migrate`` reads); any other format (pickles, DCP, URLs) through
    ``open_source``. Same keys, specs, files, notes and errors either way."""
    from ..sources.sniffing import sniff
    from ..storage.location import local_path, resolve

    local = local_path(resolve(path))
    if key is None and local is not None and meta_shard_dir(path):
        return MetaShards(path, trusted)

    if key is None and not trusted and local is not None and sniff(path) in ("safetensors", "safetensors-sharded"):
        from ..sources.st_headers import open_safetensors_headers

        return open_safetensors_headers(Path(path))
    from ..sources import open_source

    return open_source(path, key=key, trusted_globals=trusted or ())


def _plain_file(path: str) -> bool:
    return os.path.isfile(path) and not os.path.islink(path)


def fqnckpt_parts(path: str | os.PathLike) -> Parts | None:
    """The parts of the fqnckpt checkpoint at ``path`` (a directory or URL holding fqnckpt's model
    index), else None (any other format: the sources read it whole). Every part is the object the
    model index's record names, read from one view of the checkpoint, on every backend (the part
    paths of a URL are ``<url>/<index name>``, which :func:`checkpoint.sources.open_source` opens as
    that part).

    Raises:
        CorruptCheckpointError: an index that does not parse (file named).
        MissingShardError: a part the model index's record names is gone.
    """
    from ..errors import MissingShardError
    from ..storage.dir_layout import check_one_layout
    from ..storage.location import local_path, resolve
    from ..storage.st_header import parse_index_bytes  # torch-free (inspect)
    from ..storage.views import checkpoint_view

    where = resolve(path)
    local = local_path(where)
    if local is not None:
        if not os.path.isdir(local) or not _plain_file(os.path.join(local, index_name(MODEL_PREFIX))):
            return None
        check_one_layout(local)  # DCP's .metadata beside it: refused, as every reader refuses it
    with checkpoint_view(where) as view:
        meta = view.index.metadata.fqnckpt if view.index is not None else None
        if meta is None:
            return None  # nothing committed there, or a Hugging Face checkpoint: no parts of ours
        store = view.store
        opt_name, extra_name = index_name(OPTIMIZER_PREFIX), EXTRA_STATE_FILE
        raw = view.member_bytes(opt_name) if view.object_of(opt_name) is not None else None
        opt_meta = parse_index_bytes(raw, store.url_of(opt_name)).metadata.fqnckpt if raw is not None else None
        has_extra = view.object_of(extra_name) is not None and view.member_bytes(extra_name) is not None
        recorded = meta.objects or {}  # parts the save wrote: one missing now is named, not skipped
        gone = [recorded[n] for n, there in ((opt_name, raw is not None), (extra_name, has_extra)) if n in recorded and not there]
        if gone:
            raise MissingShardError(store.url, gone, index_name(MODEL_PREFIX))
        adapter = local is not None and _plain_file(os.path.join(local, ADAPTER_FILE))
        return Parts(
            store.url,
            store.url_of(index_name(MODEL_PREFIX)),
            store.url_of(opt_name) if raw is not None else None,
            store.url_of(extra_name) if has_extra else None,
            [list(g) for g in meta.alias_groups],
            opt_meta.optimizer if opt_meta is not None else None,
            store if local is None else None,
            adapter=store.url_of(ADAPTER_FILE) if adapter else None,
        )


def adapter_config_summary(parts: Parts | None) -> dict[str, Any] | None:
    """The fields of the ``adapter_config.json`` beside a PEFT checkpoint's adapter file that
    change the math (:data:`checkpoint.peft_config.MATH_FIELDS`, as the file holds them), or None
    when there is no adapter part (or no config beside it, e.g. at a URL).

    Raises:
        CorruptCheckpointError: the config is not a JSON object (file named)."""
    if parts is None or parts.adapter is None or parts.store is not None:
        return None
    return adapter_dir_config(parts.root)


def adapter_dir_config(path: Any) -> dict[str, Any] | None:
    """:func:`adapter_config_summary` of a local directory holding peft's adapter files (a
    ``save_pretrained`` directory, or a checkpoint's adapter part), else None."""
    from ..peft_config import ADAPTER_CONFIG, adapter_math, read_adapter_config
    from ..storage.location import local_path, resolve

    root = local_path(resolve(path))  # peft's adapter folders are local files
    if root is None or not os.path.isdir(root):
        return None
    if not (_plain_file(os.path.join(root, ADAPTER_CONFIG)) and _plain_file(os.path.join(root, ADAPTER_FILE))):
        return None
    return adapter_math(read_adapter_config(root))


def part_index(parts: Parts, part: str, flag: str) -> str:
    """The index file of ``part`` (``model`` / ``optimizer``).

    Raises:
        BadInput: the checkpoint has no such part (``flag`` named).
    """
    path = {"model": parts.model, "optimizer": parts.optimizer, "adapter": parts.adapter}.get(part)
    if path is None:
        have = [p for p in PARTS if getattr(parts, p) is not None]
        raise BadInput(f"{parts.root} has no {part} part (it has {have})", flag=flag, file=parts.root)
    return path


@dataclass
class ManagerRoot:
    """A ``CheckpointManager`` root: ``steps`` as ``(step, directory, complete)``; ``foreign``:
    ``step-*`` entries no manager wrote (never loaded or removed by one)."""

    root: str
    steps: list[tuple[int, str, bool]]
    foreign: list[str]

    @property
    def latest(self) -> str | None:
        done = [d for _, d, ok in self.steps if ok]
        return done[-1] if done else None


def manager_root(path: str | os.PathLike) -> ManagerRoot | None:
    """``path`` as a manager root (a directory that is no checkpoint itself, with ``step-*``
    entries), else None. Changes nothing (a manager's constructor would clean up leftovers)."""
    from ..storage.commit import is_committed
    from ..storage.location import local_path, resolve, store_of

    where = resolve(path)
    local = local_path(where)
    if local is not None and not os.path.isdir(local):
        return None
    store = store_of(where)  # the same rule over every byte store
    listing = store.listing()
    if index_name(MODEL_PREFIX) in listing or not any(n.startswith("step-") for n in listing):
        return None
    if any(n == ".metadata" or n.endswith((".safetensors", ".index.json", ".pt", ".pth", ".bin")) for n in listing):
        return None  # a checkpoint of another format that happens to hold a step-* entry
    from ..training.manager import parse_step_dir_name

    steps, foreign = [], []
    for name, (kind, _) in sorted(listing.items()):
        step = parse_step_dir_name(name)
        if step is not None and kind == "directory":
            steps.append((step, store.url_of(name), is_committed(store.child(name))))
        elif name.startswith("step-"):
            foreign.append(name)
    return ManagerRoot(store.url, sorted(steps), foreign)


def optimizer_summary(parts: Parts) -> dict | None:
    """The optimizer part of ``parts`` for ``inspect``: class, param groups (hyper-parameters,
    number of parameters), state tensors and bytes; None without one."""
    if parts.optimizer is None:
        return None
    with open_inspected(parts.optimizer) as src:
        keys = src.keys()
        nbytes = sum(src.nbytes(k) for k in keys)
        slots = sorted({k.rpartition(".")[2] for k in keys})
        per_file = src.per_file()
    meta = parts.optimizer_meta
    groups = [] if meta is None else [
        {"params": len(g.params), **{k: _hyper(meta, k, v) for k, v in g.model_dump().items() if k != "params"}}
        for g in meta.param_groups
    ]  # fmt: skip
    return {
        "index": os.path.basename(parts.optimizer),
        "per_file": per_file,  # each file its index names: tensors, bytes
        "optimizer_class": meta.optimizer_class if meta is not None else None,
        "tensors": len(keys),
        "bytes": nbytes,
        "state_slots": slots,
        "params": sum(g["params"] for g in groups),
        "param_groups": groups,
    }


def _hyper(meta: OptimizerMeta, name: str, raw):
    """A hyper-parameter as Python (encoding 2 tags tuples, None, inf / nan); raw if it holds a tensor."""
    if meta.value_encoding != 2:
        return raw
    from ..optim import decode_value

    try:
        return decode_value(raw, name)
    except Exception:  # noqa: BLE001 - a tensor by reference needs the shards: shown as stored
        return raw


def _describe(node) -> str:
    if node.kind == "tensor":
        return f"tensor {node.dtype} {tuple(node.shape)}"
    if node.kind in ("list", "tuple", "dict"):
        return f"{node.kind} of {len(node.items)}"
    return node.kind


def rank_entry_name(key: str, rank: int, world_size: int) -> str:
    """How ``inspect`` and ``diff`` name rank ``rank``'s value of per-rank entry ``key``."""
    return f"{key} [rank {rank} of {world_size}]"


def extra_state_entries(parts: Parts | None, src=None) -> dict | None:
    """Every extra-state entry of a checkpoint as ``{name: ExtraStateEntry}``, read the one way
    for every source: an fqnckpt checkpoint's ``extra_state.json`` and each per-rank file it
    lists (``extra_state.rank-RRRRR-of-WWWWW.json``, entries named by :func:`rank_entry_name`),
    or the entries of a migration source that are extra state (DCP:
    :func:`checkpoint.plan.extra_state.source_extra_state`, as ``migrate`` writes them). None
    when it holds none.

    Raises:
        CorruptCheckpointError / ChecksumMismatchError: see ``read_extra_state_file`` /
            ``read_rank_file``; TypeError / ValueError: a DCP entry with no exact encoding.
    """
    if parts is None:
        if src is None or not getattr(src, "extra_state", None):
            return None
        from ..plan.extra_state import source_extra_state

        return source_extra_state(src)
    if parts.extra_state is None:
        return None
    from ..storage.extra_state import read_extra_state_file, read_rank_file
    from ..storage.views import checkpoint_view

    with checkpoint_view(parts.store if parts.store is not None else parts.root):  # the objects its record names
        doc = read_extra_state_file(parts.root)
        out = dict(doc.entries)
        if doc.per_rank is not None:
            w = doc.per_rank.world_size
            for r in range(w):
                for k, e in read_rank_file(parts.root, doc, r).entries.items():
                    out[rank_entry_name(k, r, w)] = e
    return out


def extra_state_files(parts: Parts | None) -> dict[str, int] | None:
    """``{file: bytes}`` of an fqnckpt checkpoint's extra state (``extra_state.json`` and each
    per-rank file it lists), each named as the model index's record names its object (on object
    storage the name carries the save's token); None without extra state.

    Raises what :func:`checkpoint.storage.extra_state.checked_extra_state_files` raises."""
    if parts is None or parts.extra_state is None:
        return None
    from ..storage.extra_state import checked_extra_state_files
    from ..storage.views import checkpoint_view

    with checkpoint_view(parts.store if parts.store is not None else parts.root) as view:
        files = checked_extra_state_files(parts.root)
        return {view.object_of(name) or name: len(data) for name, data in files.items()}


def extra_state_summary(parts: Parts | None, src=None) -> dict | None:
    """The extra state for ``inspect`` (see :func:`extra_state_entries`): each entry's kind (a
    stateful object's class, where recorded)."""
    try:
        entries = extra_state_entries(parts, src)
    except (TypeError, ValueError) as e:  # a DCP entry extra state cannot hold (migrate stops on it too)
        if parts is not None:
            raise
        return {"(unreadable)": f"not storable as extra state: {e}"}
    if entries is None:
        return None
    return {
        name: (f"stateful {e.class_name}" if e.class_name else "stateful") if e.stateful else _describe(e.value)
        for name, e in entries.items()
    }


__all__ = ["PARTS", "Parts", "MetaShards", "meta_shard_dir", "open_inspected", "fqnckpt_parts", "part_index", "ManagerRoot", "manager_root", "optimizer_summary",
           "extra_state_entries", "extra_state_files", "extra_state_summary", "rank_entry_name"]  # fmt: skip
