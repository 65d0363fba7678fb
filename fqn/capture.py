"""Fill an :class:`~fqn.registry.FQNMap` during capture, by tensor identity (the map is made by
:meth:`FQNMap.from_capture` / :meth:`FQNMap.from_exported_program`, which call the ``fill_*``
functions here: this module never imports the registry, so the two form no import cycle).

Why identity: dynamo and export flatten names lossily (``a_b.c`` and ``a.b_c`` both become
``a_b_c``), and ``gm.meta["dynamo_flat_name_to_original_fqn"]`` maps colliding names to the wrong
module. The graph attributes of a dgc / ``_export_to_torch_ir`` GraphModule and the
``example_inputs`` a ``torch.compile`` backend receives are the model's own tensor objects, so
``id()`` decides every name. See ``docs/capture-names.md``.

The raw dgc GraphModule's generated code still reads ``self.L__self____export_root_a_b_c_weight``
while its get_attr targets are ``L__self___a_b_c_weight`` (calling it raises AttributeError until
``gm.recompile()``, which rewrites the code to the targets). That spelling is recorded as a
captured name too: it is read from the code with ``ast`` next to the node whose target holds the
tensor (identity again, no string splitting), so a name copied from that code still resolves.
"""

from __future__ import annotations

import ast
from collections.abc import Sequence

import torch
import torch.nn as nn

from .eager import TensorKind, dtype_name, eager_tensors
from .errors import CaptureMismatchError, UnknownNameError
from .schema import Provenance, TensorRecord
from .rules import canonical_fqn, flatten_name

_DYNAMO_META = "dynamo_flat_name_to_original_fqn"


def _attr(root: nn.Module, target: str):
    obj = root
    for seg in target.split("."):
        obj = getattr(obj, seg, None)
        if obj is None:
            return None
    return obj


def _code_attr_spellings(mod: torch.fx.GraphModule) -> dict[str, str]:
    """``{node name: attribute spelled in mod.code}`` for lines ``<node> = self.<attr>``.

    The raw dgc GraphModule's generated code still reads ``self.L__self____export_root_x_y``
    while the node's target is ``L__self___x_y`` (calling it raises ``AttributeError`` until
    ``recompile()``). Reading the code (not splitting names) keeps that spelling findable.
    """
    try:
        tree = ast.parse(mod.code)
    except (SyntaxError, AttributeError):
        return {}
    out: dict[str, str] = {}
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Assign)
            and len(node.targets) == 1
            and isinstance(node.targets[0], ast.Name)
            and isinstance(node.value, ast.Attribute)
            and isinstance(node.value.value, ast.Name)
            and node.value.value.id == "self"
        ):
            out[node.targets[0].id] = node.value.attr
    return out


def _graph_tensors(gm: torch.fx.GraphModule, example_inputs: Sequence | None):
    """Yield ``(captured name, tensor)`` for every tensor the graph holds or receives."""
    for name, t in gm.named_parameters(remove_duplicate=False):
        yield name, t
    for name, t in gm.named_buffers(remove_duplicate=False):
        yield name, t
    for mod_name, mod in gm.named_modules():
        if not isinstance(mod, torch.fx.GraphModule):
            continue
        prefix = f"{mod_name}." if mod_name else ""
        in_code = _code_attr_spellings(mod)
        for node in mod.graph.nodes:
            if node.op == "get_attr":
                t = _attr(mod, node.target)
                if isinstance(t, torch.Tensor):
                    yield prefix + node.target, t
                    yield prefix + node.name, t
                    if node.name in in_code:
                        yield prefix + in_code[node.name], t
    if example_inputs is not None:
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        for node, t in zip(placeholders, example_inputs):
            if isinstance(t, torch.Tensor):
                yield node.target, t
                yield node.name, t


class _Received(Exception):
    """Stops the call in :func:`graph_input_tensors` once the graph's inputs are known."""


def graph_input_tensors(gm: torch.fx.GraphModule, args: tuple = (), kwargs: dict | None = None) -> tuple:
    """The tensors the placeholders of ``gm`` receive when it is called as ``gm(*args, **kwargs)``,
    in placeholder order, for a GraphModule from the public
    ``torch._dynamo.functional_export.dynamo_graph_capture_for_export``: its parameters and
    buffers are graph inputs, which its generated ``forward`` reads from the model through the
    ``_dynamo_bytecode_flatten`` prologue, so they are the model's own tensor objects (identity).
    The call stops right after the prologue: the graph itself does not run.

    Raises:
        ValueError: ``gm`` has no ``_dynamo_bytecode_flatten`` prologue (not that capture).
    """
    flatten = getattr(gm, "_dynamo_bytecode_flatten", None)
    if flatten is None:
        raise ValueError("graph module has no _dynamo_bytecode_flatten (not from dynamo_graph_capture_for_export)")
    seen: list = []

    def record(*a, **k):
        seen.append(flatten(*a, **k))
        raise _Received

    gm._dynamo_bytecode_flatten = record
    try:
        gm(*args, **(kwargs or {}))
    except _Received:
        pass
    finally:
        gm._dynamo_bytecode_flatten = flatten
    return tuple(seen[0]) if seen else ()


def fill_from_capture(
    fmap, model: nn.Module, gm: torch.fx.GraphModule, example_inputs: Sequence | None = None
) -> None:
    """Fill ``fmap`` (an ``FQNMap`` of ``model``'s eager names, provenance ``identity``) with the
    captured names of ``gm`` captured from ``model``, keyed by tensor identity.

    Works for GraphModules from a ``torch.compile`` backend (pass the backend's
    ``example_inputs``: they are the model's own tensors; the same for the backend of
    ``torch.compile(..., fullgraph=True).forward.aot_compile`` (``torch._dynamo.aot_compile``)),
    from the public ``torch._dynamo.functional_export.dynamo_graph_capture_for_export`` (pass
    ``example_inputs=graph_input_tensors(gm, args, kwargs)``: its state is graph inputs), from
    ``torch._dynamo.functional_export._dynamo_graph_capture_for_export`` (before and after
    ``torch.export._trace._restore_state_dict``) and from ``torch.export._trace._export_to_torch_ir``.
    Graph tensors that are not model state (user inputs, lifted constants) are ignored.

    ``gm.meta["dynamo_flat_name_to_original_fqn"]`` is used only as a cross-check: where it names a
    different tensor than identity does, and the two FQNs do not flatten to the same string (the
    one case where the meta is known to be lossy), :class:`CaptureMismatchError` is raised.

    Raises:
        CaptureMismatchError: one captured name reaches two tensors, or the meta contradicts identity.
    """
    records = eager_tensors(model)
    by_id = {id(t.tensor): t.fqn for t in records}
    for name, t in _graph_tensors(gm, example_inputs):
        fqn = by_id.get(id(t))
        if fqn is not None:
            fmap.add_captured(fqn, name)
    spellings = {t.fqn: {*t.names, *t.module_names} for t in records}
    _cross_check_meta(fmap, gm, spellings)


def _cross_check_meta(fmap, gm: torch.fx.GraphModule, spellings: dict[str, set[str]]) -> None:
    meta = getattr(gm, "meta", {}).get(_DYNAMO_META) or {}
    for flat, claimed in meta.items():
        if flat not in fmap:
            continue  # unused or never materialized in this graph: nothing to cross-check
        rec = fmap.record(flat)
        names = spellings.get(rec.fqn, set(rec.eager_names))
        if claimed in names or canonical_fqn(claimed) in names:
            continue
        if flatten_name(claimed) == flatten_name(rec.fqn):
            continue  # the meta's key is lossy here (a_b.c vs a.b_c); identity is the evidence
        raise CaptureMismatchError(
            f"captured name {flat!r}: tensor identity says {rec.fqn!r}, "
            f"gm.meta[{_DYNAMO_META!r}] says {claimed!r}"
        )


_SPEC_KIND = {"PARAMETER": TensorKind.parameter, "CONSTANT_TENSOR": TensorKind.constant}


def fill_from_exported_program(fmap, ep, model: nn.Module | None = None) -> None:
    """Fill ``fmap`` (an empty ``FQNMap``) with the names of a ``torch.export.ExportedProgram``
    from ``ep.graph_signature.input_specs``.

    Each PARAMETER / BUFFER / CONSTANT_TENSOR spec gives ``spec.target`` (the eager FQN) and
    ``spec.arg.name`` (the placeholder, e.g. ``p_enc_block_0_weight_0``). Values come from
    ``ep.state_dict`` or, for lifted constants, ``ep.constants``. Strict export drops tied aliases;
    pass the eager ``model`` to restore them: aliases are then added by tensor identity, and a
    target the model does not have raises.

    Raises:
        CaptureMismatchError: the signature names a target the model does not have.
    """
    from torch.export.graph_signature import InputKind

    eager = {t.fqn: t for t in eager_tensors(model)} if model is not None else {}
    # Every spelling the model has for a tensor (aliases, wrapper segments, parametrization paths)
    # -> its canonical eager FQN: export targets are the module's own names.
    alias_of = {n: t.fqn for t in eager.values() for n in [*t.aliases, *t.module_names]}
    by_id = {id(t.tensor): t.fqn for t in eager.values()}
    # Without a model, ep.state_dict holds the model's tensor objects: two targets naming one
    # object are aliases (non-strict export lifts a tied alias as its own placeholder).
    seen_ids: dict[int, str] = {}
    for spec in ep.graph_signature.input_specs:
        if spec.kind not in (InputKind.PARAMETER, InputKind.BUFFER, InputKind.CONSTANT_TENSOR):
            continue
        target = spec.target
        value = ep.state_dict.get(target)
        if value is None:
            value = ep.constants.get(target)
        if spec.kind == InputKind.BUFFER:
            kind = TensorKind.persistent_buffer if spec.persistent else TensorKind.non_persistent_buffer
        else:
            kind = _SPEC_KIND[spec.kind.name]
        fqn, aliases = target, []
        if model is not None and kind != TensorKind.constant:
            fqn = alias_of.get(target, target)
            if fqn not in eager:
                raise CaptureMismatchError(
                    f"export placeholder {spec.arg.name!r} targets {target!r}, which the model lacks"
                )
            # In-process export keeps the model's own tensor objects: identity must agree.
            if value is not None and id(value) in by_id and by_id[id(value)] != fqn:
                raise CaptureMismatchError(
                    f"export placeholder {spec.arg.name!r}: signature target {target!r} is "
                    f"{fqn!r} but the tensor object is the model's {by_id[id(value)]!r}"
                )
            aliases = list(eager[fqn].aliases)
        elif model is None and value is not None and seen_ids.get(id(value), fqn) != fqn:
            fqn = seen_ids[id(value)]
            fmap.add_alias(fqn, target)
        if model is None and value is not None:
            seen_ids.setdefault(id(value), fqn)
        # The target is a captured name too when it is not an eager name (wrapper / parametrization path).
        captured = [spec.arg.name] + (
            [target] if target not in (fqn, *aliases, *fmap_aliases(fmap, fqn)) else []
        )
        if fqn in fmap:
            for name in captured:
                fmap.add_captured(fqn, name)
            continue
        fmap.add(
            TensorRecord(
                fqn=fqn,
                aliases=aliases,
                captured=captured,
                kind=kind,
                shape=list(value.shape) if value is not None else [],
                dtype=dtype_name(value.dtype) if value is not None else "unknown",
                provenance=Provenance.export_signature,
            )
        )
    # Strict export drops a tied alias from the signature but keeps it in ep.state_dict.
    if model is None:
        for key, value in ep.state_dict.items():
            if key not in fmap and id(value) in seen_ids:
                fmap.add_alias(seen_ids[id(value)], key)
    # Tensors the graph never used (or strict export dropped) still belong to the model.
    for fqn, t in eager.items():
        if fqn not in fmap:
            fmap.add(
                TensorRecord(
                    fqn=fqn,
                    aliases=list(t.aliases),
                    kind=t.kind,
                    shape=list(t.tensor.shape),
                    dtype=dtype_name(t.tensor.dtype),
                    provenance=Provenance.rule,
                )
            )


def fmap_aliases(fmap, fqn: str) -> list[str]:
    return list(fmap.record(fqn).aliases) if fqn in fmap else []


__all__ = ["fill_from_capture", "fill_from_exported_program", "graph_input_tensors", "UnknownNameError"]
