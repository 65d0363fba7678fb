"""checkpoint.convert: every built-in recipe proven against the real model code (transformers'
LlamaForCausalLM, Qwen3MoeForCausalLM, MixtralForCausalLM, GPT2LMHeadModel) or a reference forward
written from the formulas (tests/conversion_refs.py): logits within 1e-5 (float32), 20 greedy
tokens identical, and A -> B -> A bit-identical (torch.equal)."""

from __future__ import annotations

import json
import warnings

import pytest
import torch

import checkpoint
from checkpoint.convert import ConversionError, ConversionReport, RecipeError
from checkpoint.sources import open_source
from tests import conversion_refs as refs
from tests.helpers import assert_same_state

transformers = pytest.importorskip("transformers")
warnings.filterwarnings("ignore", message=".*bos_token_id.*|.*eos_token_id.*")

H, NH, NKV, FF, V, L = 32, 4, 2, 64, 61, 2


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny matmuls: one intra-op thread is ~30x faster than two on a shared 2-core machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
PROMPT = torch.tensor([[3, 17, 5, 42, 8, 1]])


def read(path) -> dict[str, torch.Tensor]:
    with open_source(path) as s:
        return {k: s.get(k).clone() for k in s.keys()}


def randomize(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Weights large enough that logits are far from ties (argmax stable under 1e-6 noise)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or ".ln_" in name or name.endswith("ln_f.weight"):
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
    return model.eval()


def assert_same_model(ref_fn, hf_model):
    """Logits within 1e-5 on the prompt and the same 20 greedy tokens."""
    with torch.no_grad():
        want, got = ref_fn(PROMPT), hf_model(PROMPT).logits
        assert want.abs().max() > 1.0  # not a degenerate model
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
        hf_fn = lambda ids: hf_model(ids).logits  # noqa: E731
        assert refs.greedy(hf_fn, PROMPT) == refs.greedy(ref_fn, PROMPT)


def llama_config(vocab=V):
    return transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=H, intermediate_size=FF, num_hidden_layers=L, num_attention_heads=NH,
        num_key_value_heads=NKV, rms_norm_eps=1e-5, max_position_embeddings=64, tie_word_embeddings=False,
    )  # fmt: skip


def meta_state_dict(seed=0, vocab=V) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: 0.3 * torch.randn(*s, generator=g)  # noqa: E731
    hd = H // NH
    sd = {"tok_embeddings.weight": r(vocab, H), "norm.weight": 1 + 0.1 * r(H), "output.weight": r(vocab, H)}
    for i in range(L):
        p = f"layers.{i}."
        sd |= {p + "attention.wq.weight": r(NH * hd, H), p + "attention.wk.weight": r(NKV * hd, H),
               p + "attention.wv.weight": r(NKV * hd, H), p + "attention.wo.weight": r(H, NH * hd),
               p + "feed_forward.w1.weight": r(FF, H), p + "feed_forward.w3.weight": r(FF, H),
               p + "feed_forward.w2.weight": r(H, FF), p + "attention_norm.weight": 1 + 0.1 * r(H),
               p + "ffn_norm.weight": 1 + 0.1 * r(H)}  # fmt: skip
    return sd


def meta_shards(sd, n, version="llama2") -> list[dict[str, torch.Tensor]]:
    """Split like Meta's model-parallel checkpoints (conversions.md: Q/K/V, w1, w3, output on
    dim 0; wo, w2 on dim 1; tok_embeddings on dim 1 in Llama 2 (ParallelEmbedding), on dim 0 in
    Llama 3 (VocabParallelEmbedding: transformers' converter's concat_dim); norms replicated)."""
    dim1 = ("attention.wo.weight", "feed_forward.w2.weight") + (("tok_embeddings.weight",) if version == "llama2" else ())
    out = [{} for _ in range(n)]
    for k, v in sd.items():
        if v.dim() == 1:
            parts = [v.clone() for _ in range(n)]
        else:
            parts = v.chunk(n, 1 if k.endswith(dim1) else 0)
        for s, t in zip(out, parts):
            s[k] = t.clone()
    return out


PARAMS = {"dim": H, "n_layers": L, "n_heads": NH, "n_kv_heads": NKV, "vocab_size": V, "norm_eps": 1e-5, "rope_theta": 10000.0}


@pytest.mark.parametrize("shards", [1, 2])
def test_meta_llama_to_hf_logits_and_round_trip(tmp_path, shards):
    vocab = V + V % shards  # Meta's parallel layers split evenly (uneven shards: refused below)
    sd = meta_state_dict(vocab=vocab)
    src = tmp_path / "meta"
    src.mkdir()
    for i, part in enumerate(meta_shards(sd, shards)):
        torch.save(part | {"rope.freqs": torch.zeros(4)}, src / f"consolidated.{i:02d}.pth")
    (src / "params.json").write_text(json.dumps(PARAMS | {"vocab_size": vocab}))
    target = transformers.LlamaForCausalLM(llama_config(vocab))
    rep = checkpoint.migrate(src, tmp_path / "hf", recipe="meta-llama-to-hf", model=target)
    assert isinstance(rep, ConversionReport) and rep.written and rep.shards == shards
    assert rep.dropped == ["rope.freqs"] and rep.dims["n_heads"] == NH and rep.dims["n_kv_heads"] == NKV
    assert {u.rule.split(" ")[0]: u.groups for u in rep.rules}["layers.{i}.attention.wq.weight"] == L
    hf = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf").eval()  # config.json written
    assert_same_model(lambda ids: refs.meta_llama_logits(sd, NH, NKV, ids), hf)
    # back to Meta's names: bit-identical, in as many shards as it came from (the forward's report)
    checkpoint.migrate(tmp_path / "hf", tmp_path / "back", recipe="hf-to-meta-llama", model=hf)
    back = load_meta_dir(tmp_path / "back")
    assert len(back) == shards
    assert_same_state(join_meta_shards(back), sd)
    assert json.loads((tmp_path / "back" / "params.json").read_text())["n_kv_heads"] == NKV


def join_meta_shards(parts, version="llama2") -> dict[str, torch.Tensor]:
    """The test's own join of Meta shards (inverse of meta_shards)."""
    dim1 = ("attention.wo.weight", "feed_forward.w2.weight") + (("tok_embeddings.weight",) if version == "llama2" else ())
    return {k: parts[0][k] if v.dim() == 1 else torch.cat([p[k] for p in parts], 1 if k.endswith(dim1) else 0)
            for k, v in parts[0].items()}  # fmt: skip


def load_meta_dir(path) -> list[dict[str, torch.Tensor]]:
    names = sorted(p.name for p in path.glob("consolidated.*.pth"))
    assert names == [f"consolidated.{i:02d}.pth" for i in range(len(names))]
    return [torch.load(path / n, weights_only=True) for n in names]


@pytest.mark.parametrize("shards, version", [(1, "llama3"), (2, "llama2"), (2, "llama3")])
def test_hf_to_meta_llama_writes_consolidated_shards(tmp_path, shards, version):
    """hf-to-meta-llama writes Meta's own files: consolidated.NN.pth (plain dicts, own storages)
    and params.json; Meta -> HF -> Meta with the same shards is bit-identical, file by file."""
    from checkpoint.convert.catalog import MetaParams, meta_ffn_dim

    sd = meta_state_dict(9, vocab=V + 1)  # an even vocabulary: Meta's output splits on it
    params = PARAMS | {"vocab_size": V + 1}
    src = tmp_path / "meta"
    src.mkdir()
    parts = meta_shards(sd, shards, version)
    for i, part in enumerate(parts):
        torch.save(part | {"rope.freqs": torch.zeros(4)}, src / f"consolidated.{i:02d}.pth")
    (src / "params.json").write_text(json.dumps(params))
    hf = transformers.LlamaForCausalLM(llama_config(V + 1)).eval()
    fwd = checkpoint.migrate(src, tmp_path / "hf", recipe="meta-llama-to-hf", model=hf)
    if shards > 1:  # detected from the shards' embedding widths
        assert fwd.layouts == {"source": f"meta {version}"}
    checkpoint.load(hf, tmp_path / "hf")
    # No model: dims and params.json come from the HF dir's config.json; the split and the shard
    # count are the ones the forward conversion read (its conversion_report.json).
    rep = checkpoint.migrate(tmp_path / "hf", tmp_path / "back", recipe="hf-to-meta-llama")
    assert rep.layouts == {"target": f"meta {version}"}
    assert rep.written and rep.dims["n_kv_heads"] == NKV
    back = load_meta_dir(tmp_path / "back")
    assert len(back) == shards
    for got, want in zip(back, parts, strict=True):
        assert_same_state(got, want)
        assert all(t.untyped_storage().nbytes() == t.nbytes for t in got.values())  # cloned, no base
    got = MetaParams.model_validate_json((tmp_path / "back" / "params.json").read_bytes())
    assert got.model_dump(include=set(params)) == params
    assert meta_ffn_dim(got.dim, got.multiple_of, got.ffn_dim_multiplier) == FF
    assert_same_model(lambda ids: refs.meta_llama_logits(join_meta_shards(back, version), NH, NKV, ids), hf)


def test_meta_llama2_round_trip_comes_back_in_llama2_split_without_asking(tmp_path):
    """Meta Llama 2 (2 shards, tok_embeddings split on dim 1) -> HF (no model: config.json from
    params.json) -> Meta with no version and no shard count: Llama 2's split, the same bytes file by
    file. The version is recorded twice: the forward's conversion_report.json and config.json
    (which transformers keeps through save_pretrained); without either, the config's vocabulary
    and rope_theta say Llama 1 / 2 or 3."""
    from checkpoint.convert.api import meta_version_from_config
    from checkpoint.convert.catalog import HFTextConfig

    sd = meta_state_dict(4, vocab=V + 1)
    src = tmp_path / "meta"
    src.mkdir()
    parts = meta_shards(sd, 2, "llama2")
    for i, part in enumerate(parts):
        torch.save(part, src / f"consolidated.{i:02d}.pth")
    (src / "params.json").write_text(json.dumps(PARAMS | {"vocab_size": V + 1}))
    fwd = checkpoint.migrate(src, tmp_path / "hf", recipe="meta-llama-to-hf")
    assert fwd.layouts == {"source": "meta llama2"}
    rep = checkpoint.migrate(tmp_path / "hf", tmp_path / "back", recipe="hf-to-meta-llama")
    assert rep.layouts == {"target": "meta llama2"} and rep.dims["shards"] == 2
    assert any("conversion_report.json" in c and "meta llama2" in c for c in rep.checks)
    for got, want in zip(load_meta_dir(tmp_path / "back"), parts, strict=True):  # torch.save's zip holds a random id
        assert_same_state(got, want)
    assert json.loads((tmp_path / "back" / "params.json").read_text()) == json.loads((src / "params.json").read_text())
    # config.json alone (the report gone, as after save_pretrained elsewhere) still says llama2
    (tmp_path / "hf" / "conversion_report.json").unlink()
    rep = checkpoint.migrate(tmp_path / "hf", tmp_path / "back2", recipe="hf-to-meta-llama", dims={"shards": 2})
    assert rep.layouts == {"target": "meta llama2"}
    assert_same_state(load_meta_dir(tmp_path / "back2")[1], parts[1])
    # from the config's vocabulary and rope_theta alone
    llama2 = HFTextConfig.of({"vocab_size": 32000, "rope_theta": 10000.0, "model_type": "llama"})
    llama3 = HFTextConfig.of({"vocab_size": 128256, "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0}})
    assert meta_version_from_config(llama2)[0] == "llama2" and meta_version_from_config(llama3)[0] == "llama3"
    assert meta_version_from_config(HFTextConfig.of({"vocab_size": V, "rope_theta": 10000.0}))[0] is None


def test_hf_to_meta_llama_cli_shards_refusal_and_overwrite(tmp_path, capsys):
    from checkpoint.cli.main import main

    hf = randomize(transformers.LlamaForCausalLM(llama_config(64)), 10)
    checkpoint.save(hf, tmp_path / "hf")  # config.json beside the shards
    assert main(["migrate", str(tmp_path / "hf"), str(tmp_path / "meta"), "--recipe", "hf-to-meta-llama", "--dim", "shards=2"]) == 0
    parts = load_meta_dir(tmp_path / "meta")
    assert len(parts) == 2 and parts[0]["layers.0.attention.wk.weight"].shape == (NKV * 8 // 2, H)
    assert parts[0]["tok_embeddings.weight"].shape == (32, H)  # Llama 3's vocabulary split by default
    assert_same_model(lambda ids: refs.meta_llama_logits(join_meta_shards(parts, "llama3"), NH, NKV, ids), hf)
    assert not (tmp_path / "meta" / ".spill").exists()  # the writer's spill files are gone
    # inspect / verify read the shard directory as migrate does, and say how to join it
    for cmd in ("inspect", "verify"):
        capsys.readouterr()
        assert main([cmd, str(tmp_path / "meta")]) == 0
        out = capsys.readouterr().out
        assert "meta-shards" in out and "consolidated.01.pth" in out, out
    assert "layout: meta llama3 (2 model-parallel shards)" in (main(["inspect", str(tmp_path / "meta")]), capsys.readouterr().out)[1]
    # 4 shards cannot hold whole K/V heads (n_kv_heads=2): refused by key, nothing written.
    before = sorted(p.name for p in tmp_path.iterdir())
    with pytest.raises(ConversionError) as e:
        checkpoint.migrate(tmp_path / "hf", tmp_path / "four", recipe="hf-to-meta-llama", dims={"shards": 4})
    bad = {k for p in e.value.report.problems for k in p.keys}
    assert bad == {f"model.layers.{i}.self_attn.{p}_proj.weight" for i in range(L) for p in "kv"}
    assert "n_kv_heads=2 heads do not split in 4 shards" in str(e.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == before
    # A write failing on the second shard commits nothing (staged, then removed).
    real_save = torch.save

    def fail_second(obj, f, *a, **k):
        if str(f).endswith("consolidated.01.pth"):
            raise OSError("disk full")
        return real_save(obj, f, *a, **k)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch, "save", fail_second)
        with pytest.raises(OSError, match="disk full"):
            checkpoint.migrate(tmp_path / "hf", tmp_path / "half", recipe="hf-to-meta-llama", dims={"shards": 2})
    assert sorted(p.name for p in tmp_path.iterdir()) == before
    # Overwriting a 2-shard Meta dir with one shard leaves no stale consolidated.01.pth: the first
    # save's record (.fqnckpt-record.json) named it; a user's file beside them stays.
    written = ["consolidated.00.pth", "consolidated.01.pth", "conversion_report.json", "params.json"]
    assert json.loads((tmp_path / "meta" / ".fqnckpt-record.json").read_text())["objects"] == written
    (tmp_path / "meta" / "tokenizer.model").write_bytes(b"mine")
    checkpoint.migrate(tmp_path / "hf", tmp_path / "meta", recipe="hf-to-meta-llama", overwrite=True)
    assert sorted(p.name for p in (tmp_path / "meta").iterdir()) == [
        ".fqnckpt-record.json", "consolidated.00.pth", "conversion_report.json", "params.json", "tokenizer.model"]
    assert_same_state(load_meta_dir(tmp_path / "meta")[0], join_meta_shards(parts, "llama3"))


def test_torchtitan_llama3_round_trip_from_hf(tmp_path):
    hf = randomize(transformers.LlamaForCausalLM(llama_config()), 1)
    checkpoint.save(hf, tmp_path / "hf")
    rep = checkpoint.migrate(tmp_path / "hf", tmp_path / "tt", recipe="hf-to-torchtitan-llama3", model=hf)
    raw = read(tmp_path / "tt")  # today's torchtitan names by default
    assert {"layers.0.attention.qkv_linear.wq.weight", "lm_head.weight"} <= set(raw) and rep.layouts == {"target": "torchtitan 3101b42"}
    tt = refs.titan_legacy(raw)
    assert "layers.0.attention.wq.weight" in tt
    assert_same_model(lambda ids: refs.meta_llama_logits(tt, NH, NKV, ids), hf)
    checkpoint.migrate(tmp_path / "tt", tmp_path / "back", recipe="torchtitan-llama3-to-hf", model=hf)
    assert_same_state(read(tmp_path / "back"), read(tmp_path / "hf"))
    fresh = transformers.LlamaForCausalLM(llama_config()).eval()
    checkpoint.load(fresh, tmp_path / "back")
    assert_same_model(lambda ids: refs.meta_llama_logits(tt, NH, NKV, ids), fresh)


def qwen3_moe(seed=2):
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=V, hidden_size=H, intermediate_size=FF, moe_intermediate_size=16, num_hidden_layers=L,
        num_attention_heads=NH, num_key_value_heads=NKV, head_dim=8, num_experts=4, num_experts_per_tok=2,
        norm_topk_prob=True, rms_norm_eps=1e-6, max_position_embeddings=64, tie_word_embeddings=False,
        experts_implementation="batched_mm",  # the fastest of transformers' own on CPU
    )  # fmt: skip
    return randomize(transformers.Qwen3MoeForCausalLM(cfg), seed)


def mixtral(seed=3):
    cfg = transformers.MixtralConfig(
        vocab_size=V, hidden_size=H, intermediate_size=FF, num_hidden_layers=L, num_attention_heads=NH,
        num_key_value_heads=NKV, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=64,
        tie_word_embeddings=False, experts_implementation="batched_mm",
    )  # fmt: skip
    return randomize(transformers.MixtralForCausalLM(cfg), seed)


@pytest.mark.parametrize("make", [qwen3_moe, mixtral], ids=["qwen3_moe", "mixtral"])
def test_experts_to_fused_by_transformers_rules(tmp_path, make):
    model = make()
    model.save_pretrained(tmp_path / "hub")  # transformers writes the per-expert (hub) layout
    hub = read(tmp_path / "hub")
    per_expert = [k for k in hub if ".experts.3." in k]
    assert per_expert and not any(k.endswith("gate_up_proj") for k in hub)
    fresh = type(model)(model.config)
    rep = checkpoint.migrate(tmp_path / "hub", tmp_path / "fused", recipe="experts-to-fused", model=fresh)
    fused_rule = next(u for u in rep.rules if "gate_up_proj" in u.rule)
    assert fused_rule.groups == L and fused_rule.sources == L * 4 * 2 and fused_rule.targets == L
    checkpoint.load(fresh.eval(), tmp_path / "fused")
    assert_same_model(lambda ids: model(ids).logits, fresh)
    fused = read(tmp_path / "fused")
    assert_same_state(fused, {k: v for k, v in model.state_dict().items()})
    # back: fused -> per-expert, bit-identical to what save_pretrained wrote
    checkpoint.migrate(tmp_path / "fused", tmp_path / "back", recipe="fused-to-experts", model=model)
    assert_same_state(read(tmp_path / "back"), hub)
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back")  # config.json written
    assert_same_state(again.state_dict(), model.state_dict())  # same tensors: same logits
    # One command, no --model: the recipe takes its rules from the model the hub's own config.json
    # describes (built on the meta device); config.json is written beside the fused tensors.
    from checkpoint.cli.main import main

    assert main(["migrate", str(tmp_path / "hub"), str(tmp_path / "cli"), "--recipe", "experts-to-fused"]) == 0
    assert_same_state(read(tmp_path / "cli"), fused)
    assert json.loads((tmp_path / "cli" / "config.json").read_text())["architectures"] == [type(model).__name__]


def test_torchtitan_moe_logits_and_round_trip(tmp_path):
    model = qwen3_moe()
    model.save_pretrained(tmp_path / "hub")
    rep = checkpoint.migrate(tmp_path / "hub", tmp_path / "tt", recipe="hf-to-torchtitan-moe", model=model)
    raw = read(tmp_path / "tt")
    assert "layers.1.moe.routed_experts.inner_experts.w1_EFD" in raw and "layers.1.attention.qkv_linear.wk.weight" in raw
    tt = refs.titan_legacy(raw)
    assert tt["layers.1.moe.experts.w1"].shape == (4, 16, H) and tt["layers.1.moe.experts.w2"].shape == (4, H, 16)
    assert sum(u.groups for u in rep.rules if "experts" in u.rule) == 3 * L
    cfg = model.config
    assert_same_model(lambda ids: refs.torchtitan_qwen3_moe_logits(tt, NH, NKV, cfg.num_experts_per_tok, ids), model)
    checkpoint.migrate(tmp_path / "tt", tmp_path / "back", recipe="torchtitan-moe-to-hf", model=model)
    assert_same_state(read(tmp_path / "back"), read(tmp_path / "hub"))
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back")  # config.json written
    assert_same_state(again.state_dict(), model.state_dict())  # same tensors: same logits


def deepseek_v3(q_lora_rank, rope_interleave=True, seed=11):
    """Routing exercised for real: 8 experts in 4 groups, the 2 best groups kept, top 3 of their 4
    experts, routed_scaling_factor 2.5, and a non-zero e_score_correction_bias."""
    cfg = transformers.DeepseekV3Config(
        vocab_size=V, hidden_size=H, intermediate_size=FF, moe_intermediate_size=16, num_hidden_layers=3,
        num_attention_heads=NH, num_key_value_heads=NH, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=3,
        n_group=4, topk_group=2, routed_scaling_factor=2.5, first_k_dense_replace=1, q_lora_rank=q_lora_rank,
        kv_lora_rank=8, qk_rope_head_dim=4, qk_nope_head_dim=6, v_head_dim=8, max_position_embeddings=64,
        tie_word_embeddings=False, experts_implementation="batched_mm", rope_interleave=rope_interleave,
    )  # fmt: skip
    model = randomize(transformers.DeepseekV3ForCausalLM(cfg), seed)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # a buffer: randomize() leaves it zero, which would hide a dropped bias
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn(b.shape, generator=g))
    return model


def torchtitan_deepseek_v3_keys(n_layers, q_lora: bool) -> set[str]:
    """torchtitan's DeepSeek-V3 names (deepseek_v3 state_dict_adapter from_hf_map), layer 0 dense."""
    attn = ["wq_a.weight", "q_norm.weight", "wq_b.weight"] if q_lora else ["wq.weight"]
    attn += ["wkv_a.weight", "kv_norm.weight", "wkv_b.weight", "wo.weight"]
    moe = [f"moe.routed_experts.inner_experts.{w}" for w in ("w1_EFD", "w2_EDF", "w3_EFD")] + ["moe.router.gate.weight", "moe.expert_bias_E"]
    moe += [f"moe.shared_experts.{w}.weight" for w in ("w1", "w2", "w3")]
    keys = {"tok_embeddings.weight", "norm.weight", "lm_head.weight"}
    for i in range(n_layers):
        keys |= {f"layers.{i}.attention.{a}" for a in attn} | {f"layers.{i}.{n}_norm.weight" for n in ("attention", "ffn")}
        keys |= {f"layers.{i}.feed_forward.{w}.weight" for w in ("w1", "w2", "w3")} if i == 0 else {f"layers.{i}.{k}" for k in moe}
    return keys


@pytest.mark.parametrize("q_lora_rank, rope_interleave", [(16, True), (None, True), (16, False)],
                         ids=["wq_a_q_norm_wq_b", "wq", "rope_half_split"])  # fmt: skip
def test_torchtitan_moe_deepseek_v3_mla_round_trip(tmp_path, q_lora_rank, rope_interleave):
    """DeepSeek-V3 (MLA attention, dense first layer, shared experts, expert bias) through the same
    recipe as Qwen3: HF -> torchtitan has exactly torchtitan's names and, run by a reference forward
    of torchtitan's model, the HF model's logits and greedy tokens; torchtitan -> HF gives them too
    (from_pretrained fuses the experts); HF -> tt -> HF bit-exact. With ``rope_interleave: false``
    HF rotates halves where torchtitan rotates pairs: the RoPE rows are permuted both ways."""
    model = deepseek_v3(q_lora_rank, rope_interleave)
    model.save_pretrained(tmp_path / "hub")  # per-expert keys, as on the hub
    hub = read(tmp_path / "hub")
    assert "model.layers.1.mlp.experts.3.down_proj.weight" in hub
    checkpoint.migrate(tmp_path / "hub", tmp_path / "tt", recipe="hf-to-torchtitan-moe")
    raw = read(tmp_path / "tt")
    assert set(raw) == torchtitan_deepseek_v3_keys(3, q_lora_rank is not None)  # MLA keeps attention.wq
    tt = refs.titan_legacy(raw)
    assert tt["layers.2.moe.experts.w2"].shape == (8, H, 16) and tt["layers.2.moe.expert_bias"].abs().sum() > 0
    cfg = model.config

    def titan(ids, sd=tt, topk_group=cfg.topk_group, scale=cfg.routed_scaling_factor):
        return refs.deepseek_v3_torchtitan_logits(sd, NH, cfg.qk_rope_head_dim, cfg.num_experts_per_tok, cfg.n_group,
                                                  topk_group, scale, ids, eps=cfg.rms_norm_eps)  # fmt: skip

    assert_same_model(titan, model)
    with torch.no_grad():  # each routing feature changes the logits, so the match above depends on it
        unbiased = {k: torch.zeros_like(v) if k.endswith("expert_bias") else v for k, v in tt.items()}
        for other in (titan(PROMPT, sd=unbiased), titan(PROMPT, topk_group=cfg.n_group), titan(PROMPT, scale=1.0)):
            assert (other - titan(PROMPT)).abs().max() > 0.1
    if q_lora_rank:  # the MLA q_norm is DeepSeek's q_a_layernorm, not Qwen3's per-head q_norm
        assert torch.equal(tt["layers.1.attention.q_norm.weight"], hub["model.layers.1.self_attn.q_a_layernorm.weight"])
        moved = not torch.equal(tt["layers.1.attention.wq_b.weight"], hub["model.layers.1.self_attn.q_b_proj.weight"])
        assert moved == (not rope_interleave)
    rep = checkpoint.migrate(tmp_path / "tt", tmp_path / "back", recipe="torchtitan-moe-to-hf", model=model)
    assert sum(u.sources for u in rep.rules) == len(tt) and rep.layouts == {"source": "torchtitan 3101b42"}
    if q_lora_rank is None:  # MLA keeps attention.wq: the plan names it so, not as Llama's qkv_linear.wq
        assert [u.rule.split(" ")[0] for u in rep.rules if u.groups and "self_attn.q_proj" in u.rule] == ["layers.{i}.attention.wq.weight"]
    assert any(u.groups and u.rule.startswith("layers.{i}.moe.routed_experts.inner_experts.w1_EFD ->") for u in rep.rules)
    assert_same_state(read(tmp_path / "back"), hub)
    fresh = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back").eval()  # config.json written
    assert type(fresh) is transformers.DeepseekV3ForCausalLM
    assert_same_model(lambda ids: model(ids).logits, fresh)
    assert_same_state(fresh.state_dict(), model.state_dict())


def test_converted_reader_reads_only_the_block_a_rank_holds(tmp_path, monkeypatch):
    """load(recipe=)'s reader: a rename, one expert of a stacked tensor, some experts of a stack or
    of transformers' fused gate_up_proj, whole heads of a RoPE row permute and whole KV groups of
    Megatron's fused QKV are read as blocks (no group computed whole); the values equal the whole
    conversion's. A block cutting a head is computed whole and cut."""
    from checkpoint.convert import open_conversion
    from checkpoint.convert.plan import ConversionPlan
    from checkpoint.convert.reader import ConvertedReader

    model = qwen3_moe()
    model.save_pretrained(tmp_path / "hub")
    checkpoint.migrate(tmp_path / "hub", tmp_path / "tt", recipe="hf-to-torchtitan-moe", model=model)

    def no_whole_group(self, group):
        raise AssertionError(f"group {group.rule.describe()} computed whole")

    cases = [
        ("tt", "torchtitan-moe-to-hf", "model.layers.1.mlp.experts.2.up_proj.weight", (slice(3, 9),)),  # Unstack
        ("tt", "torchtitan-moe-to-hf", "model.layers.0.self_attn.v_proj.weight", (slice(2, 6), slice(1, 4))),  # rename
        ("hub", "hf-to-torchtitan-moe", "layers.1.moe.routed_experts.inner_experts.w2_EDF", (slice(1, 3), slice(0, 5))),  # Stack
    ]
    src = {"tt": tmp_path / "tt", "hub": tmp_path / "hub", "meta": write_meta(tmp_path / "meta", meta_state_dict(5))}
    llama = transformers.LlamaForCausalLM(llama_config())
    cases += [  # Meta's interleaved RoPE rows: whole heads are permuted alone
        ("meta", "meta-llama-to-hf", "model.layers.1.self_attn.q_proj.weight", (slice(8, 24), slice(0, 7))),  # heads 1-2 of 4
        ("meta", "meta-llama-to-hf", "model.layers.0.self_attn.k_proj.weight", (slice(0, 8),)),  # K head 0 of 2
    ]
    # transformers' fused experts (Stack + Concat): only experts 1-2 read; Megatron's fused QKV:
    # the rows of whole KV groups (group 1 of 2) read and split alone.
    fresh = type(model)(model.config)
    hf = randomize(transformers.LlamaForCausalLM(llama_config()), 12)
    checkpoint.save(hf, tmp_path / "hf")
    checkpoint.migrate(tmp_path / "hf", tmp_path / "mg", recipe="hf-to-megatron-gpt", model=hf)
    src["mg"] = tmp_path / "mg"
    cases += [
        ("hub", "experts-to-fused", "model.layers.1.mlp.experts.gate_up_proj", (slice(1, 3),)),
        ("hub", "experts-to-fused", "model.layers.0.mlp.experts.gate_up_proj", (slice(2, 4), slice(0, 32), slice(3, 9))),
        ("mg", "megatron-gpt-to-hf", "model.layers.1.self_attn.q_proj.weight", (slice(16, 32),)),
        ("mg", "megatron-gpt-to-hf", "model.layers.0.self_attn.k_proj.weight", (slice(8, 16), slice(2, 5))),
        ("mg", "megatron-gpt-to-hf", "model.layers.0.self_attn.v_proj.weight", (slice(0, 8),)),
    ]
    for name, recipe, key, sl in cases:
        target = {"tt": model, "meta": llama, "hub": fresh, "mg": hf}.get(name)
        with ConvertedReader(open_conversion(src[name], recipe, model=target)) as r:
            full = r.get(key)  # computed through the group, before the block reads are pinned
            if name == "meta":
                assert type(r.plan.groups[r.plan._group_of[key]].rule.ops[0]).__name__ == "PermuteRope"
            r._kept.clear()
            monkeypatch.setattr(ConversionPlan, "compute", no_whole_group)
            block = r.get_slice(key, sl)
            monkeypatch.undo()
        assert torch.equal(block, full[sl]), key
    # A block cutting a head (rows 4..12 of 8-row heads): computed whole, then cut.
    key = "model.layers.1.self_attn.q_proj.weight"
    with ConvertedReader(open_conversion(src["meta"], "meta-llama-to-hf", model=llama)) as r:
        full = r.get(key)
        r._kept.clear()
        assert torch.equal(r.get_slice(key, (slice(4, 12),)), full[4:12])
        assert len(r._kept) == 1  # its group was computed


def test_megatron_gpt_logits_and_round_trip(tmp_path):
    hf = randomize(transformers.LlamaForCausalLM(llama_config()), 4)
    checkpoint.save(hf, tmp_path / "hf")
    checkpoint.migrate(tmp_path / "hf", tmp_path / "mg", recipe="hf-to-megatron-gpt", model=hf)
    mg = read(tmp_path / "mg")
    hd = H // NH
    assert mg["decoder.layers.0.self_attention.linear_qkv.weight"].shape == ((NH + 2 * NKV) * hd, H)
    assert mg["decoder.layers.0.mlp.linear_fc1.weight"].shape == (2 * FF, H)
    assert_same_model(lambda ids: refs.megatron_gpt_logits(mg, NH, NKV, ids), hf)
    fresh = transformers.LlamaForCausalLM(llama_config())
    checkpoint.migrate(tmp_path / "mg", tmp_path / "back", recipe="megatron-gpt-to-hf", model=fresh)
    assert_same_state(read(tmp_path / "back"), read(tmp_path / "hf"))
    again = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "back").eval()
    assert_same_model(lambda ids: refs.megatron_gpt_logits(mg, NH, NKV, ids), again)


def test_gpt2_conv1d_to_linear_logits_and_round_trip(tmp_path):
    cfg = transformers.GPT2Config(n_embd=H, n_layer=L, n_head=NH, vocab_size=V, n_positions=64)
    model = randomize(transformers.GPT2LMHeadModel(cfg), 5)
    model.save_pretrained(tmp_path / "hf")  # lm_head tied to wte: stored once
    checkpoint.migrate(tmp_path / "hf", tmp_path / "lin", recipe="gpt2-conv1d-to-linear")
    lin = read(tmp_path / "lin")
    assert lin["transformer.h.0.attn.c_attn.weight"].shape == (3 * H, H)
    assert_same_model(lambda ids: refs.gpt2_linear_logits(lin, NH, ids), model)
    fresh = transformers.GPT2LMHeadModel(cfg)
    checkpoint.migrate(tmp_path / "lin", tmp_path / "back", recipe="linear-to-gpt2-conv1d", model=fresh)
    assert_same_state(read(tmp_path / "back"), read(tmp_path / "hf"))
    again = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "back").eval()
    assert_same_model(lambda ids: refs.gpt2_linear_logits(lin, NH, ids), again)


# -- refusals: named keys, nothing read before planning ends, nothing written ------------------------------
def write_meta(path, sd, params=PARAMS):
    path.mkdir()
    torch.save(sd, path / "consolidated.00.pth")
    (path / "params.json").write_text(json.dumps(params))
    return path


def no_reads(monkeypatch):
    """Planning must decide from headers alone: any tensor read fails the test."""
    from checkpoint.sources import Source

    def boom(self, key):
        raise AssertionError(f"{key!r} was read during planning")

    monkeypatch.setattr(Source, "get", boom)


def test_unmatched_and_shape_problems_stop_before_reading(tmp_path, monkeypatch):
    sd = meta_state_dict()
    sd["layers.0.attention.extra.weight"] = torch.zeros(2)
    sd["layers.1.attention.wk.weight"] = torch.zeros(NKV * 8 + 2, H)  # not whole heads
    src = write_meta(tmp_path / "meta", sd)
    no_reads(monkeypatch)
    with pytest.raises(ConversionError) as e:
        checkpoint.migrate(src, tmp_path / "out", recipe="meta-llama-to-hf")
    kinds = {p.kind: p.keys for p in e.value.report.problems}
    assert kinds["unmatched"] == ["layers.0.attention.extra.weight"]
    assert kinds["op"] == ["layers.1.attention.wk.weight"]
    assert "layers.0.attention.extra.weight" in str(e.value) and not e.value.report.written
    assert not (tmp_path / "out").exists()


def test_model_shape_and_missing_targets_named(tmp_path, monkeypatch):
    sd = meta_state_dict()
    del sd["layers.1.ffn_norm.weight"]
    src = write_meta(tmp_path / "meta", sd)
    cfg = llama_config()
    cfg.intermediate_size = FF * 2
    no_reads(monkeypatch)
    with pytest.raises(ConversionError) as e:
        checkpoint.migrate(src, tmp_path / "out", recipe="meta-llama-to-hf", model=transformers.LlamaForCausalLM(cfg))
    kinds: dict[str, list[str]] = {}
    for p in e.value.report.problems:
        kinds.setdefault(p.kind, []).extend(p.keys)
    assert kinds["missing"] == ["model.layers.1.post_attention_layernorm.weight"]
    assert sorted(kinds["shape"]) == sorted(f"model.layers.{i}.mlp.{m}_proj.weight" for i in range(L) for m in ("gate", "up", "down"))
    assert not (tmp_path / "out").exists()


def test_key_missing_from_one_layer_refused_without_model(tmp_path, monkeypatch):
    """Without model= nothing compares the targets with a module: a layer with fewer keys than
    another, or a layer index absent (params.json's n_layers), stops the plan, naming the keys."""
    sd = meta_state_dict()
    del sd["layers.1.attention.wk.weight"]
    src = write_meta(tmp_path / "meta", sd)
    no_reads(monkeypatch)
    with pytest.raises(ConversionError) as e:
        checkpoint.migrate(src, tmp_path / "out", recipe="meta-llama-to-hf")
    (p,) = e.value.report.problems
    assert (p.kind, p.keys) == ("incomplete", ["layers.1.attention.wk.weight"])
    assert not (tmp_path / "out").exists()
    # A whole layer gone: n_layers from params.json says 3.
    sd = meta_state_dict()
    src = write_meta(tmp_path / "meta3", sd, {**PARAMS, "n_layers": L + 1})
    with pytest.raises(ConversionError, match=rf"expected 0..{L}; absent \[{L}\]") as e:
        checkpoint.migrate(src, tmp_path / "out", recipe="meta-llama-to-hf")
    assert [p.keys for p in e.value.report.problems] == [[f"layers.{L}"]]
    assert not (tmp_path / "out").exists()


def test_layer_rule_passes_dense_and_moe_layers():
    """Layers of two kinds (dense and MoE, as DeepSeek-V3's first_k_dense_replace) differ by
    disjoint keys: no problem; one MoE layer short of an expert's key is named."""
    from checkpoint.convert.layers import layer_problems

    attn = ["self_attn.q_proj.weight", "self_attn.o_proj.weight", "input_layernorm.weight"]
    dense = attn + ["mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight"]
    moe = attn + ["mlp.gate.weight"] + [f"mlp.experts.{e}.{w}.weight" for e in range(3) for w in ("w1", "w2")]
    keys = [f"model.layers.0.{k}" for k in dense] + [f"model.layers.{i}.{k}" for i in (1, 2) for k in moe]
    assert layer_problems(keys + ["model.norm.weight", "lm_head.weight"], {"n_layers": 3}) == []
    short = [k for k in keys if k != "model.layers.2.mlp.experts.1.w2.weight"]
    (p,) = layer_problems(short, {})
    assert p.keys == ["model.layers.2.mlp.experts.1.w2.weight"] and "model.layers.2 lacks 1 key" in p.message


def test_missing_expert_is_incomplete_not_dropped(tmp_path, monkeypatch):
    model = qwen3_moe()
    hub = {k: v for k, v in model.state_dict().items()}
    from transformers.core_model_loading import revert_weight_conversion

    hub = revert_weight_conversion(model, hub)
    del hub["model.layers.1.mlp.experts.2.up_proj.weight"]
    import safetensors.torch

    (tmp_path / "hub").mkdir()
    safetensors.torch.save_file({k: v.contiguous() for k, v in hub.items()}, tmp_path / "hub" / "model.safetensors")
    no_reads(monkeypatch)
    with pytest.raises(ConversionError) as e:
        checkpoint.migrate(tmp_path / "hub", tmp_path / "out", recipe="experts-to-fused", model=model)
    (p,) = [p for p in e.value.report.problems if p.kind == "incomplete"]
    assert "model.layers.1.mlp.experts.3.up_proj.weight" in p.keys and "indices [0, 1, 3]" in p.message
    assert not (tmp_path / "out").exists()


def test_untranslated_transformers_op_refused_by_name(tmp_path):
    from transformers.core_model_loading import PermuteForRope

    from checkpoint.convert import Recipe, Rule
    from checkpoint.convert.catalog import open_catalog
    from checkpoint.convert.plan import plan_conversion
    from checkpoint.convert.transformers_rules import _translate_op

    op = _translate_op(PermuteForRope())
    src = write_meta(tmp_path / "meta", {"a.weight": torch.zeros(4, 4)})
    for rec in (Recipe("x", "y", (Rule("a.weight", "b.weight", (op,)),)), Recipe("y", "x", (Rule("a.weight", "b.weight", (op.inverse(),)),))):
        cat = open_catalog(src)
        with pytest.raises(ConversionError, match="PermuteForRope"):
            plan_conversion(cat, rec, {})
        cat.close()
    from transformers.core_model_loading import ConversionOps

    class OneWay(ConversionOps):  # transformers' default reverse_op raises NotImplementedError
        def convert(self, input_dict, source_patterns, target_patterns, **kwargs):
            return input_dict

    one_way = _translate_op(OneWay())
    assert one_way.has_inverse is False and op.has_inverse is True  # 5.24's PermuteForRope has one
    cat = open_catalog(src)
    with pytest.raises(ConversionError, match="OneWay has no inverse"):
        plan_conversion(cat, Recipe("y", "x", (Rule("a.weight", "b.weight", (one_way.inverse(),)),)), {})
    cat.close()


def test_ops_inverse_exact():
    from checkpoint.convert import Chunk, Concat, FuseQKV, PermuteRope, SplitQKV, Stack, Transpose, Unstack

    g = torch.Generator().manual_seed(0)
    dims = {"n_heads": 4, "n_kv_heads": 2}
    cases = [
        (PermuteRope("n_heads"), [torch.randn(32, 6, generator=g)]),
        (PermuteRope("n_kv_heads", to_half=False), [torch.randn(16, 6, generator=g)]),
        (Transpose(0, 1), [torch.randn(3, 5, generator=g)]),
        (Stack(0), [[torch.randn(3, 5, generator=g) for _ in range(4)]]),
        (Unstack(1), [torch.randn(3, 4, 5, generator=g)]),
        (Concat(1), [torch.randn(3, 5, generator=g), torch.randn(3, 5, generator=g)]),
        (FuseQKV(), [torch.randn(32, 6, generator=g), torch.randn(16, 6, generator=g), torch.randn(16, 6, generator=g)]),
        (FuseQKV(), [torch.randn(32, generator=g), torch.randn(16, generator=g), torch.randn(16, generator=g)]),
        (SplitQKV(), [torch.randn(64, 6, generator=g)]),
        (Chunk(0, 2), [torch.randn(8, 3, generator=g)]),
    ]
    for op, values in cases:
        back = op.inverse()
        if isinstance(back, Chunk):
            back = Chunk(back.dim, len(values))
        out = back.apply(op.apply(values, dims), dims)
        flat = lambda vs: [t for v in vs for t in (v if isinstance(v, list) else [v])]  # noqa: E731
        assert all(torch.equal(a, b) for a, b in zip(flat(out), flat(values), strict=True)), op
        assert op.inverse().inverse() == (Chunk(op.dim) if isinstance(op, Chunk) else op)  # a Rule fills parts
    # the permute is the documented one: head rows [r0, r1, r2, r3] -> [r0, r2, r1, r3]
    rows = torch.arange(8.0).view(8, 1)
    assert PermuteRope("n").apply([rows], {"n": 2})[0].flatten().tolist() == [0, 2, 1, 3, 4, 6, 5, 7]
    # unequal parts cannot be concatenated invertibly
    with pytest.raises(ValueError, match="not invertible"):
        Concat(0).apply([torch.zeros(2, 1), torch.zeros(3, 1)], {})


def test_auto_picks_the_one_fitting_recipe(tmp_path):
    model = qwen3_moe()
    model.save_pretrained(tmp_path / "hub")
    rep = checkpoint.migrate(tmp_path / "hub", tmp_path / "out", recipe="auto", model=model, dry_run=True)
    assert rep.recipe == "experts-to-fused" and not rep.written
    checkpoint.save(model, tmp_path / "fused", layout="memory")  # already the model's layout: no recipe changes it
    with pytest.raises(RecipeError, match="no built-in recipe"):
        checkpoint.migrate(tmp_path / "fused", tmp_path / "out2", recipe="auto", model=model)
    with pytest.raises(RecipeError, match="needs model"):
        checkpoint.migrate(tmp_path / "hub", tmp_path / "out3", recipe="auto")


def test_cli_recipes_and_migrate_recipe(tmp_path, monkeypatch, capsys):
    from checkpoint.cli.main import main

    assert main(["recipes"]) == 0
    out = capsys.readouterr().out
    for name in ("meta-llama-to-hf", "hf-to-megatron-gpt", "experts-to-fused", "linear-to-gpt2-conv1d"):
        assert name in out
    sd = meta_state_dict()
    src = write_meta(tmp_path / "meta", sd)
    assert main(["migrate", str(src), str(tmp_path / "hf"), "--recipe", "meta-llama-to-hf"]) == 0
    out = capsys.readouterr().out
    # No --model: config.json comes from params.json and the tensors' shapes, so from_pretrained
    # gives Meta's own logits with no file written by hand.
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert type(hf) is transformers.LlamaForCausalLM and hf.config.intermediate_size == sd["layers.0.feed_forward.w1.weight"].shape[0]
    assert_same_model(lambda ids: refs.meta_llama_logits(sd, NH, NKV, ids), hf)
    assert f"{L:>5} x layers.{{i}}.attention.wq.weight -> model.layers.{{i}}.self_attn.q_proj.weight [PermuteRope" in out
    assert main(["migrate", str(src), str(tmp_path / "x"), "--recipe", "no-such"]) == 2
    assert "unknown recipe 'no-such'" in capsys.readouterr().err
    rep = json.loads((tmp_path / "hf" / "conversion_report.json").read_text())
    assert ConversionReport.model_validate(rep).written


# -- Hugging Face round trip: save writes config.json ---------------------------------------------------
def test_save_writes_config_so_from_pretrained_works(tmp_path):
    model = randomize(transformers.LlamaForCausalLM(llama_config()), 6)
    model.config.use_cache = False  # a runtime override (capture sets it): not written
    checkpoint.save(model, tmp_path / "ck")
    cfg = json.loads((tmp_path / "ck" / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and "use_cache" not in cfg
    assert (tmp_path / "ck" / "generation_config.json").is_file()
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ck").eval()
    assert type(again) is transformers.LlamaForCausalLM and again.config.use_cache is True
    assert_same_state(again.state_dict(), model.state_dict())
    # and save_pretrained's output loads with checkpoint.load
    model.save_pretrained(tmp_path / "sp")
    fresh = transformers.LlamaForCausalLM(llama_config())
    checkpoint.load(fresh, tmp_path / "sp")
    assert_same_state(fresh.state_dict(), model.state_dict())


def test_load_and_save_with_recipe(tmp_path, monkeypatch):
    import tempfile

    from tests.snapshot import Snapshot

    sd = meta_state_dict(7)
    src = write_meta(tmp_path / "meta", sd)
    hf = transformers.LlamaForCausalLM(llama_config()).eval()
    # Converted while loading, through the load pipeline's checks: no temporary checkpoint, and
    # a value float16 cannot hold is refused with the model left as it was.
    def no_temp(*a, **k):
        raise AssertionError("load(recipe=) made a temporary directory")

    monkeypatch.setattr(tempfile, "mkdtemp", no_temp)
    big = dict(sd)
    big["layers.1.attention.wo.weight"] = sd["layers.1.attention.wo.weight"].clone()
    big["layers.1.attention.wo.weight"][0, 0] = 1e6
    write_meta(tmp_path / "big", big)
    half = transformers.LlamaForCausalLM(llama_config()).half()
    snap = Snapshot(half)
    with pytest.raises(checkpoint.LossyConversionError, match="model.layers.1.self_attn.o_proj.weight"):
        checkpoint.load(half, tmp_path / "big", recipe="meta-llama-to-hf")
    snap.assert_unchanged()
    with pytest.raises(TypeError, match="model tensors only"):
        checkpoint.load(hf, src, recipe="meta-llama-to-hf", verify=True)
    checkpoint.load(hf, src, recipe="meta-llama-to-hf")
    monkeypatch.undo()
    assert_same_model(lambda ids: refs.meta_llama_logits(sd, NH, NKV, ids), hf)
    rep = checkpoint.save(hf, tmp_path / "tt", recipe="hf-to-torchtitan-llama3")
    assert isinstance(rep, ConversionReport) and rep.written
    assert_same_state(refs.titan_legacy(read(tmp_path / "tt")), sd)
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".fqnckpt")] == []  # temp removed


def test_torchtitan_moe_router_bias_and_shared_experts_round_trip(tmp_path):
    """DeepSeek-V3's MoE parts in torchtitan's names (expert_bias, shared experts): exact both ways."""
    import safetensors.torch

    g = torch.Generator().manual_seed(8)
    tt = {"layers.1.moe.router.gate.weight": torch.randn(4, H, generator=g),
          "layers.1.moe.expert_bias": torch.randn(4, generator=g),
          "layers.1.moe.experts.w1": torch.randn(4, 16, H, generator=g),
          "layers.1.moe.experts.w3": torch.randn(4, 16, H, generator=g),
          "layers.1.moe.experts.w2": torch.randn(4, H, 16, generator=g),
          "layers.1.moe.shared_experts.w1.weight": torch.randn(16, H, generator=g),
          "layers.1.moe.shared_experts.w3.weight": torch.randn(16, H, generator=g),
          "layers.1.moe.shared_experts.w2.weight": torch.randn(H, 16, generator=g),
          "layers.0.feed_forward.w1.weight": torch.randn(FF, H, generator=g)}  # fmt: skip
    safetensors.torch.save_file(tt, tmp_path / "tt.safetensors")
    rep = checkpoint.migrate(tmp_path / "tt.safetensors", tmp_path / "hf", recipe="torchtitan-moe-to-hf")
    hf = read(tmp_path / "hf")
    assert torch.equal(hf["model.layers.1.mlp.gate.e_score_correction_bias"], tt["layers.1.moe.expert_bias"])
    assert torch.equal(hf["model.layers.1.mlp.experts.3.down_proj.weight"], tt["layers.1.moe.experts.w2"][3])
    assert torch.equal(hf["model.layers.1.mlp.shared_experts.up_proj.weight"], tt["layers.1.moe.shared_experts.w3.weight"])
    assert len(hf) == 6 + 3 * 4 and sum(u.sources for u in rep.rules) == len(tt)
    assert rep.layouts == {"source": "torchtitan legacy..786e26f (read as 786e26f)"}  # no output / attention key to tell
    back = checkpoint.migrate(tmp_path / "hf", tmp_path / "back", recipe="hf-to-torchtitan-moe@legacy")
    assert back.layouts == {"target": "torchtitan legacy"}
    assert_same_state(read(tmp_path / "back"), tt)
    checkpoint.migrate(tmp_path / "hf", tmp_path / "today", recipe="hf-to-torchtitan-moe")  # today's names by default
    assert_same_state(refs.titan_legacy(read(tmp_path / "today")), tt)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.int8, torch.bool])
def test_ops_every_dtype_bit_exact(dtype):
    from checkpoint.convert import Chunk, Concat, FuseQKV, PermuteRope, SplitQKV, Stack, Unstack

    g = torch.Generator().manual_seed(1)
    x, y = (torch.randn(8, 4, generator=g).to(dtype) for _ in range(2))
    bits = lambda t: t.view(torch.uint8) if t.dtype.itemsize == 1 else t  # noqa: E731 (fp8 has no torch.equal)
    dims = {"n": 2, "n_heads": 2, "n_kv_heads": 1}
    pairs = [
        (Chunk(1, 2).apply(Concat(1).apply([x, y], dims), dims), [x, y]),
        (Unstack(0).apply(Stack(0).apply([[x, y]], dims), dims)[0], [x, y]),
        (PermuteRope("n", False).apply(PermuteRope("n").apply([x], dims), dims), [x]),
        (SplitQKV().apply(FuseQKV().apply([x, y[:4], y[4:]], dims), dims), [x, y[:4], y[4:]]),
    ]
    for got, want in pairs:
        assert all(a.dtype == dtype and torch.equal(bits(a), bits(b)) for a, b in zip(got, want, strict=True))


@pytest.mark.parametrize(
    "config",
    [
        # transformers has no causal LM for t5, so its auto_map is the only way to build one: code
        # shipped in the checkpoint (transformers would prompt, and run it on "y")
        {"model_type": "t5", "auto_map": {"AutoConfig": "evil.Cfg", "AutoModelForCausalLM": "evil.Evil"}},
        {"model_type": "t5", "auto_map": {"AutoModelForCausalLM": "attacker/evil--evil.Evil"}},
        {"model_type": "llama", "hidden_size": 8, "num_attention_heads": 0, "num_hidden_layers": 1},
        {"model_type": "llama", "hidden_size": "8"},
    ],
    ids=["local-auto-map", "hub-auto-map", "zero-heads", "wrong-type"],
)
def test_model_from_source_config_never_runs_checkpoint_code_and_names_config(tmp_path, monkeypatch, config):
    hub = tmp_path / "hub"
    hub.mkdir()
    import safetensors.torch

    safetensors.torch.save_file({"model.layers.0.mlp.experts.0.up_proj.weight": torch.ones(2, 2)}, str(hub / "model.safetensors"))
    (hub / "config.json").write_text(json.dumps({**config, "_name_or_path": str(hub)}))
    marker = tmp_path / "ran"
    (hub / "evil.py").write_text(f"open({str(marker)!r}, 'w').close()\nclass Cfg: pass\nclass Evil: pass\n")
    asked = []
    monkeypatch.setattr("builtins.input", lambda prompt="": asked.append(prompt) or "y")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    before = sorted(p.name for p in tmp_path.iterdir())
    with pytest.raises(RecipeError, match=r"experts-to-fused.*hub: config\.json"):
        checkpoint.migrate(hub, tmp_path / "out", recipe="experts-to-fused")
    assert not marker.exists() and asked == []
    assert sorted(p.name for p in tmp_path.iterdir()) == before


@pytest.mark.parametrize("bad", [{"n_heads": 0}, {"n_kv_heads": -2}, {"use_scaled_rope": True, "rope_scaling_factor": "big"}])
def test_meta_params_out_of_range_is_corrupt_params_json_before_writing(tmp_path, bad):
    from checkpoint.errors import CorruptCheckpointError

    src = tmp_path / "meta"
    src.mkdir()
    torch.save(meta_state_dict(), src / "consolidated.00.pth")
    (src / "params.json").write_text(json.dumps({**PARAMS, **bad}))
    with pytest.raises(CorruptCheckpointError, match=rf"params\.json: not a Meta params\.json: {next(iter(bad.keys() - {'use_scaled_rope'}))}"):
        checkpoint.migrate(src, tmp_path / "hf", recipe="meta-llama-to-hf")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["meta"]


def test_meta_without_model_checks_params_json_against_the_tensors(tmp_path):
    """No model to check against: a 2-shard Meta checkpoint missing its last shard (it looks like a
    whole 1-shard one), or a params.json with the wrong n_heads, is refused naming the mismatch,
    nothing written; shards < 1 for Meta's layout is refused."""
    sd = meta_state_dict()
    src = tmp_path / "meta"
    src.mkdir()
    first, _ = meta_shards(sd, 2)
    torch.save(first, src / "consolidated.00.pth")  # consolidated.01.pth lost
    (src / "params.json").write_text(json.dumps(PARAMS))
    for dry in (True, False):  # found while planning: a dry run says so too
        with pytest.raises(ConversionError, match="params.json gives dim=32, the tensors have 16"):
            checkpoint.migrate(src, tmp_path / "hf", recipe="meta-llama-to-hf", dry_run=dry)
    assert not (tmp_path / "hf").exists()
    wrong = write_meta(tmp_path / "wrong", sd, PARAMS | {"n_heads": NH * 2})  # head_dim halves: K rows disagree
    with pytest.raises(ConversionError, match="k_proj.weight has 16 rows, dims give 2 heads x 4 = 8"):
        checkpoint.migrate(wrong, tmp_path / "hf2", recipe="meta-llama-to-hf")
    assert not (tmp_path / "hf2").exists()
    good = write_meta(tmp_path / "good", sd)
    checkpoint.migrate(good, tmp_path / "hf3", recipe="meta-llama-to-hf")
    for n in (0, -1):
        with pytest.raises(RecipeError, match=f"shards must be a positive integer, got {n}"):
            checkpoint.migrate(tmp_path / "hf3", tmp_path / "m", recipe="hf-to-meta-llama", dims={"shards": n})
    assert not (tmp_path / "m").exists()


def test_recipe_that_changes_nothing_and_unused_shards_are_refused(tmp_path):
    """experts-to-fused on a dense Llama converts nothing: refused (no-op) rather than a copy that
    looks like a conversion; --dim shards for a layout without shards is refused; nothing written."""
    hf = randomize(transformers.LlamaForCausalLM(llama_config()), 3)
    checkpoint.save(hf, tmp_path / "hf")
    with pytest.raises(ConversionError, match="nothing would change") as e:
        checkpoint.migrate(tmp_path / "hf", tmp_path / "x", recipe="experts-to-fused")
    assert [p.kind for p in e.value.report.problems] == ["no-op"]
    with pytest.raises(RecipeError, match="shards=2 applies to Meta's layout only"):
        checkpoint.migrate(tmp_path / "hf", tmp_path / "y", recipe="hf-to-torchtitan-llama3", dims={"shards": 2})
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()


# --- every dimension from every source, compared; consistency; side files re-read -------------


def test_dims_disagreeing_between_sources_refused_naming_both(tmp_path):
    """params.json (4 / 2 heads) against a model of 2 / 1 heads with the same tensor shapes: the
    RoPE permute would run per head of the wrong size. Refused by load(recipe=) and migrate, both
    sources and values named; the agreeing model converts; nothing written."""
    src = write_meta(tmp_path / "meta", meta_state_dict())
    cfg = llama_config()
    cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim = 2, 1, H // 2
    wrong = transformers.LlamaForCausalLM(cfg)
    msg = "dimension n_heads disagrees: params.json gives 4, the model's config gives 2"
    with pytest.raises(RecipeError, match=msg):
        checkpoint.load(wrong, src, recipe="meta-llama-to-hf")
    with pytest.raises(RecipeError, match=msg):
        checkpoint.migrate(src, tmp_path / "hf", recipe="meta-llama-to-hf", model=wrong)
    with pytest.raises(RecipeError, match="n_kv_heads disagrees: params.json gives 2, dims= gives 1"):
        checkpoint.migrate(src, tmp_path / "hf", recipe="meta-llama-to-hf", dims={"n_kv_heads": 1})
    assert not (tmp_path / "hf").exists()
    rep = checkpoint.migrate(src, tmp_path / "hf", recipe="meta-llama-to-hf", model=transformers.LlamaForCausalLM(llama_config()),
                             dims={"n_heads": NH})  # fmt: skip
    assert rep.dim_sources["params.json"]["n_heads"] == rep.dim_sources["the model's config"]["n_heads"] == rep.dim_sources["dims="]["n_heads"] == NH
    on_disk = json.loads((tmp_path / "hf" / "conversion_report.json").read_text())
    assert any("config.json re-read" in c for c in on_disk["checks"]) and any("agree with each other" in c for c in on_disk["checks"])


@pytest.mark.parametrize("dims, why", [
    ({"n_heads": 0}, "n_heads must be a positive integer, got 0"), ({"n_kv_heads": 0}, "n_kv_heads must be a positive integer"),
    ({"dim": -32}, "dim must be a positive integer, got -32"), ({"n_heads": 4.7}, "got 4.7"), ({"n_heads": True}, "got True"),
    ({"n_kv_head": 1}, "unknown dimension 'n_kv_head'"), ({"dim": 64}, "dim disagrees: config.json gives 32, dims= gives 64"),
])  # fmt: skip
def test_bad_dims_refused_by_name_nothing_written(tmp_path, dims, why):
    checkpoint.save(transformers.LlamaForCausalLM(llama_config()), tmp_path / "hf")
    with pytest.raises(RecipeError, match=why):
        checkpoint.migrate(tmp_path / "hf", tmp_path / "meta", recipe="hf-to-meta-llama", dims=dims)
    assert not (tmp_path / "meta").exists()


def test_dims_checked_against_the_tensors_without_config(tmp_path):
    """No config.json beside the source: a --dim that contradicts the tensors is refused by the
    tensors (embedding width, q rows), not written into params.json."""
    hf = tmp_path / "hf"
    checkpoint.save(transformers.LlamaForCausalLM(llama_config()), hf)
    (hf / "config.json").unlink()
    base = {"n_layers": L, "n_heads": NH, "n_kv_heads": NKV}
    with pytest.raises(ConversionError, match="dims= gives dim=64, the tensors have 32"):
        checkpoint.migrate(hf, tmp_path / "m1", recipe="hf-to-meta-llama", dims=base | {"dim": 64})
    with pytest.raises(ConversionError, match="q_proj.weight has 32 rows, dims give 8 heads x 8 = 64"):
        checkpoint.migrate(hf, tmp_path / "m2", recipe="hf-to-meta-llama", dims=base | {"dim": H, "n_heads": 8, "head_dim": 8})
    assert not (tmp_path / "m1").exists() and not (tmp_path / "m2").exists()
    rep = checkpoint.migrate(hf, tmp_path / "m3", recipe="hf-to-meta-llama", dims=base | {"dim": H})
    assert any("params.json re-read" in c for c in rep.checks)


def test_cli_dim_refused_naming_the_flag(tmp_path, capsys):
    from checkpoint.cli.main import main

    checkpoint.save(transformers.LlamaForCausalLM(llama_config()), tmp_path / "hf")
    for arg, why in (("n_heads=0", "positive integer"), ("n_heads=\u00b2", "NAME=INTEGER"), ("n_kv_head=1", "unknown dimension"),
                     ("dim=64", "dim disagrees: config.json gives 32")):  # fmt: skip
        code = main(["--json", "migrate", str(tmp_path / "hf"), str(tmp_path / "m"), "--recipe", "hf-to-meta-llama", "--dim", arg])
        out = json.loads(capsys.readouterr().out)
        assert code == 2 and out["flag"] == "--dim" and why in out["message"], (arg, out)
    assert not (tmp_path / "m").exists()


@pytest.mark.parametrize("lost", ["w1", "w2"])
def test_expert_stacks_of_different_counts_refused(tmp_path, lost):
    """A stack one expert short beside its siblings and the router (4 rows) is refused naming the
    counts, in both directions (HF per-expert keys missing an expert's gate_proj too)."""
    import safetensors.torch

    g = torch.Generator().manual_seed(8)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    E, F = 4, 16
    tt = {}
    for i in range(2):
        tt |= {f"layers.{i}.moe.router.gate.weight": r(E, H), f"layers.{i}.attention_norm.weight": r(H),
               f"layers.{i}.moe.experts.w1": r(E - (lost == "w1"), F, H), f"layers.{i}.moe.experts.w3": r(E, F, H),
               f"layers.{i}.moe.experts.w2": r(E - (lost == "w2"), H, F)}  # fmt: skip
    safetensors.torch.save_file(tt, tmp_path / "tt.safetensors")
    with pytest.raises(ConversionError, match=r"disagree on the \{\*e\} count.*has 3.*") as e:
        checkpoint.migrate(tmp_path / "tt.safetensors", tmp_path / "hf", recipe="torchtitan-moe-to-hf")
    assert {p.kind for p in e.value.report.problems} == {"inconsistent"}
    assert not (tmp_path / "hf").exists()
    # HF side: per-expert keys of layer 0 with expert 3's gate_proj gone, router of 4 rows
    hf = {f"model.layers.0.mlp.gate.weight": r(E, H), "model.layers.0.input_layernorm.weight": r(H)}
    for e_ in range(E):
        for p, shape in (("gate_proj", (F, H)), ("up_proj", (F, H)), ("down_proj", (H, F))):
            if not (e_ == 3 and p == "gate_proj"):
                hf[f"model.layers.0.mlp.experts.{e_}.{p}.weight"] = r(*shape)
    safetensors.torch.save_file(hf, tmp_path / "hf.safetensors")
    with pytest.raises(ConversionError, match="count"):
        checkpoint.migrate(tmp_path / "hf.safetensors", tmp_path / "tt", recipe="hf-to-torchtitan-moe")
    assert not (tmp_path / "tt").exists()


def test_stacked_parts_of_different_dtypes_refused(tmp_path):
    """torch.stack would promote a bfloat16 expert among float32 ones silently."""
    import safetensors.torch

    g = torch.Generator().manual_seed(1)
    hf = {"model.layers.0.mlp.gate.weight": torch.randn(2, H, generator=g)}
    for e_ in range(2):
        for p, shape in (("gate_proj", (16, H)), ("up_proj", (16, H)), ("down_proj", (H, 16))):
            t = torch.randn(*shape, generator=g)
            hf[f"model.layers.0.mlp.experts.{e_}.{p}.weight"] = t.bfloat16() if (e_, p) == (1, "up_proj") else t
    safetensors.torch.save_file(hf, tmp_path / "hf.safetensors")
    with pytest.raises(ConversionError, match="different dtypes"):
        checkpoint.migrate(tmp_path / "hf.safetensors", tmp_path / "tt", recipe="hf-to-torchtitan-moe")
    assert not (tmp_path / "tt").exists()


@pytest.mark.parametrize("how", ["nan-payload", "negative-zero", "value"])
def test_replicated_shards_compared_by_bits_before_writing(tmp_path, how):
    """Norms are replicated on every Meta shard: shard 1's copy must be the same bits (torch.equal
    calls -0.0 equal to 0.0 and NaN unequal to itself)."""
    sd = meta_state_dict()
    if how != "value":
        sd["norm.weight"][3] = float("nan") if how == "nan-payload" else 0.0
    parts = meta_shards(sd, 2)
    t = parts[1]["norm.weight"]
    if how == "nan-payload":
        t.view(torch.int32)[3] ^= 1  # another NaN
    elif how == "negative-zero":
        t[3] = -0.0
    else:
        t[0] += 1e-6
    src = tmp_path / "meta"
    src.mkdir()
    for i, p in enumerate(parts):
        torch.save(p, src / f"consolidated.{i:02d}.pth")
    (src / "params.json").write_text(json.dumps(PARAMS))
    with pytest.raises(ConversionError, match="'norm.weight' differs bit for bit between shard 0 and shard"):
        checkpoint.migrate(src, tmp_path / "hf", recipe="meta-llama-to-hf", dry_run=True)
    assert not (tmp_path / "hf").exists()


def test_uneven_meta_shards_refused_by_name(tmp_path):
    """Shards of 31 and 30 output rows are not an even model-parallel split: SplitShards could not
    give them back, so the conversion is refused (not joined into a checkpoint that cannot return)."""
    src = tmp_path / "meta"
    src.mkdir()
    for i, part in enumerate(meta_shards(meta_state_dict(), 2)):
        torch.save(part, src / f"consolidated.{i:02d}.pth")
    (src / "params.json").write_text(json.dumps(PARAMS))
    with pytest.raises(ConversionError, match=r"output.weight.*shards differ along dim 0 \(\[31, 30\]\)"):
        checkpoint.migrate(src, tmp_path / "hf", recipe="meta-llama-to-hf")
    assert not (tmp_path / "hf").exists()


def test_conversion_whose_inverse_does_not_give_back_the_source_is_refused(tmp_path):
    """A recipe with a lossy op (flattens; its 'inverse' leaves the tensor flat): the inverse
    planned over the planned output gives other shapes than the source, so nothing is written."""
    from dataclasses import dataclass

    import safetensors.torch

    from checkpoint.convert import Op, Recipe, Rule

    @dataclass(frozen=True)
    class Flatten(Op):
        def apply(self, values, dims):
            return [v.reshape(-1) for v in values]

        def inverse(self):
            return Keep()

    @dataclass(frozen=True)
    class Keep(Op):
        def apply(self, values, dims):
            return values

        def inverse(self):
            return Flatten()

    safetensors.torch.save_file({"a.weight": torch.ones(2, 3)}, tmp_path / "x.safetensors")
    lossy = Recipe("flatten", "unflatten", (Rule("a.weight", "b.weight", (Flatten(),)),))
    with pytest.raises(ConversionError, match=r"inverse: a.weight: source \(\(2, 3\), 'torch.float32'\), inverse gives \(\(6,\)") as e:
        checkpoint.migrate(tmp_path / "x.safetensors", tmp_path / "out", recipe=lossy)
    assert [p.kind for p in e.value.report.problems] == ["inverse"]
    assert not (tmp_path / "out").exists()
    ok = Recipe("rename", "unrename", (Rule("a.weight", "b.weight"),))
    rep = checkpoint.migrate(tmp_path / "x.safetensors", tmp_path / "out", recipe=ok)
    assert any(c.startswith("the inverse recipe unrename applied to the planned output gives back") for c in rep.checks)


# torchtitan's names at each version (pytorch/torchtitan history of the llama3 / qwen3 adapters and
# models): the test's own table, read from the commits, not fqnckpt's.
TITAN_NAMES = {
    "legacy": {"out": "output.weight", "wk": "layers.0.attention.wk.weight", "w1": "layers.1.moe.experts.w1", "bias": "layers.1.moe.expert_bias"},
    "786e26f": {"out": "lm_head.weight", "wk": "layers.0.attention.wk.weight", "w1": "layers.1.moe.experts.w1", "bias": "layers.1.moe.expert_bias"},
    "200100e": {"out": "lm_head.weight", "wk": "layers.0.attention.wk.weight", "w1": "layers.1.moe.experts.w1_EFD", "bias": "layers.1.moe.expert_bias_E"},
    "70dd945": {"out": "lm_head.weight", "wk": "layers.0.attention.qkv_linear.wk.weight", "w1": "layers.1.moe.experts.w1_EFD", "bias": "layers.1.moe.expert_bias_E"},
    "3101b42": {"out": "lm_head.weight", "wk": "layers.0.attention.qkv_linear.wk.weight", "w1": "layers.1.moe.routed_experts.inner_experts.w1_EFD", "bias": "layers.1.moe.expert_bias_E"},
}  # fmt: skip


def small_hf_moe() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(4)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    hf = {"model.embed_tokens.weight": r(V, H), "model.norm.weight": r(H), "lm_head.weight": r(V, H)}
    for i in range(2):
        p = f"model.layers.{i}."
        hf |= {p + "self_attn.q_proj.weight": r(NH * 8, H), p + "self_attn.k_proj.weight": r(NKV * 8, H),
               p + "self_attn.v_proj.weight": r(NKV * 8, H), p + "self_attn.o_proj.weight": r(H, NH * 8),
               p + "input_layernorm.weight": r(H), p + "post_attention_layernorm.weight": r(H)}  # fmt: skip
    hf |= {"model.layers.0.mlp.gate_proj.weight": r(FF, H), "model.layers.0.mlp.up_proj.weight": r(FF, H),
           "model.layers.0.mlp.down_proj.weight": r(H, FF), "model.layers.1.mlp.gate.weight": r(4, H),
           "model.layers.1.mlp.gate.e_score_correction_bias": r(4), "model.layers.1.mlp.shared_experts.gate_proj.weight": r(16, H),
           "model.layers.1.mlp.shared_experts.up_proj.weight": r(16, H), "model.layers.1.mlp.shared_experts.down_proj.weight": r(H, 16)}  # fmt: skip
    for e in range(4):
        hf |= {f"model.layers.1.mlp.experts.{e}.{p}.weight": r(*s) for p, s in (("gate_proj", (16, H)), ("up_proj", (16, H)), ("down_proj", (H, 16)))}
    return hf


@pytest.mark.parametrize("version", list(TITAN_NAMES))
def test_every_torchtitan_version_both_ways(tmp_path, capsys, version):
    """HF -> torchtitan@version writes that version's names (the test's table); torchtitan ->
    HF detects the version from the keys alone and gives the HF tensors back bit for bit."""
    import safetensors.torch

    hf = small_hf_moe()
    safetensors.torch.save_file(hf, tmp_path / "hf.safetensors")
    rep = checkpoint.migrate(tmp_path / "hf.safetensors", tmp_path / "tt", recipe=f"hf-to-torchtitan-moe@{version}", dims={"n_heads": NH, "n_kv_heads": NKV})
    assert rep.layouts == {"target": f"torchtitan {version}"}
    tt = read(tmp_path / "tt")
    assert set(TITAN_NAMES[version].values()) <= set(tt)
    others = {n for v, names in TITAN_NAMES.items() for n in names.values()} - set(TITAN_NAMES[version].values())
    assert not others & set(tt)
    assert torch.equal(tt[TITAN_NAMES[version]["w1"]][2], hf["model.layers.1.mlp.experts.2.gate_proj.weight"])
    back = checkpoint.migrate(tmp_path / "tt", tmp_path / "back", recipe="torchtitan-moe-to-hf", dims={"n_heads": NH, "n_kv_heads": NKV})
    assert back.layouts["source"] == f"torchtitan {version}"  # every axis present: one version fits
    assert_same_state(read(tmp_path / "back"), hf)
    # the version, detected, is also what `fqnckpt inspect` names
    from checkpoint.cli.main import main

    assert main(["--json", "inspect", str(tmp_path / "tt")]) == 0
    assert json.loads(capsys.readouterr().out)["layout"] == f"torchtitan {version}"


def test_torchtitan_mixed_or_wrong_version_refused(tmp_path):
    import safetensors.torch

    hf = small_hf_moe()
    safetensors.torch.save_file(hf, tmp_path / "hf.safetensors")
    d = {"n_heads": NH, "n_kv_heads": NKV}
    checkpoint.migrate(tmp_path / "hf.safetensors", tmp_path / "tt", recipe="hf-to-torchtitan-moe", dims=d)
    tt = read(tmp_path / "tt")
    tt["output.weight"] = tt.pop("lm_head.weight")  # a legacy name among today's
    safetensors.torch.save_file(tt, tmp_path / "mixed.safetensors")
    with pytest.raises(RecipeError, match="mixes torchtitan names of different versions.*'output.weight' \\(output as of legacy\\)"):
        checkpoint.migrate(tmp_path / "mixed.safetensors", tmp_path / "x", recipe="torchtitan-moe-to-hf", dims=d)
    with pytest.raises(RecipeError, match="is torchtitan 3101b42..3101b42, not 'legacy'"):
        checkpoint.migrate(tmp_path / "tt", tmp_path / "x", recipe="torchtitan-moe-to-hf@legacy", dims=d)
    with pytest.raises(RecipeError, match="no layout version 'v9'"):
        checkpoint.migrate(tmp_path / "hf.safetensors", tmp_path / "x", recipe="hf-to-torchtitan-moe@v9", dims=d)
    assert not (tmp_path / "x").exists()


def test_tied_torchtitan_llama_both_ways(tmp_path):
    """A weight-tied Llama (tie_word_embeddings): HF -> torchtitan writes lm_head.weight as a copy of
    the embeddings (torchtitan's from_hf fills it so under enable_weight_tying); torchtitan -> HF
    into the tied model drops the copy after comparing its bits (torchtitan's to_hf drops it), a
    copy that differs is refused. Logits equal to the reference forward of the torchtitan weights."""
    cfg = llama_config()
    cfg.tie_word_embeddings = True
    hf = randomize(transformers.LlamaForCausalLM(cfg), 6)
    hf.tie_weights()
    checkpoint.save(hf, tmp_path / "hf")
    assert "lm_head.weight" not in read(tmp_path / "hf")
    rep = checkpoint.migrate(tmp_path / "hf", tmp_path / "tt", recipe="hf-to-torchtitan-llama3", model=hf)
    raw = read(tmp_path / "tt")
    assert torch.equal(raw["lm_head.weight"], raw["tok_embeddings.weight"]) and any("tied model" in c for c in rep.checks)
    assert_same_model(lambda ids: refs.meta_llama_logits(refs.titan_legacy(raw), NH, NKV, ids), hf)
    fresh = transformers.LlamaForCausalLM(cfg).eval()
    back = checkpoint.migrate(tmp_path / "tt", tmp_path / "back", recipe="torchtitan-llama3-to-hf", model=fresh)
    assert back.dropped == ["lm_head.weight"]
    assert_same_state(read(tmp_path / "back"), read(tmp_path / "hf"))
    checkpoint.load(fresh, tmp_path / "back")
    assert_same_model(lambda ids: refs.meta_llama_logits(refs.titan_legacy(raw), NH, NKV, ids), fresh)
    import safetensors.torch

    raw["lm_head.weight"] = raw["lm_head.weight"].clone()
    raw["lm_head.weight"][0, 0] += 1
    safetensors.torch.save_file(raw, tmp_path / "untied.safetensors")
    with pytest.raises(ConversionError, match="ties them but the source's 'tok_embeddings.weight' and 'lm_head.weight' differ"):
        checkpoint.migrate(tmp_path / "untied.safetensors", tmp_path / "x", recipe="torchtitan-llama3-to-hf", model=fresh)
    assert not (tmp_path / "x").exists()


def read_config_as_transformers_4(path) -> dict:
    """What transformers 4.x's LlamaConfig takes from config.json: ``rope_theta`` (default 10000)
    and ``rope_scaling`` (it has no ``rope_parameters``), max positions, bos / eos ids."""
    cfg = json.loads((path / "config.json").read_text())
    return {"rope_theta": cfg.get("rope_theta", 10000.0), "rope_scaling": cfg.get("rope_scaling"),
            "max_position_embeddings": cfg.get("max_position_embeddings", 2048), "bos": cfg.get("bos_token_id", 1),
            "eos": cfg.get("eos_token_id", 2)}  # fmt: skip


def test_meta_llama31_scaled_rope_and_params_keys_both_ways(tmp_path):
    """Llama 3.1's params.json (rope_theta 500000, use_scaled_rope, multiple_of / ffn_dim_multiplier)
    -> HF with no model: config.json read by transformers 5 (rope_parameters) and as 4.x reads it
    (rope_theta + rope_scaling) gives Meta's scaled RoPE (inv_freq equal to Meta's apply_scaling,
    logits equal to Meta's forward with scaling and not without), max positions, bos / eos,
    generation_config.json. Back to Meta: params.json has the source's keys and values exactly."""
    params = PARAMS | {"rope_theta": 500000.0, "use_scaled_rope": True, "multiple_of": 16, "ffn_dim_multiplier": 0.75}
    sd = meta_state_dict(12)
    src = write_meta(tmp_path / "meta", sd, params)
    rep = checkpoint.migrate(src, tmp_path / "hf", recipe="meta-llama-to-hf")
    assert any("gives back every key" in c for c in rep.checks)
    old = read_config_as_transformers_4(tmp_path / "hf")
    assert old["rope_theta"] == 500000.0 and old["rope_scaling"]["rope_type"] == "llama3" and old["rope_scaling"]["factor"] == 8.0
    assert old["max_position_embeddings"] == 131072 and (old["bos"], old["eos"]) == (1, 2)  # a 61-token vocabulary is not tiktoken's
    gen = json.loads((tmp_path / "hf" / "generation_config.json").read_text())
    assert (gen["bos_token_id"], gen["eos_token_id"]) == (1, 2)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert hf.config.rope_parameters["rope_type"] == "llama3" and hf.config.rope_parameters["rope_theta"] == 500000.0
    freqs = 1.0 / 500000.0 ** (torch.arange(0, H // NH, 2).float() / (H // NH))
    torch.testing.assert_close(hf.model.rotary_emb.inv_freq, refs.meta_scaled_freqs(freqs), rtol=1e-6, atol=0)
    long = torch.randint(0, V, (1, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got = hf(long).logits
        want = refs.meta_llama_logits(sd, NH, NKV, long, theta=500000.0, scaled=True)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
        assert (got - refs.meta_llama_logits(sd, NH, NKV, long, theta=500000.0)).abs().max() > 1e-4
    back = checkpoint.migrate(tmp_path / "hf", tmp_path / "back", recipe="hf-to-meta-llama")
    assert json.loads((tmp_path / "back" / "params.json").read_text()) == params
    assert any("gives back the source config.json" in c for c in back.checks)
    assert_same_state(read(tmp_path / "back"), sd)


def test_hf_llama3_scaled_rope_to_meta_and_back(tmp_path):
    """An HF Llama 3.1-style config (transformers 5 rope_parameters, llama3 scaling) -> Meta writes
    use_scaled_rope; HF -> Meta -> HF gives the same rope and sizes; an HF rope scaling Meta cannot
    say (yarn) is refused naming it, nothing written."""
    cfg = llama_config()
    cfg.rope_parameters = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                           "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}  # fmt: skip
    cfg.max_position_embeddings = 131072
    hf = randomize(transformers.LlamaForCausalLM(cfg), 13)
    checkpoint.save(hf, tmp_path / "hf")
    checkpoint.migrate(tmp_path / "hf", tmp_path / "meta", recipe="hf-to-meta-llama")
    params = json.loads((tmp_path / "meta" / "params.json").read_text())
    assert params["use_scaled_rope"] is True and params["rope_theta"] == 500000.0 and params["max_seq_len"] == 131072
    checkpoint.migrate(tmp_path / "meta", tmp_path / "hf2", recipe="meta-llama-to-hf")
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf2").eval()
    # with the model given, config.json is the model's, with 4.x's RoPE keys beside 5's
    checkpoint.migrate(tmp_path / "meta", tmp_path / "hf3", recipe="meta-llama-to-hf", model=transformers.LlamaForCausalLM(cfg))
    old = read_config_as_transformers_4(tmp_path / "hf3")
    assert old["rope_theta"] == 500000.0 and old["rope_scaling"]["rope_type"] == "llama3" and old["rope_scaling"]["factor"] == 8.0
    assert again.config.rope_parameters == hf.config.rope_parameters
    assert again.config.max_position_embeddings == 131072 and again.config.intermediate_size == FF
    assert_same_model(lambda ids: hf(ids).logits, again)
    cfg.rope_parameters = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64}
    checkpoint.save(transformers.LlamaForCausalLM(cfg), tmp_path / "yarn")
    with pytest.raises(ConversionError, match="RoPE scaling 'yarn' has no Meta params.json spelling"):
        checkpoint.migrate(tmp_path / "yarn", tmp_path / "m", recipe="hf-to-meta-llama")
    assert not (tmp_path / "m").exists()


def test_qwen3_moe_expert_bias_refused_by_name_or_dropped(tmp_path):
    """torchtitan's Qwen3-MoE keeps moe.expert_bias (load balancing); transformers' Qwen3-MoE has no
    such weight and DeepSeek's e_score_correction_bias would be an unexpected key there: refused
    by name, or dropped with +drop-expert-bias (reported), and the result loads into
    Qwen3MoeForCausalLM with the same logits."""
    import safetensors.torch

    model = qwen3_moe()
    model.save_pretrained(tmp_path / "hub")
    checkpoint.migrate(tmp_path / "hub", tmp_path / "tt", recipe="hf-to-torchtitan-moe", model=model)
    tt = read(tmp_path / "tt")
    tt |= {f"layers.{i}.moe.expert_bias_E": torch.randn(4) for i in range(L)}
    safetensors.torch.save_file(tt, tmp_path / "tt_bias.safetensors")
    with pytest.raises(ConversionError, match="expert_bias of a layer without shared experts .Qwen3-MoE.") as e:
        checkpoint.migrate(tmp_path / "tt_bias.safetensors", tmp_path / "x", recipe="torchtitan-moe-to-hf", model=model)
    assert {k for p in e.value.report.problems for k in p.keys} == {f"layers.{i}.moe.expert_bias_E" for i in range(L)}
    assert not (tmp_path / "x").exists()
    with pytest.raises(RecipeError, match="has no option 'drop-everything'"):
        checkpoint.migrate(tmp_path / "tt_bias.safetensors", tmp_path / "x", recipe="torchtitan-moe-to-hf+drop-everything", model=model)
    rep = checkpoint.migrate(tmp_path / "tt_bias.safetensors", tmp_path / "hf", recipe="torchtitan-moe-to-hf+drop-expert-bias", model=model)
    assert sorted(rep.dropped) == [f"layers.{i}.moe.expert_bias_E" for i in range(L)]
    assert not any("e_score_correction_bias" in k or "expert_bias" in k for k in read(tmp_path / "hf"))
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert_same_model(lambda ids: model(ids).logits, again)


# Megatron-core's norm names without Transformer Engine (Megatron-Bridge model bridges): the
# test's own map to TE's fused names, which the reference forward reads.
MEGATRON_LOCAL_TO_TE = {".input_layernorm.weight": ".self_attention.linear_qkv.layer_norm_weight",
                        ".pre_mlp_layernorm.weight": ".mlp.linear_fc1.layer_norm_weight"}  # fmt: skip


def test_megatron_local_norm_names_both_ways(tmp_path, capsys):
    hf = randomize(transformers.LlamaForCausalLM(llama_config()), 4)
    checkpoint.save(hf, tmp_path / "hf")
    rep = checkpoint.migrate(tmp_path / "hf", tmp_path / "mg", recipe="hf-to-megatron-gpt@local", model=hf)
    assert rep.layouts == {"target": "megatron local"}
    mg = read(tmp_path / "mg")
    assert "decoder.layers.1.pre_mlp_layernorm.weight" in mg and not any("layer_norm_weight" in k for k in mg)
    te = {next((k.replace(a, b) for a, b in MEGATRON_LOCAL_TO_TE.items() if k.endswith(a)), k): v for k, v in mg.items()}
    assert_same_model(lambda ids: refs.megatron_gpt_logits(te, NH, NKV, ids), hf)
    back = checkpoint.migrate(tmp_path / "mg", tmp_path / "back", recipe="megatron-gpt-to-hf", model=hf)
    assert back.layouts == {"source": "megatron local"}  # detected from the names
    assert_same_state(read(tmp_path / "back"), read(tmp_path / "hf"))
    from checkpoint.cli.main import main

    assert main(["--json", "inspect", str(tmp_path / "mg")]) == 0
    assert json.loads(capsys.readouterr().out)["layout"] == "megatron local (non-TE norm names)"


def test_megatron_qwen3_qk_layernorm_both_ways(tmp_path):
    """Qwen3 (per-head q / k norms) through Megatron's names (q_layernorm / k_layernorm, as
    Megatron-Bridge maps them): HF -> Megatron -> HF bit-identical, the model loaded back gives the
    original logits."""
    cfg = transformers.Qwen3Config(vocab_size=V, hidden_size=H, intermediate_size=FF, num_hidden_layers=L,
                                   num_attention_heads=NH, num_key_value_heads=NKV, head_dim=8, max_position_embeddings=64,
                                   tie_word_embeddings=False)  # fmt: skip
    hf = randomize(transformers.Qwen3ForCausalLM(cfg), 14)
    checkpoint.save(hf, tmp_path / "hf")
    checkpoint.migrate(tmp_path / "hf", tmp_path / "mg", recipe="hf-to-megatron-gpt", model=hf)
    mg = read(tmp_path / "mg")
    assert torch.equal(mg["decoder.layers.1.self_attention.k_layernorm.weight"], hf.model.layers[1].self_attn.k_norm.weight)
    checkpoint.migrate(tmp_path / "mg", tmp_path / "back", recipe="megatron-gpt-to-hf", model=hf)
    assert_same_state(read(tmp_path / "back"), read(tmp_path / "hf"))
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back").eval()
    assert_same_model(lambda ids: hf(ids).logits, again)


def test_recipe_table_names_sources_versions_and_options():
    from checkpoint.convert import recipe_table

    rows = {r["name"]: r for r in recipe_table()}
    assert all(r["source"] for r in rows.values()), [n for n, r in rows.items() if not r["source"]]
    assert "b5bcd76" in rows["hf-to-torchtitan-moe"]["source"] and rows["hf-to-torchtitan-moe"]["versions"][-1] == "3101b42"
    assert rows["hf-to-meta-llama"]["versions"] == ["llama2", "llama3"] and rows["megatron-gpt-to-hf"]["versions"] == ["local", "te"]
    assert rows["torchtitan-moe-to-hf"]["options"] == ["drop-expert-bias"]


def test_unknown_recipe_lists_every_recipe_fqnckpt_recipes_lists():
    from checkpoint.convert import get_recipe, recipe_table

    with pytest.raises(RecipeError) as e:
        get_recipe("no-such")
    names = sorted(r["name"] for r in recipe_table())
    assert "dequantize-bf16" in names and "quantize-fp8" in names
    assert str(e.value) == f"unknown recipe 'no-such'; known: {names}"
    with pytest.raises(RecipeError, match=r"recipe 'dequantize-bf16' converts a whole checkpoint: checkpoint\.migrate"):
        get_recipe("dequantize-bf16")


def test_deepseek_v3_mtp_layers_both_ways(tmp_path):
    """torchtitan's DeepSeek-V3 multi-token-prediction layer (mtp_layers.0.*: a whole MoE block plus
    enorm / hnorm / eh_proj / mtp_norm) is HF's model.layers.{n_layers}.* (shared_head.norm for
    mtp_norm), as torchtitan's adapter maps it; torchtitan -> HF -> torchtitan bit-identical."""
    import safetensors.torch

    model = deepseek_v3(16)
    model.save_pretrained(tmp_path / "hub")
    checkpoint.migrate(tmp_path / "hub", tmp_path / "tt", recipe="hf-to-torchtitan-moe")
    tt = read(tmp_path / "tt")
    g = torch.Generator().manual_seed(3)
    mtp = {k.replace("layers.2.", "mtp_layers.0.", 1): v + 1 for k, v in tt.items() if k.startswith("layers.2.")}
    mtp |= {"mtp_layers.0.enorm.weight": torch.randn(H, generator=g), "mtp_layers.0.hnorm.weight": torch.randn(H, generator=g),
            "mtp_layers.0.eh_proj.weight": torch.randn(H, 2 * H, generator=g), "mtp_layers.0.mtp_norm.weight": torch.randn(H, generator=g)}  # fmt: skip
    safetensors.torch.save_file(tt | mtp, tmp_path / "tt_mtp.safetensors")
    with pytest.raises(RecipeError) as e:  # n_layers unknown: no place for them, said in one line
        checkpoint.migrate(tmp_path / "tt_mtp.safetensors", tmp_path / "x", recipe="torchtitan-moe-to-hf")
    assert "n_layers is unknown" in str(e.value) and "--dim n_layers=N" in str(e.value) and "\n" not in str(e.value)
    assert len(str(e.value)) < 400 and not (tmp_path / "x").exists()
    checkpoint.migrate(tmp_path / "tt_mtp.safetensors", tmp_path / "hf", recipe="torchtitan-moe-to-hf", model=model)
    hf = read(tmp_path / "hf")
    assert torch.equal(hf["model.layers.3.shared_head.norm.weight"], mtp["mtp_layers.0.mtp_norm.weight"])
    assert torch.equal(hf["model.layers.3.eh_proj.weight"], mtp["mtp_layers.0.eh_proj.weight"])
    assert torch.equal(hf["model.layers.3.mlp.experts.5.down_proj.weight"], mtp["mtp_layers.0.moe.routed_experts.inner_experts.w2_EDF"][5])
    assert not any(k.startswith("model.layers.4.") for k in hf)
    checkpoint.migrate(tmp_path / "hf", tmp_path / "back", recipe="hf-to-torchtitan-moe")  # n_layers from config.json
    assert_same_state(read(tmp_path / "back"), tt | mtp)
    # fqnckpt's own torchtitan output converts back with no model and no dims: n_layers from its report
    rep = checkpoint.migrate(tmp_path / "back", tmp_path / "hf2", recipe="torchtitan-moe-to-hf")
    assert rep.dim_sources["conversion_report.json"]["n_layers"] == 3
    assert_same_state(read(tmp_path / "hf2"), hf)


@pytest.mark.parametrize("how", ["w3-rows", "w2-cols", "w2-dtype"])
def test_expert_stacks_of_one_layer_agree_in_shape_and_dtype(tmp_path, how):
    """Counts equal but w3 narrower than w1, w2 not w1 transposed, or w2 of another dtype: per-expert
    tensors no model loads; refused naming both stacks, both directions, nothing written."""
    import safetensors.torch

    g = torch.Generator().manual_seed(2)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    E, F = 4, 16
    tt = {"layers.0.moe.router.gate.weight": r(E, H), "layers.0.moe.experts.w1": r(E, F, H),
          "layers.0.moe.experts.w3": r(E, F // 2 if how == "w3-rows" else F, H),
          "layers.0.moe.experts.w2": r(E, H, F // 2 if how == "w2-cols" else F)}  # fmt: skip
    if how == "w2-dtype":
        tt["layers.0.moe.experts.w2"] = tt["layers.0.moe.experts.w2"].bfloat16()
    safetensors.torch.save_file(tt, tmp_path / "tt.safetensors")
    with pytest.raises(ConversionError, match="the stacks of one layer must agree") as e:
        checkpoint.migrate(tmp_path / "tt.safetensors", tmp_path / "hf", recipe="torchtitan-moe-to-hf")
    assert {p.kind for p in e.value.report.problems} == {"inconsistent"}
    hf = {"model.layers.0.mlp.gate.weight": tt["layers.0.moe.router.gate.weight"]}
    for i in range(E):
        for p, w in (("gate_proj", "w1"), ("up_proj", "w3"), ("down_proj", "w2")):
            hf[f"model.layers.0.mlp.experts.{i}.{p}.weight"] = tt[f"layers.0.moe.experts.{w}"][i].clone()
    safetensors.torch.save_file(hf, tmp_path / "hf.safetensors")
    with pytest.raises(ConversionError, match="the stacks of one layer must agree"):
        checkpoint.migrate(tmp_path / "hf.safetensors", tmp_path / "tt", recipe="hf-to-torchtitan-moe")
    assert not (tmp_path / "hf").exists() and not (tmp_path / "tt").exists()


def test_cli_layout_flag_writes_legacy_torchtitan_names(tmp_path, capsys):
    from checkpoint.cli.main import main

    hf = randomize(transformers.LlamaForCausalLM(llama_config()), 1)
    checkpoint.save(hf, tmp_path / "hf")
    assert main(["--json", "migrate", str(tmp_path / "hf"), str(tmp_path / "tt"), "--recipe", "hf-to-torchtitan-llama3", "--layout", "legacy"]) == 0
    assert json.loads(capsys.readouterr().out)["layouts"] == {"target": "torchtitan legacy"}
    assert {"output.weight", "layers.0.attention.wq.weight"} <= set(read(tmp_path / "tt"))
    code = main(["--json", "migrate", str(tmp_path / "hf"), str(tmp_path / "x"), "--recipe", "hf-to-torchtitan-llama3", "--layout", "v0"])
    out = json.loads(capsys.readouterr().out)
    assert code == 2 and out["flag"] == "--recipe" and "no layout version 'v0'" in out["message"]
    assert not (tmp_path / "x").exists()
