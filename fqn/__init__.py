"""fqn: the naming layer of fqnckpt. Maps captured / wrapped tensor names to eager FQNs and back.

Pure naming: no module here imports torch's distributed package.
"""

import importlib

# Names are imported from their module on first use (PEP 562), so that the torch-free modules
# (``fqn.schema``, ``fqn.segments``) import without torch: ``fqnckpt inspect`` reads FQN maps
# without it.
_WHERE = {
    "eager": ("EagerTensor", "eager_tensors", "is_transparent_parametrization"),
    "errors": ("AmbiguousFQNError", "CaptureMismatchError", "FlatParamError", "FQNCollisionError", "FQNError",
               "UnknownNameError"),
    "registry": ("FQNMap", "dtype_name"),
    "schema": ("FQN_MAP_SCHEMA_VERSION", "FQNMapFile", "Provenance", "TensorKind", "TensorRecord"),
    "resolve": ("NameMatch", "Resolution", "match_names", "resolve", "resolve_report"),
    "rules": ("canonical_fqn", "flatten_name", "is_wrapper_module"),
    "segments": ("WRAPPER_SEGMENTS",),
}  # fmt: skip
_MODULE_OF = {name: mod for mod, names in _WHERE.items() for name in names}


def __getattr__(name: str):
    mod = _MODULE_OF.get(name)
    if mod is None:
        raise AttributeError(f"module 'fqn' has no attribute {name!r}")
    module = importlib.import_module(f".{mod}", __name__)
    # Bind every name of the module at once: importing fqn.resolve binds the submodule under the
    # name of its function ``resolve``, which must win, as it did with eager imports.
    globals().update({n: getattr(module, n) for n in _WHERE[mod]})
    return globals()[name]


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_MODULE_OF))


__all__ = [
    "FQNMap",
    "FQNMapFile",
    "TensorRecord",
    "TensorKind",
    "Provenance",
    "EagerTensor",
    "eager_tensors",
    "is_transparent_parametrization",
    "canonical_fqn",
    "resolve",
    "match_names",
    "resolve_report",
    "Resolution",
    "NameMatch",
    "flatten_name",
    "is_wrapper_module",
    "dtype_name",
    "WRAPPER_SEGMENTS",
    "FQN_MAP_SCHEMA_VERSION",
    "FQNError",
    "UnknownNameError",
    "AmbiguousFQNError",
    "FlatParamError",
    "CaptureMismatchError",
    "FQNCollisionError",
]
