"""The built-in recipes (``fqnckpt recipes`` lists them), each usable both ways.

Layouts and formulas: ``docs/guides/conversions.md``; names from transformers
``convert_llama_weights_to_hf.py`` (Meta), torchtitan ``b5bcd76`` state_dict adapters (Llama 3,
Qwen3, DeepSeek-V3), Megatron-Bridge ``param_mapping.py`` (GPT with fused ``linear_qkv`` /
``linear_fc1`` and Transformer Engine's fused ``layer_norm_weight``) and transformers
``pytorch_utils.Conv1D`` (GPT-2).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

from .ops import Chunk, PermuteQK, PermuteRope, PermuteRopeTail, Refuse, SplitQKV, Transpose, Unstack
from ..layout_versions import FUSED_QKV
from .rules import Recipe, Rule


def _layer_shift():
    from .layouts import LayerShift  # layouts imports rules, not recipes

    return LayerShift()

R = Rule
_L = "model.layers.{i}"


def _llama_body(permute: bool, q_tail: bool = False) -> tuple[Rule, ...]:
    q = (PermuteRope("n_heads"),) if permute else (PermuteRopeTail("n_heads"),) if q_tail else ()
    k = (PermuteRope("n_kv_heads"),) if permute else ()
    return (
        R("tok_embeddings.weight", "model.embed_tokens.weight", shard_dim=1),
        R("norm.weight", "model.norm.weight", shard_dim=None),
        R("output.weight", "lm_head.weight", shard_dim=0),
        R("layers.{i}.attention.wq.weight", f"{_L}.self_attn.q_proj.weight", q, shard_heads="n_heads"),
        R("layers.{i}.attention.wk.weight", f"{_L}.self_attn.k_proj.weight", k, shard_heads="n_kv_heads"),
        R("layers.{i}.attention.wv.weight", f"{_L}.self_attn.v_proj.weight", shard_heads="n_kv_heads"),
        R("layers.{i}.attention.wo.weight", f"{_L}.self_attn.o_proj.weight", shard_dim=1),
        R("layers.{i}.attention_norm.weight", f"{_L}.input_layernorm.weight", shard_dim=None),
        R("layers.{i}.ffn_norm.weight", f"{_L}.post_attention_layernorm.weight", shard_dim=None),
    )


def _dense_mlp(prefix: str = "feed_forward") -> tuple[Rule, ...]:
    return (
        R(f"layers.{{i}}.{prefix}.w1.weight", f"{_L}.mlp.gate_proj.weight", shard_dim=0),
        R(f"layers.{{i}}.{prefix}.w3.weight", f"{_L}.mlp.up_proj.weight", shard_dim=0),
        R(f"layers.{{i}}.{prefix}.w2.weight", f"{_L}.mlp.down_proj.weight", shard_dim=1),
    )


META_LLAMA = Recipe(
    "meta-llama-to-hf", "hf-to-meta-llama", _llama_body(True) + _dense_mlp(),
    drop=("rope.freqs",), writes="hf-model", reads="meta",
    summary="Meta consolidated.NN.pth (+ params.json) <-> HF Llama; Q/K rows RoPE-permuted, shards joined",
)  # fmt: skip

_QKV = ("layers.{i}.attention.wq.weight", "layers.{i}.attention.wk.weight", "layers.{i}.attention.wv.weight")


def _qkv_forms(rules: tuple[Rule, ...]) -> tuple[Rule, ...]:
    """torchtitan Llama's attention in both forms: the separate ``wq`` / ``wk`` / ``wv`` rules
    (``separate-qkv``), and the fused ``qkv_linear.wqkv`` (``fused-qkv``; FusedQKVLinear, pytorch/
    torchtitan ad7a865 #2878: per KV group ``[q heads of the group; k; v]``, the layout its
    ``_merge_qkv_on_load`` builds) split, then Q / K RoPE-permuted as the separate rules do."""
    from dataclasses import replace

    separate = tuple(replace(r, only="separate-qkv") if r.sources[0] in _QKV else r for r in rules)
    fused = R("layers.{i}.attention.qkv_linear.wqkv.weight", tuple(f"{_L}.self_attn.{p}_proj.weight" for p in "qkv"),
              (SplitQKV(), PermuteQK(True)), only=FUSED_QKV)  # fmt: skip
    return separate + (fused,)


TORCHTITAN_LLAMA3 = Recipe(
    "torchtitan-llama3-to-hf", "hf-to-torchtitan-llama3", _qkv_forms(_llama_body(True)) + _dense_mlp(),
    writes="hf-model", summary="torchtitan Llama 3 <-> HF Llama; Q/K rows RoPE-permuted",
    meta={"family": "torchtitan", "tied": (("output.weight", "tok_embeddings.weight"),)},
)  # fmt: skip

_WQ_A = "layers.{i}.attention.wq_a.weight"
# Models whose transformers class reads a routing bias (DeepSeek-V3, GLM-4-MoE) have shared experts;
# Qwen3-MoE has neither: the layer's shared expert tells them apart.
_SHARED = "layers.{i}.moe.shared_experts.w1.weight"
TORCHTITAN_MOE = Recipe(
    "torchtitan-moe-to-hf", "hf-to-torchtitan-moe",
    _llama_body(False, q_tail=True) + _dense_mlp() + (
        # Qwen3: per-head Q / K norms
        R("layers.{i}.attention.q_norm.weight", f"{_L}.self_attn.q_norm.weight", when_absent=_WQ_A),
        R("layers.{i}.attention.k_norm.weight", f"{_L}.self_attn.k_norm.weight"),
        # DeepSeek-V3 multi-head latent attention (torchtitan deepseek_v3 state_dict_adapter:
        # renames only; wq alone when q_lora_rank is 0, else wq_a / q_norm / wq_b). torchtitan
        # rotates adjacent pairs (ComplexRoPE), as HF does under rope_interleave (its default); an
        # HF config with rope_interleave false rotates halves: then the RoPE rows of wq / wq_b
        # (per head) and of wkv_a (k_pe) are permuted, which torchtitan's adapter does not do.
        R(_WQ_A, f"{_L}.self_attn.q_a_proj.weight"),
        R("layers.{i}.attention.q_norm.weight", f"{_L}.self_attn.q_a_layernorm.weight", when_present=_WQ_A),
        R("layers.{i}.attention.wq_b.weight", f"{_L}.self_attn.q_b_proj.weight", (PermuteRopeTail("n_heads"),)),
        R("layers.{i}.attention.wkv_a.weight", f"{_L}.self_attn.kv_a_proj_with_mqa.weight", (PermuteRopeTail(None),)),
        R("layers.{i}.attention.kv_norm.weight", f"{_L}.self_attn.kv_a_layernorm.weight"),
        # DeepSeek-V3 multi-token prediction (mtp_layers.{j} = HF layer n_layers + j: LayerShift)
        R("layers.{i}.enorm.weight", f"{_L}.enorm.weight"),
        R("layers.{i}.hnorm.weight", f"{_L}.hnorm.weight"),
        R("layers.{i}.eh_proj.weight", f"{_L}.eh_proj.weight"),
        R("layers.{i}.mtp_norm.weight", f"{_L}.shared_head.norm.weight"),
        R("layers.{i}.attention.wkv_b.weight", f"{_L}.self_attn.kv_b_proj.weight"),
        R("layers.{i}.moe.router.gate.weight", f"{_L}.mlp.gate.weight", count_of=("e", 0)),
        # DeepSeek-V3's routing bias (GLM-4-MoE's too); Qwen3-MoE in transformers has none (torchtitan
        # keeps its load-balancing bias beside the router): refused by name there, +drop-expert-bias drops it.
        R("layers.{i}.moe.expert_bias", f"{_L}.mlp.gate.e_score_correction_bias", count_of=("e", 0), when_present=_SHARED),
        R("layers.{i}.moe.expert_bias", f"{_L}.mlp.gate.expert_bias", (Refuse(
            "torchtitan's moe.expert_bias of a layer without shared experts (Qwen3-MoE) has no place in transformers' "
            "model (DeepSeek-V3 / GLM-4-MoE read it as e_score_correction_bias; writing it there would be ignored): recipe 'torchtitan-moe-to-hf+drop-expert-bias' drops it"),), when_absent=_SHARED),
        R("layers.{i}.moe.experts.w1", f"{_L}.mlp.experts.{{*e}}.gate_proj.weight", (Unstack(0),)),
        R("layers.{i}.moe.experts.w3", f"{_L}.mlp.experts.{{*e}}.up_proj.weight", (Unstack(0),)),
        R("layers.{i}.moe.experts.w2", f"{_L}.mlp.experts.{{*e}}.down_proj.weight", (Unstack(0),)),
    ) + tuple(
        R(f"layers.{{i}}.moe.shared_experts.{w}.weight", f"{_L}.mlp.shared_experts.{p}.weight")
        for w, p in (("w1", "gate_proj"), ("w3", "up_proj"), ("w2", "down_proj"))
    ),
    writes="hf", pre=(_layer_shift(),), meta={"family": "torchtitan", "agree": (
        ("layers.{i}.moe.experts.w1", "layers.{i}.moe.experts.w3", None),  # gate / up: [E, F, D]
        ("layers.{i}.moe.experts.w1", "layers.{i}.moe.experts.w2", (0, 2, 1)),  # down: [E, D, F]
    ), "tied": (("output.weight", "tok_embeddings.weight"),)},
    summary="torchtitan Qwen3 / DeepSeek-V3 stacked experts <-> HF per-expert keys (router, expert bias)",
)  # fmt: skip

_ANY = "{h:(?:.+\\.)?}"  # any prefix ending in a dot, or none
GPT2 = Recipe(
    "gpt2-conv1d-to-linear", "linear-to-gpt2-conv1d",
    tuple(R(f"{_ANY}{m}.weight", f"{{h}}{m}.weight", (Transpose(0, 1),)) for m in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")),
    passthrough=True, drop=(f"{_ANY}attn.bias", f"{_ANY}attn.masked_bias"), reads="hf-model",
    summary="GPT-2 Conv1D weights (in, out) <-> nn.Linear (out, in); biases and the rest unchanged",
)  # fmt: skip

_D = "decoder.layers.{i}"
MEGATRON_GPT = Recipe(
    "megatron-gpt-to-hf", "hf-to-megatron-gpt",
    (
        R("embedding.word_embeddings.weight", "model.embed_tokens.weight"),
        R("decoder.final_layernorm.weight", "model.norm.weight"),
        R("output_layer.weight", "lm_head.weight"),
        R(f"{_D}.self_attention.linear_qkv.weight",
          tuple(f"{_L}.self_attn.{p}_proj.weight" for p in "qkv"), (SplitQKV(),)),
        R(f"{_D}.self_attention.linear_qkv.bias", tuple(f"{_L}.self_attn.{p}_proj.bias" for p in "qkv"), (SplitQKV(),)),
        R(f"{_D}.self_attention.linear_proj.weight", f"{_L}.self_attn.o_proj.weight"),
        R(f"{_D}.mlp.linear_fc1.weight", (f"{_L}.mlp.gate_proj.weight", f"{_L}.mlp.up_proj.weight"), (Chunk(0),)),
        R(f"{_D}.mlp.linear_fc2.weight", f"{_L}.mlp.down_proj.weight"),
        # Qwen3's per-head Q / K norms (Megatron-Bridge qwen3 bridge: q_layernorm / k_layernorm)
        R(f"{_D}.self_attention.q_layernorm.weight", f"{_L}.self_attn.q_norm.weight"),
        R(f"{_D}.self_attention.k_layernorm.weight", f"{_L}.self_attn.k_norm.weight"),
    ),
    writes="hf-model",
    summary="Megatron-core GPT (fused grouped-query linear_qkv, linear_fc1 = [gate; up], Qwen3 q / k layernorm) <-> HF Llama / Qwen3",
    # Norm names by Megatron's layer spec (Megatron-Bridge param_mapping / model bridges): Transformer
    # Engine fuses each pre-norm into the next linear; the local (non-TE) spec keeps separate modules.
    meta={"variants": {
        "te": (f"{_D}.self_attention.linear_qkv.layer_norm_weight", (
            R(f"{_D}.self_attention.linear_qkv.layer_norm_weight", f"{_L}.input_layernorm.weight"),
            R(f"{_D}.mlp.linear_fc1.layer_norm_weight", f"{_L}.post_attention_layernorm.weight"))),
        "local": (f"{_D}.input_layernorm.weight", (
            R(f"{_D}.input_layernorm.weight", f"{_L}.input_layernorm.weight"),
            R(f"{_D}.pre_mlp_layernorm.weight", f"{_L}.post_attention_layernorm.weight"))),
    }, "variant_family": "megatron", "default_variant": "te",
        # Megatron-Bridge builds the Megatron model from the HF config: config.json goes beside both ways
        "config_beside": True},
)  # fmt: skip

_STATIC = (META_LLAMA, TORCHTITAN_LLAMA3, TORCHTITAN_MOE, GPT2, MEGATRON_GPT)


def _experts(model: Any) -> Recipe:
    from .transformers_rules import experts_recipe  # transformers is optional

    return experts_recipe(model)


# The sources each recipe follows (repository, commit, file): what `fqnckpt recipes` names.
SOURCES: dict[str, str] = {
    "meta-llama-to-hf": "transformers convert_llama_weights_to_hf.py (permute, concat_dim by Llama version); "
                        "meta-llama/llama-models (VocabParallelEmbedding, apply_scaling)",
    "torchtitan-llama3-to-hf": "pytorch/torchtitan b5bcd76 torchtitan/models/llama3/state_dict_adapter.py "
                               "(+ the name history in checkpoint.layout_versions)",
    "torchtitan-moe-to-hf": "pytorch/torchtitan b5bcd76 torchtitan/models/{qwen3,deepseek_v3}/state_dict_adapter.py",
    "gpt2-conv1d-to-linear": "transformers pytorch_utils.Conv1D",
    "megatron-gpt-to-hf": "NVIDIA-NeMo/Megatron-Bridge param_mapping.py (QKVMapping, GatedMLPMapping) and the "
                          "qwen3 / llama bridges (q_layernorm, TE layer_norm_weight vs local norms)",
    "experts-to-fused": "transformers 5.24 conversion_mapping.get_model_conversion_mapping (the installed one, read at run time)",
}


class RecipeEntry(NamedTuple):
    """A built-in recipe: ``build(model)`` gives it in the named direction."""

    build: Callable[[Any], Recipe]
    needs_model: bool
    inverse: str
    summary: str


RECIPES: dict[str, RecipeEntry] = {}
for _r in _STATIC:
    RECIPES[_r.name] = RecipeEntry(lambda m, r=_r: r, False, _r.inverse_name, _r.summary)
    RECIPES[_r.inverse_name] = RecipeEntry(lambda m, r=_r: r.inverse(), False, _r.name, _r.summary)
_EXPERTS = "HF per-expert keys <-> transformers 5 fused experts, by the model's own conversion_mapping"
RECIPES["experts-to-fused"] = RecipeEntry(_experts, True, "fused-to-experts", _EXPERTS)
RECIPES["fused-to-experts"] = RecipeEntry(lambda m: _experts(m).inverse(), True, "experts-to-fused", _EXPERTS)


class RecipeError(ValueError):
    """Unknown recipe name, or one that needs ``model=`` without it."""


def get_recipe(name: str | Recipe, model: Any = None) -> Recipe:
    """The recipe called ``name`` (a :class:`Recipe` is returned as is).

    Raises:
        RecipeError: no such recipe (the known names listed), a quantization recipe (those convert
            whole checkpoints through ``checkpoint.migrate`` only), or it needs ``model=``.
    """
    if isinstance(name, Recipe):
        return name
    entry = RECIPES.get(name)
    if entry is None and name in QUANT_SUMMARIES:
        raise RecipeError(
            f"recipe {name!r} converts a whole checkpoint: checkpoint.migrate(src, dst, recipe={name!r}) "
            "or fqnckpt migrate --recipe; a load dequantizes FP8 / MXFP4 weights without a recipe"
        )
    if entry is None:
        raise RecipeError(f"unknown recipe {name!r}; known: {sorted([*RECIPES, *QUANT_SUMMARIES])}")
    if entry.needs_model and model is None:
        raise RecipeError(f"recipe {name!r} takes its rules from the target model: pass model= (--model)")
    return entry.build(model)


# Recipe options (``NAME+option``): what each changes in the recipe.
OPTIONS = {
    "drop-expert-bias": ("torchtitan-moe-to-hf", "layers.{i}.moe.expert_bias",
                         "drop torchtitan's MoE load-balancing bias (Qwen3-MoE in transformers has none)"),
}


def recipe_table() -> list[dict[str, Any]]:
    """``[{name, inverse, needs_model, summary, source, versions, options}]`` of the built-in
    recipes: ``source`` the code (repository, commit, file) each follows, ``versions`` the layout
    versions a name takes after ``@`` (the first read by detection, the last written by default),
    ``options`` what ``+option`` adds."""
    from ..layout_versions import FAMILIES
    from .layouts import META_VERSIONS

    def versions(name: str, e) -> list[str]:
        if e.needs_model:  # its rules come from the model (transformers): no layout versions
            return []
        rec = e.build(None)
        fwd = rec.meta.get("inverse_of", rec)
        if "meta" in (rec.reads, rec.writes):
            return [v for v, _ in META_VERSIONS]
        if fwd.meta.get("variants"):
            return sorted(fwd.meta["variants"])
        fam = FAMILIES.get(fwd.meta.get("family", ""))
        fused = [FUSED_QKV] if any(r.only == FUSED_QKV for r in fwd.rules) else []
        return [v for v, _, _ in fam.versions] + fused if fam else []

    return [{"name": n, "inverse": e.inverse, "needs_model": e.needs_model, "summary": e.summary,
             "source": SOURCES.get(n) or SOURCES.get(e.inverse, ""), "versions": versions(n, e),
             "options": sorted(o for o, (r, _, _) in OPTIONS.items() if r == n)} for n, e in RECIPES.items()] + recipe_rows()  # fmt: skip


# The quantization recipes (checkpoint.convert.quant_recipes, which needs torch) as data, so that
# listing them imports no torch.
QUANT_SUMMARIES = {
    "dequantize-bf16": ("quantize-fp8", "FP8 128x128-block and MXFP4 weights to bfloat16; config.json without quantization_config"),
    "dequantize-fp32": ("quantize-fp8", "FP8 128x128-block and MXFP4 weights to float32; config.json without quantization_config"),
    "quantize-fp8": ("dequantize-bf16", "2-D linear weights to float8_e4m3fn 128x128 blocks with weight_scale_inv (amax / 448)"),
}
QUANT_SOURCES = {
    "dequantize-bf16": "deepseek-ai/DeepSeek-V3 inference/fp8_cast_bf16.py; torch quantized_hf_storage.py; "
                       "transformers integrations/mxfp4.py",
    "quantize-fp8": "deepseek-ai/DeepSeek-V3 inference/kernel.py (weight_quant); transformers integrations/finegrained_fp8.py",
}


def recipe_rows() -> list[dict[str, Any]]:
    """The rows of these recipes in ``fqnckpt recipes`` (:func:`recipe_table`; their code: :mod:`checkpoint.convert.quant_recipes`)."""
    return [{"name": n, "inverse": inv, "needs_model": False, "summary": summary,
             "source": QUANT_SOURCES.get(n, QUANT_SOURCES["dequantize-bf16"]), "versions": [], "options": []}
            for n, (inv, summary) in QUANT_SUMMARIES.items()]  # fmt: skip


__all__ = ["FUSED_QKV", "OPTIONS", "recipe_table", "RECIPES", "RecipeError", "get_recipe", "META_LLAMA", "TORCHTITAN_LLAMA3", "TORCHTITAN_MOE", "GPT2", "MEGATRON_GPT"]
