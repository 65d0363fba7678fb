"""What ``save`` writes for a PEFT model (peft's ``PeftModel``, maybe compiled / DDP-wrapped).

peft names every tensor through its own modules: ``base_model.model.<X>.base_layer.weight`` (the
frozen base weight), ``base_model.model.<X>.lora_A.<adapter>.weight`` (the adapter),
``<X>.original_module.*`` / ``<X>.modules_to_save.<adapter>.*`` (fully trained copies). None of
these are the base model's eager names, so ``from_pretrained`` of such a checkpoint builds a random
model. Two layouts are written instead, both readable by transformers and peft as they are:

- ``peft="adapter"`` (default, lossless): the base model under its eager names (``<X>.weight``)
  plus peft's own adapter files beside it, ``adapter_config.json`` and
  ``adapter_model.safetensors`` (names and config as ``PeftModel.save_pretrained`` writes them,
  through peft's ``get_peft_model_state_dict`` and ``PeftConfig.save_pretrained``). Transformers
  loads such a directory as a base model with an embedded adapter
  (``AutoModelForCausalLM.from_pretrained(dir)`` attaches it: the trained model's logits exactly);
  ``PeftModel.from_pretrained(base, dir)`` reads the adapter files.
- ``peft="merged"``: one plain model, each LoRA weight merged as peft's ``merge_and_unload`` does
  (``W + layer.get_delta_weight(adapter)`` per active adapter, in ``W``'s dtype) and each
  ``modules_to_save`` copy in place of its original; nothing of peft is left.
"""

from __future__ import annotations

import copy
import json
import os
import tempfile
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from .convert.hf_files import architecture_class, is_peft_model, unwrap_model
from .peft_config import ADAPTER_CONFIG, MATH_FIELDS, adapter_math, plain_value, read_adapter_config
from .state import Entry, ModuleState

PEFT_MODES = ("adapter", "merged")
ADAPTER_WEIGHTS = "adapter_model.safetensors"  # peft.utils.constants.SAFETENSORS_WEIGHTS_NAME
_ROOT = "base_model.model."  # PeftModel.base_model (the tuner) .model (the transformers model)
_BASE_SLOTS = ("base_layer", "original_module")  # peft's slot for the wrapped base module


def find_peft(obj: Any) -> Any:
    """The ``PeftModel`` in ``obj`` under torch's wrappers (compile, DDP, FSDP1, checkpoint), or None."""
    from fqn.rules import is_wrapper_module
    from fqn.segments import WRAPPER_SEGMENTS

    for _ in range(64):
        if is_peft_model(obj):
            return obj
        if not isinstance(obj, torch.nn.Module) or not is_wrapper_module(obj):
            return None
        obj = next((c for s, c in obj._modules.items() if s in WRAPPER_SEGMENTS and c is not None), None)
    return None


def _adapters(peft_model) -> list[str]:
    act = peft_model.active_adapter
    return list(act) if isinstance(act, (list, tuple)) else [act]


def base_name(name: str, prefix: str, adapters: list[str]) -> tuple[str | None, str | None]:
    """``(eager base name, None)`` for a base tensor, ``(None, base name it replaces)`` for a
    ``modules_to_save`` copy of an active adapter, ``(None, None)`` for adapter-owned tensors.
    ``name`` is relative to the ``PeftModel``; ``prefix`` is the tuner's (``"lora_"``)."""
    if not name.startswith(_ROOT):
        raise ValueError(f"PEFT tensor {name!r} is not under {_ROOT!r}: only peft's tuner models "
                         "(LoRA and its kin) are saved in eager names")  # fmt: skip
    segs = name[len(_ROOT):].split(".")
    if "modules_to_save" in segs:
        i = segs.index("modules_to_save")
        if i + 1 < len(segs) and segs[i + 1] in adapters:
            return None, ".".join(segs[:i] + segs[i + 2:])
        return None, None
    if any(s.startswith(prefix) for s in segs):
        return None, None
    return ".".join(s for s in segs if s not in _BASE_SLOTS), None


def peft_state(obj: Any, state: ModuleState, mode: str) -> tuple[ModuleState, dict[str, bytes]]:
    """The base model's entries under eager names and, for ``mode="adapter"``, the adapter files
    (``{name: bytes}``) written beside them. ``state`` is ``obj``'s own (names relative to the
    ``PeftModel``, torch's wrapper segments already removed).

    Raises:
        ValueError: ``mode`` is not one of :data:`PEFT_MODES`; a tensor outside peft's tuner
            layout; ``merged`` for a layer peft cannot merge by addition (DoRA, IA3, ...) or with
            DTensor parameters (merge before sharding, or save the adapter).
    """
    if mode not in PEFT_MODES:
        raise ValueError(f"peft={mode!r}: expected one of {PEFT_MODES}")
    pm = find_peft(obj)
    adapters = _adapters(pm)
    prefix = getattr(pm.base_model, "prefix", "lora_")
    entries: dict[str, Entry] = {}
    copies: dict[str, torch.Tensor] = {}
    for e in state.entries:
        names = [base_name(n, prefix, adapters) for n in e.names]
        eager = [b for b, _ in names if b is not None]
        if eager:
            entries[eager[0]] = Entry(eager[0], e.tensor, e.kind, eager[1:], list(e.module_names))
        for _, replaced in names:
            if replaced is not None:
                copies[replaced] = e.tensor
    if mode == "merged":
        _merge(pm, entries, copies, adapters)
    out = ModuleState(list(entries.values()), state.non_persistent, None)
    return out, ({} if mode == "merged" else adapter_files(pm, adapters))


def _merge(pm, entries: dict[str, Entry], copies: dict[str, torch.Tensor], adapters: list[str]) -> None:
    """Merged values in place of the base entries (peft's ``merge_and_unload`` rule)."""
    for name, t in copies.items():  # a modules_to_save copy replaces its original
        if name in entries:
            entries[name].tensor = t
    model = pm.base_model.model
    for mod_name, mod in model.named_modules():
        if not any(n.startswith("lora_") for n in getattr(mod, "adapter_layer_names", ())):
            continue
        key = f"{mod_name}.weight" if mod_name else "weight"
        active = [a for a in adapters if a in getattr(mod, "lora_A", {}) or a in getattr(mod, "lora_embedding_A", {})]
        if not active or key not in entries:
            continue
        w = entries[key].tensor
        if isinstance(w, DTensor) or any(getattr(mod, "use_dora", {}).get(a, False) for a in active):
            raise ValueError(f"save(peft='merged'): {key} is a DTensor or a DoRA layer; peft merges it "
                             "in place only: save with peft='adapter'")  # fmt: skip
        with torch.no_grad():
            merged = w.detach().clone()
            for a in active:  # peft's LoraLayer.merge(safe_merge=True): W += delta, adapter by adapter
                merged += mod.get_delta_weight(a)
        entries[key].tensor = merged


def adapter_files(pm, adapters: list[str]) -> dict[str, bytes]:
    """``adapter_config.json`` and ``adapter_model.safetensors`` as ``PeftModel.save_pretrained``
    writes them for one adapter (names without the adapter name, ``inference_mode`` set).

    Raises:
        ValueError: several adapters are active (peft's own directory holds one per folder)."""
    from peft.utils import get_peft_model_state_dict
    from safetensors.torch import save as st_save

    if len(adapters) != 1:
        raise ValueError(f"save(peft='adapter'): {len(adapters)} active adapters {adapters}; peft's "
                         "directory holds one: set one active (set_adapter) or save peft='merged'")  # fmt: skip
    name = adapters[0]
    sd = get_peft_model_state_dict(pm, adapter_name=name)
    # Every rank gathers DTensors (collective); bytes are written by whoever commits the extra files.
    tensors = {
        k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().to("cpu").contiguous() for k, v in sd.items()
    }
    cfg = copy.copy(pm.peft_config[name])  # set as PeftModel.save_pretrained sets them, on a copy
    cfg.inference_mode = True
    base_cls = architecture_class(unwrap_model(pm))
    if cfg.base_model_name_or_path is None:
        cfg.base_model_name_or_path = pm.base_model.model.__dict__.get("name_or_path") or None
    mapping = None if cfg.task_type is not None else {"base_model_class": base_cls.__name__,
                                                      "parent_library": base_cls.__module__}  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        cfg.save_pretrained(tmp, auto_mapping_dict=mapping)  # peft's own writer of adapter_config.json
        with open(os.path.join(tmp, ADAPTER_CONFIG), "rb") as f:
            config = f.read()
    json.loads(config)  # written by peft; read back before it is committed
    return {ADAPTER_CONFIG: config, ADAPTER_WEIGHTS: st_save(tensors, metadata={"format": "pt"})}




def saved_names_state(obj: Any, state: ModuleState) -> ModuleState:
    """``state`` of a model holding a ``PeftModel`` with every entry named as the files name it:
    base tensors by their eager base names (``<X>.weight``), the active adapter's tensors by
    peft's saved names (``base_model.model.<X>.lora_A.weight``: peft's ``get_peft_model_state_dict``
    drops ``.<adapter>``), each keeping its PEFT names as aliases (older checkpoints that stored
    them load too). What ``load`` plans a PEFT target against and how the optimizer of a PEFT
    model is saved; tensors are the model's own (``assign`` replaces them in place)."""
    pm = find_peft(obj)
    adapters = _adapters(pm)
    prefix = getattr(pm.base_model, "prefix", "lora_")
    out: list[Entry] = []
    for e in state.entries:
        base, _ = base_name(e.fqn, prefix, adapters) if e.fqn.startswith(_ROOT) else (None, None)
        if base is not None:
            fqn = base
        elif e.fqn.startswith(_ROOT) and len(adapters) == 1:  # peft.utils.save_and_load's own rules
            a = adapters[0]
            fqn = e.fqn.replace(f".modules_to_save.{a}.", ".") if f".modules_to_save.{a}." in e.fqn else e.fqn.replace(f".{a}", "")
        else:
            fqn = e.fqn
        aliases = [n for n in dict.fromkeys(e.names) if n != fqn]
        out.append(Entry(fqn, e.tensor, e.kind, aliases, list(e.module_names)))
    return ModuleState(out, state.non_persistent, state.fqn_map)


def adapter_only_state(obj: Any, state: ModuleState) -> ModuleState:
    """:func:`saved_names_state` less the base tensors: what a peft adapter directory (no base
    weights in it) fills; the base model comes from elsewhere."""
    named = saved_names_state(obj, state)
    keep = [e for e in named.entries if e.fqn.startswith(_ROOT)]  # base tensors lost the prefix
    return ModuleState(keep, named.non_persistent, named.fqn_map)


def has_adapter(path: str) -> bool:
    """``path`` is a local directory holding peft's adapter files."""
    return os.path.isfile(os.path.join(path, ADAPTER_WEIGHTS)) and os.path.isfile(os.path.join(path, ADAPTER_CONFIG))


def check_adapter_config(obj: Any, path: str) -> None:
    """Compare the ``adapter_config.json`` saved in directory ``path`` with the peft config of
    the active adapter of the ``PeftModel`` in ``obj``, field by field over :data:`MATH_FIELDS`.
    A field the saved file lacks takes the default of the target config's class (what peft's
    ``from_pretrained`` would take). Targets with several active adapters are not compared (no
    saved directory holds several).

    Raises:
        AdapterConfigMismatchError: naming every field that differs, saved and target values.
        CorruptCheckpointError: the saved config is not a JSON object."""
    import dataclasses

    from .errors import AdapterConfigMismatchError

    pm = find_peft(obj)
    adapters = _adapters(pm)
    if len(adapters) != 1:
        return
    cfg = pm.peft_config[adapters[0]]
    target = adapter_math(cfg)
    saved = adapter_math(read_adapter_config(path))
    defaults = {f.name: f.default for f in dataclasses.fields(cfg) if f.default is not dataclasses.MISSING}
    defaults |= {f.name: f.default_factory() for f in dataclasses.fields(cfg) if f.default_factory is not dataclasses.MISSING}
    differ = {}
    for k, t in target.items():
        s = saved[k] if k in saved else plain_value(k, defaults.get(k, t))
        if s != t:
            differ[k] = (s, t)
    if differ:
        raise AdapterConfigMismatchError(os.path.join(path, ADAPTER_CONFIG), adapters[0], differ)


__all__ = ["ADAPTER_CONFIG", "ADAPTER_WEIGHTS", "MATH_FIELDS", "PEFT_MODES", "adapter_math", "adapter_only_state",
           "base_name", "check_adapter_config", "find_peft", "has_adapter", "peft_state", "read_adapter_config",
           "saved_names_state"]


def open_adapter_reader(path: str, base_reader: Any = None) -> Any:
    """The load reader of a checkpoint directory holding peft's adapter files: ``base_reader``
    (the model part, opened already) with ``adapter_model.safetensors``'s tensors added under
    peft's names, or the adapter file alone when ``base_reader`` is None (a peft adapter
    directory). The file passes the same header checks as every shard (one reader, one rule).

    Raises:
        DuplicateTensorError: a name is in both the model part and the adapter file."""
    from .errors import DuplicateTensorError
    from .storage.opening import open_checkpoint

    if base_reader is None:
        return open_checkpoint(os.path.join(path, ADAPTER_WEIGHTS))
    with open_checkpoint(os.path.join(path, ADAPTER_WEIGHTS)) as ad:
        names = ad.keys()
    both = [k for k in names if k in base_reader]
    if both:
        raise DuplicateTensorError(both[0], [base_reader.file_of(both[0]), ADAPTER_WEIGHTS])
    base_reader._key_file.update({k: ADAPTER_WEIGHTS for k in names})
    base_reader.files = sorted(set(base_reader._key_file.values()))
    base_reader._load_headers()
    return base_reader
