"""Per-rank checks of ``init_weights`` writing through views, tied parameters and transformers'
own init, run inside the 4-rank spawn of tests/test_mesh_independent_init.py (meshes of 1, 2 and 4
ranks and 2x2): every result is compared with ``mesh_independent_init`` on the eager model by
``torch.equal`` of full tensors."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.debug import CommDebugMode

from autoparallel import (
    FullTensorWarning,
    InitWriteError,
    build_parallel_module,
    capture,
    default_plan,
    mesh_independent_init,
    wrap_init_weights,
)


class Views(nn.Module):
    """Writes through indexing, slices and views of parameters and a buffer; none reads a view, so
    no rank needs another's elements. Dims split unevenly over 2 and 4 ranks."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 6, padding_idx=3)
        self.a = nn.Parameter(torch.empty(9, 7))
        self.b = nn.Parameter(torch.empty(5, 8))
        self.c = nn.Parameter(torch.empty(6, 5))
        self.register_buffer("mask", torch.empty(7, 6))

    def init_weights(self):
        nn.init.normal_(self.emb.weight)
        nn.init.zeros_(self.emb.weight[self.emb.padding_idx])  # transformers' padding row
        self.emb.weight.data[7] = 0.5  # through .data
        nn.init.uniform_(self.a, -1.0, 1.0)
        nn.init.normal_(self.b)
        nn.init.normal_(self.c)
        with torch.no_grad():
            self.a[0].zero_()
            self.a[:, 2].fill_(2.0)  # a column
            self.a[2:7, 1:4].normal_(0.0, 3.0)  # a block: its own (temporary) random stream
            self.a[1].mul_(-1.0)  # element-wise, reading the row
            self.a.data[:, 6] = 0.5  # a column through .data
            nn.init.eye_(self.a[3:6, 4:7])  # torch.eye(..., out=view)
            self.a[:, 3:6][7].fill_(-2.0)  # a row of a strided view (kept local on Shard(0))
            self.a[8].masked_fill_(torch.arange(7) % 2 == 0, 7.0)
            self.b.view(-1)[5:30].normal_()  # a view of a view
            self.b.t()[3].copy_(torch.arange(5.0))  # column 3 of b
            for i, row in enumerate(self.c.unbind(0)):
                row[i % 5] = float(i)
        nn.init.trunc_normal_(self.c[1:4], std=0.5)
        nn.init.ones_(self.mask)
        self.mask[2].zero_()
        self.mask[:, 5].uniform_()


class ReadViews(nn.Module):
    """Ops that need a view's (or the tensor's) values: on a sharded tensor they make its full
    tensor on every rank, announced by a FullTensorWarning."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.empty(7, 6))

    def init_weights(self):
        nn.init.normal_(self.w)
        with torch.no_grad():
            self.w[torch.tensor([0, 5])] = 0.25  # index_put_ on the tensor itself
            self.w[1].div_(self.w[1].norm())
            self.w[2].copy_(self.w[4] * 2.0)


class Tied(nn.Module):
    """An embedding tied to a head, and a four-name tie (T5's shape), each written several times:
    in eager order, the last write wins."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 6, padding_idx=0)
        self.head = nn.Linear(6, 10, bias=False)
        self.head.weight = self.emb.weight
        self.shared = nn.Embedding(9, 4)
        self.enc = nn.Embedding(9, 4)
        self.dec = nn.Embedding(9, 4)
        self.lm = nn.Linear(4, 9, bias=False)
        self.enc.weight = self.dec.weight = self.lm.weight = self.shared.weight

    def init_weights(self):
        nn.init.normal_(self.emb.weight)
        nn.init.zeros_(self.emb.weight[0])
        nn.init.normal_(self.head.weight, std=0.5)  # the same tensor: overwrites the zero row
        nn.init.normal_(self.shared.weight, std=1.0)
        nn.init.normal_(self.enc.weight, std=2.0)
        nn.init.zeros_(self.dec.weight[1])
        with torch.no_grad():
            self.lm.weight[2].fill_(3.0)


def hf_models() -> dict:
    """Tiny transformers models: padding rows set; Qwen2, Gemma2 and GPT-2 tie the head to the
    embedding, T5 ties four names to one embedding."""
    import transformers as tf

    small = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4)
    small.update(num_key_value_heads=2, max_position_embeddings=64, use_cache=False, pad_token_id=3)
    return {
        "llama": lambda: tf.LlamaForCausalLM(tf.LlamaConfig(vocab_size=66, **small)),
        "qwen2": lambda: tf.Qwen2ForCausalLM(
            tf.Qwen2Config(vocab_size=66, tie_word_embeddings=True, **small)
        ),
        "gemma2": lambda: tf.Gemma2ForCausalLM(tf.Gemma2Config(vocab_size=66, head_dim=8, **small)),
        "gpt2": lambda: tf.GPT2LMHeadModel(
            tf.GPT2Config(
                vocab_size=66, n_embd=32, n_layer=1, n_head=4, n_positions=64, bos_token_id=0, eos_token_id=0
            )
        ),
        "t5": lambda: tf.T5ForConditionalGeneration(
            tf.T5Config(
                vocab_size=66, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=4, use_cache=False
            )
        ),
    }


def distribute(model: nn.Module, mesh, placements_of) -> nn.Module:
    """Swap every parameter / buffer for a DTensor (local chunk only, no comms; tied tensors stay
    one DTensor), as the parallel module holds them, and wrap init_weights as it does."""
    done: dict[int, torch.Tensor] = {}
    for mod in model.modules():
        for store in (mod._parameters, mod._buffers):
            for key, t in store.items():
                if t is None:
                    continue
                if id(t) not in done:
                    pl = placements_of(t.dim()) if t.dim() else (Replicate(),) * mesh.ndim
                    dt = distribute_tensor(t.detach(), mesh, pl, src_data_rank=None)
                    done[id(t)] = nn.Parameter(dt, t.requires_grad) if isinstance(t, nn.Parameter) else dt
                store[key] = done[id(t)]
    wrap_init_weights(model)
    return model


def full_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Full values of the state dict and of the non-persistent buffers (rotary ``inv_freq``)."""
    state = {**model.state_dict(), **dict(model.named_buffers())}
    return {k: (v.full_tensor() if isinstance(v, DTensor) else v) for k, v in state.items()}


def unequal(got: dict, want: dict) -> list[str]:
    """The keys whose tensors differ (dtype, shape or any bit)."""
    assert list(got) == list(want)
    return [k for k in want if got[k].dtype != want[k].dtype or not torch.equal(got[k], want[k])]


def _on_meta(make) -> nn.Module:
    with torch.device("meta"):
        model = make()
    return model.to_empty(device="cpu")


def _input_embedding_fqn(model: nn.Module) -> str:
    emb = model.get_input_embeddings().weight
    return next(k for k, v in model.named_parameters() if v is emb)


def _reference(make) -> dict[str, torch.Tensor]:
    eager = make()
    torch.manual_seed(5)
    return full_state(mesh_independent_init(eager))


def _init(model: nn.Module) -> tuple[list[str], int]:
    """init_weights() from seed 5: (FQNs named by FullTensorWarnings, collective count)."""
    torch.manual_seed(5)
    with warnings.catch_warnings(record=True) as caught, CommDebugMode() as comm:
        warnings.simplefilter("always")
        model.init_weights()
    made = sorted({str(w.message).split("'")[1] for w in caught if issubclass(w.category, FullTensorWarning)})
    return made, comm.get_total_counts()


def view_checks(meshes: dict, plans) -> dict:
    """Views, ReadViews and Tied on every mesh and plan (``plans(mesh_shape)``: {name: placements
    of a tensor's ndim}); transformers models on every mesh with a Shard(0)/Shard(1) plan.
    Returns ``{(mesh, case): [unequal FQNs]}`` (empty lists: bit-identical)."""
    out: dict = {}
    want = {name: _reference(cls) for name, cls in (("views", Views), ("reads", ReadViews), ("tied", Tied))}
    # The semantics the references pin: padding row and writes through views kept, last write wins.
    assert torch.equal(want["views"]["emb.weight"][3], torch.zeros(6))
    assert torch.equal(want["views"]["emb.weight"][7], torch.full((6,), 0.5))
    assert torch.equal(want["views"]["b"][:, 3], torch.arange(5.0))
    assert not torch.equal(want["tied"]["emb.weight"][0], torch.zeros(6))  # the head's normal_ won
    assert torch.equal(want["tied"]["lm.weight"][1], torch.zeros(4))
    assert torch.equal(want["tied"]["enc.weight"][2], torch.full((4,), 3.0))
    for key, mesh in meshes.items():
        for plan, placements_of in plans(tuple(mesh.shape)).items():
            if plan == "Shard(last)":  # Shard(1): these tensors are all 1-D or 2-D
                continue
            sharded = mesh.size() > 1 and any(p.is_shard() for p in placements_of(2))
            for name, cls in (("views", Views), ("reads", ReadViews), ("tied", Tied)):
                model = distribute(cls(), mesh, placements_of)
                made, comms = _init(model)
                if name == "reads":
                    assert made in ([], ["w"]) and (sharded or made == []), (key, plan, made)
                else:  # writes only: every rank writes its own elements, no collective
                    written = {"emb.weight", "a", "b", "c", "mask"}
                    assert comms == 0 and not written & set(made), (key, plan, made)
                out[(key, f"{name} {plan}")] = unequal(full_state(model), want[name])
    hf = hf_models()
    for family, make in hf.items():
        probe = make()
        pad, emb_fqn = probe.get_input_embeddings().padding_idx, _input_embedding_fqn(probe)
        torch.manual_seed(5)
        ref = full_state(mesh_independent_init(probe))
        # transformers' constructor semantics, however the eager model was built: built on CPU
        # (tied, marked initialized) or on meta then to_empty (untied, unmarked), the same values.
        assert unequal(_reference(lambda: _on_meta(make)), ref) == [], family
        if pad is not None:  # the padding row, and only it, zero: it survives a tied head's init
            zero_rows = (~ref[emb_fqn].any(dim=1)).nonzero().flatten().tolist()
            assert zero_rows == [pad], (family, zero_rows)
        for key, mesh in meshes.items():
            if mesh.ndim == 1:
                pl = lambda nd: (Shard(0),)  # noqa: E731
            else:
                pl = lambda nd: (Shard(0), Shard(min(1, nd - 1)))  # noqa: E731
            model = distribute(make(), mesh, pl)
            _init(model)
            emb = model.get_input_embeddings().weight
            out_emb = model.get_output_embeddings()
            if family != "llama":  # tied: the parallel module keeps one tensor under both names
                assert out_emb.weight is emb, (family, key)
            out[(key, f"transformers {family}")] = unequal(full_state(model), ref)
    return out


class _Embedding(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(8, 4)

    def forward(self, ids):
        return self.emb(ids)

    def init_weights(self):
        nn.init.normal_(self.emb.weight)
        nn.init.zeros_(self.emb.weight[0])  # the padding row, as transformers writes it


def parallel_module_checks(meshes: dict) -> dict:
    """The parallel module (one capture, a module per mesh "1", "2", "4", "2x2", built on meta and
    materialized) of an embedding whose init zeroes row 0 through an index, and of transformers'
    Qwen2 with a tied head and a padding row: every tensor equals ``mesh_independent_init``
    of the eager model bit for bit. Returns ``{(mesh, case): [unequal FQNs]}``."""
    eager = _Embedding()
    torch.manual_seed(0)
    want = full_state(mesh_independent_init(eager))
    assert torch.equal(want["emb.weight"][0], torch.zeros(4))
    with torch.device("meta"):
        meta = _Embedding()
    ids = torch.zeros(2, 3, dtype=torch.long)  # each rank's local batch
    cap = capture(meta, (ids,))
    out = {}
    for key in ("1", "2", "4", "2x2"):
        mesh = meshes[key]
        pmod = build_parallel_module(meta, cap, default_plan(cap.fqn_map, mesh), mesh, [(Shard(0),) * mesh.ndim])
        assert mesh.size() == 1 or pmod.emb.weight.placements[0] == Shard(0)
        pmod.to_empty(device="cpu")
        torch.manual_seed(0)
        pmod.init_weights()
        out[(key, "parallel module")] = unequal(full_state(pmod), want)

    # transformers' Qwen2 with a tied head and a padding row, built on meta: one capture, a
    # parallel module per mesh (the embedding Shard(0) over 2 and 4 ranks, 2x2).
    make = hf_models()["qwen2"]
    want = _reference(make)
    with torch.device("meta"):
        meta = make()
    cap = capture(meta, (), {"input_ids": torch.zeros(2, 4, dtype=torch.long)})
    for key in ("1", "2", "4", "2x2"):
        mesh = meshes[key]
        pmod = build_parallel_module(meta, cap, default_plan(cap.fqn_map, mesh), mesh)
        assert pmod.lm_head.weight is pmod.model.embed_tokens.weight
        pmod.to_empty(device="cpu")
        torch.manual_seed(5)
        pmod.init_weights()
        assert pmod.lm_head.weight is pmod.model.embed_tokens.weight  # still one tensor
        out[(key, "parallel module qwen2")] = unequal(full_state(pmod), want)
    return out


def refusal_checks(mesh) -> int:
    """Writes that cannot be exact are refused by name, the tensor unchanged (a 2-rank+ mesh)."""
    from torch.distributed.tensor.placement_types import _StridedShard

    class Bad(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.empty(6, 4))
            self.kept = None

        def init_weights(self):
            nn.init.ones_(self.w)
            with torch.no_grad():
                self.w[0].expand(3, 4).mul_(2.0)  # overlapping elements: torch refuses it too

    model = distribute(Bad(), mesh, lambda nd: (Shard(0),) * mesh.ndim)
    with pytest.raises(InitWriteError, match=r"'w' whose elements overlap"):
        model.init_weights()
    assert torch.equal(model.w.full_tensor(), torch.ones(6, 4))  # ones_ ran, the refused write did not

    class Keeps(Bad):
        def init_weights(self):
            nn.init.zeros_(self.w)
            self.kept = self.w[0]

    model = distribute(Keeps(), mesh, lambda nd: (Shard(0),) * mesh.ndim)
    model.init_weights()
    with pytest.raises(InitWriteError, match=r"view of 'w' outside init_weights"), torch.no_grad():
        model.kept.add_(1.0)
    assert torch.equal(model.w.full_tensor(), torch.zeros(6, 4))

    class Rebuilt(Bad):  # transformers' tie_weights: bias.data = pad(bias.data, (0, 0)), a DTensor copied in
        def init_weights(self):
            nn.init.ones_(self.w)
            self.w.data = nn.functional.pad(self.w.data, (0, 0)) * 2.0

    model = distribute(Rebuilt(), mesh, lambda nd: (Shard(0),) * mesh.ndim)
    placements = model.w.placements
    model.init_weights()
    assert torch.equal(model.w.full_tensor(), torch.full((6, 4), 2.0)) and model.w.placements == placements

    strided = (_StridedShard(0, split_factor=2),) + (Replicate(),) * (mesh.ndim - 1)
    model = distribute(Bad(), mesh, lambda nd: strided)
    before = model.w.to_local().clone()
    model.init_weights = lambda: None  # only the view below, in the init context
    from autoparallel.init_weights import dtensor_init_context

    with pytest.raises(InitWriteError, match=r"view of 'w', whose placements"):
        with dtensor_init_context(model), torch.no_grad():
            model.w[1].zero_()
    assert torch.equal(model.w.to_local(), before)
    return 3
