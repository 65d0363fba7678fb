"""Framework layouts as versioned data: how a framework's key names changed over time, which
version a checkpoint is (detected from its keys), and the renames between a version and the
canonical names the recipes' rules are written in.

torchtitan (read from ``pytorch/torchtitan`` ``torchtitan/models/{llama3,qwen3,deepseek_v3}/
state_dict_adapter.py`` and the models at each commit named; newest stored: ``b5bcd76``,
2026-08-21). The rules of ``torchtitan-*`` recipes use the ``legacy`` names; each later version
respells some of them:

=========  ==========  ======================================================================
version    date        names changed (cumulative)
=========  ==========  ======================================================================
legacy     before      ``output.weight``, ``attention.{wq,wk,wv}.weight``, ``moe.experts.w1`` /
           2026-04-27  ``w3`` / ``w2``, ``moe.expert_bias``
786e26f    2026-04-27  ``lm_head.weight`` (ChunkedCELoss, #2937)
200100e    2026-05-27  ``moe.experts.w1_EFD`` / ``w3_EFD`` / ``w2_EDF``, ``moe.expert_bias_E``
                       (shape suffixes, #3425; the adapter caught up in 2816b97, #3626)
70dd945    2026-06-19  ``attention.qkv_linear.{wq,wk,wv}.weight`` (FusedQKVLinear, #3656;
                       grouped-query attention only: DeepSeek-V3's MLA keeps ``attention.wq``)
3101b42    2026-07-16  ``moe.routed_experts.inner_experts.*`` (#3859); current at b5bcd76
=========  ==========  ======================================================================

Across versions, torchtitan's ``FusedQKVLinear`` (ad7a865, 2026-04-16, #2878; the Llama 3 default
from 3396a4b, #3714) keeps one ``attention.qkv_linear.wqkv.weight`` per layer; from 70dd945 its
state_dict hooks save it split, but a state dict taken without them still holds it. The recipes
read it wherever it is and write it as version ``fused-qkv`` (the newest names otherwise):
:data:`FUSED_QKV_KEY`.
"""

from __future__ import annotations

from dataclasses import dataclass

from .keypatterns import Pattern


@dataclass(frozen=True)
class Respell:
    """Rename keys matching ``frm`` to ``to`` (both :class:`~checkpoint.convert.rules.Pattern`
    texts sharing placeholders). ``requires``: a pattern (formatted with the match) that must be
    among the keys for the rename to apply (torchtitan's ``qkv_linear.wq`` only beside a ``wk``);
    ``back_requires`` the same for the inverse."""

    frm: str
    to: str
    requires: str | None = None
    back_requires: str | None = None

    def apply_in(self, key: str, present) -> str:
        values = Pattern(self.frm).match(key)
        if values is None:
            return key
        if self.requires is not None and Pattern(self.requires).format(values) not in present:
            return key
        return Pattern(self.to).format(values)

    def apply(self, key: str) -> str:
        return self.apply_in(key, frozenset()) if self.requires is None else key

    def inverse(self) -> Respell:
        return Respell(self.to, self.frm, self.back_requires, self.requires)

    def describe(self) -> str:
        return f"{self.frm} -> {self.to}"


@dataclass(frozen=True)
class Axis:
    """One name that changed: its spellings, each ``(pattern, first version)`` in order; the first
    spelling is the canonical one. ``detect``: patterns of the canonical spelling that tell the
    version apart (a name another layout shares is left out: DeepSeek's ``attention.wq``)."""

    name: str
    spellings: tuple[tuple[tuple[str, ...], str], ...]
    requires: tuple[str | None, ...] = ()


@dataclass(frozen=True)
class Family:
    """A framework's versions (oldest first), with their dates and sources, and the axes."""

    name: str
    versions: tuple[tuple[str, str, str], ...]  # (version, date, source)
    axes: tuple[Axis, ...]
    # key prefixes only this family's names have: ``detect_layout`` names the family only when a key
    # starts with one (HF Llama's ``lm_head.weight`` alone is no torchtitan evidence)
    own_prefixes: tuple[str, ...] = ()

    @property
    def newest(self) -> str:
        return self.versions[-1][0]

    def index(self, version: str) -> int:
        for i, (v, _, _) in enumerate(self.versions):
            if v == version:
                return i
        raise KeyError(version)

    def respells(self, version: str) -> tuple[Respell, ...]:
        """Canonical names -> ``version``'s."""
        at = self.index(version)
        out = []
        for ax in self.axes:
            chosen = None
            for pats, since in ax.spellings:
                if self.index(since) <= at:
                    chosen = pats
            canon = ax.spellings[0][0]
            if chosen is not canon:
                reqs = ax.requires or (None,) * len(canon)
                out += [Respell(c, v, r) for c, v, r in zip(canon, chosen, reqs)]
        return tuple(out)

    def detect(self, keys) -> tuple[list[str], list[str]]:
        """``(versions consistent with every key, evidence)``; evidence names one key per axis."""
        ok = set(range(len(self.versions)))
        evidence = []
        for ax in self.axes:
            for j, (pats, since) in enumerate(ax.spellings):
                reqs = ax.requires or (None,) * len(pats)
                # detect by the names that need nothing beside them (wk / wv, not wq)
                compiled = [Pattern(p) for p, r in zip(pats, reqs) if r is None]
                hit = next((k for k in keys if any(c.match(k) is not None for c in compiled)), None)
                if hit is None:
                    continue
                lo = self.index(since)
                hi = self.index(ax.spellings[j + 1][1]) if j + 1 < len(ax.spellings) else len(self.versions)
                ok &= set(range(lo, hi))
                evidence.append(f"{hit!r} ({ax.name} as of {since})")
        return [self.versions[i][0] for i in sorted(ok)], evidence


_I = "layers.{i}"
TORCHTITAN = Family(
    "torchtitan",
    versions=(
        ("legacy", "before 2026-04-27", "torchtitan before 786e26f"),
        ("786e26f", "2026-04-27", "pytorch/torchtitan 786e26f (ChunkedCELoss #2937): lm_head.weight"),
        ("200100e", "2026-05-27", "pytorch/torchtitan 200100e (#3425) / 2816b97 (#3626): w1_EFD / w3_EFD / w2_EDF, expert_bias_E"),
        ("70dd945", "2026-06-19", "pytorch/torchtitan 70dd945 (#3656): attention.qkv_linear"),
        ("3101b42", "2026-07-16", "pytorch/torchtitan 3101b42 (#3859): moe.routed_experts.inner_experts; current at b5bcd76"),
    ),
    axes=(
        Axis("output", ((("output.weight",), "legacy"), (("lm_head.weight",), "786e26f"))),
        Axis("experts", (
            ((f"{_I}.moe.experts.{{w:w1|w3}}", f"{_I}.moe.experts.{{w:w2}}"), "legacy"),
            ((f"{_I}.moe.experts.{{w}}_EFD", f"{_I}.moe.experts.{{w}}_EDF"), "200100e"),
            ((f"{_I}.moe.routed_experts.inner_experts.{{w}}_EFD", f"{_I}.moe.routed_experts.inner_experts.{{w}}_EDF"), "3101b42"),
        )),  # fmt: skip
        Axis("expert_bias", (((f"{_I}.moe.expert_bias",), "legacy"), ((f"{_I}.moe.expert_bias_E",), "200100e"))),
        Axis("qkv", (
            ((f"{_I}.attention.{{w:wk|wv}}.weight", f"{_I}.attention.wq.weight"), "legacy"),
            ((f"{_I}.attention.qkv_linear.{{w:wk|wv}}.weight", f"{_I}.attention.qkv_linear.wq.weight"), "70dd945"),
        ), requires=(None, f"{_I}.attention.wk.weight")),  # fmt: skip
    ),
    own_prefixes=("tok_embeddings.", "layers.", "norm.", "output."),  # torchtitan's unprefixed module names
)

FAMILIES = {"torchtitan": TORCHTITAN}
FUSED_QKV_KEY = f"{_I}.attention.qkv_linear.wqkv.weight"
FUSED_QKV = "fused-qkv"  # the version name of that form (the newest names otherwise)


def detect_layout(keys) -> str | None:
    """The framework layout (and version) the key names say, or None: ``"torchtitan 3101b42"``
    (a range ``"torchtitan legacy..786e26f"`` when no name tells the versions apart), Meta /
    torchtitan legacy Llama, Megatron with or without Transformer Engine names, Hugging Face
    per-expert or fused (transformers 5) experts. Names only: Meta's Llama 2 / Llama 3
    model-parallel splits differ by shapes (``conversion_report.json`` of a conversion says which)."""
    keys = list(keys)
    for fam in FAMILIES.values():
        if fam.own_prefixes and not any(k.startswith(fam.own_prefixes) for k in keys):
            continue
        fits, evidence = fam.detect(keys)
        fused = " (fused attention.qkv_linear.wqkv)" if any(Pattern(FUSED_QKV_KEY).match(k) is not None for k in keys) else ""
        if evidence and fits:
            return (f"{fam.name} {fits[0]}" if len(fits) == 1 else f"{fam.name} {fits[0]}..{fits[-1]}") + fused
    ks = set(keys)
    if any(k.endswith(".self_attention.linear_qkv.layer_norm_weight") for k in keys):
        return "megatron te (Transformer Engine fused norms)"
    if any(k.startswith("decoder.layers.") and k.endswith(".input_layernorm.weight") for k in keys):
        return "megatron local (non-TE norm names)"
    if any(k.endswith(".mlp.experts.gate_up_proj") for k in keys):
        return "hf fused-experts (transformers 5)"
    if any(".mlp.experts.0." in k or ".block_sparse_moe.experts.0." in k for k in keys):  # Mixtral's own name
        return "hf per-expert"
    if "tok_embeddings.weight" in ks and any(k.endswith(".attention.wq.weight") for k in keys):
        return "meta / torchtitan legacy"
    return None


def version_table() -> list[dict[str, str]]:
    """``[{family, version, date, source}]`` of every layout version known."""
    return [{"family": f.name, "version": v, "date": d, "source": s} for f in FAMILIES.values() for v, d, s in f.versions]


__all__ = ["FUSED_QKV", "FUSED_QKV_KEY", "Respell", "Axis", "Family", "FAMILIES", "TORCHTITAN", "detect_layout", "version_table"]
