"""One set of cases, the same answers on every backend: a local directory, ``memory://`` and
moto's S3 server (127.0.0.1). save (with a user's object beside it), load, verify, diff (model,
optimizer and extra state; against the local copy too), inspect (a checkpoint and a manager
root), migrate, the manager's retention and a conversion recipe. Each backend's answers are
reduced to plain data (object names apart) and compared with literal expectations and with the
local disk's answers."""

from __future__ import annotations

import json
import uuid

import pytest
import torch

pytest.importorskip("s3fs")
pytest.importorskip("moto")

import checkpoint  # noqa: E402
from tests import backends  # noqa: E402
from tests.helpers import run_cli  # noqa: E402
from tests.helpers import tiny_model, trained

ANSWERS: dict[str, dict] = {}
moto_opts = backends.moto_fixture("par")


def _roots(backend, tmp_path, moto_opts):
    return backends.fresh(backend, tmp_path, moto_opts, "par")


def _diff(capsys, a, b) -> tuple[int, dict]:
    rc, out, _ = run_cli("diff", a, b, capsys=capsys, as_json=True)
    return rc, {part: r["same"] for part, r in out["parts"].items()}


@pytest.mark.parametrize("backend", ["local", "file", "memory", "s3"])
def test_same_answers_on_every_backend(backend, tmp_path, moto_opts, monkeypatch, capsys):
    import fsspec.config

    root, opts = _roots(backend, tmp_path, moto_opts)
    if opts:
        monkeypatch.setitem(fsspec.config.conf, "s3", dict(opts))  # the CLI takes fsspec's configuration
    kw = {"storage_options": opts} if opts else {}
    a, b, same_as_a = f"{root}/a", f"{root}/b", f"{root}/a2"
    ans: dict = {}

    # save: model, optimizer, extra state; a user's object beside the shards stays through overwrite
    m, opt = trained(tiny_model(seed=0), torch.optim.Adam, steps=2)
    local = str(tmp_path / "local-a")
    for where, where_kw in ((a, kw), (same_as_a, kw), (local, {})):
        checkpoint.save(m, where, optimizer=opt, extra_state={"step": 2}, **where_kw)
    with torch.no_grad():  # b: the same model values, other optimizer state
        for s_ in opt.state.values():
            s_["exp_avg"].add_(1.0)
    checkpoint.save(m, b, optimizer=opt, extra_state={"step": 2}, **kw)
    _put_user_object(b, opts)
    checkpoint.save(m, b, optimizer=opt, extra_state={"step": 2}, overwrite=True, **kw)
    ans["user_object_kept"] = _get_user_object(b, opts)

    # load (strict, verified) into a fresh model and optimizer
    mt, ot = trained(tiny_model(seed=1), torch.optim.Adam, steps=1)
    extra = {"step": None}
    rep = checkpoint.load(mt, a, optimizer=ot, extra_state=extra, verify=True, **kw)
    sa, st = m.state_dict(), mt.state_dict()
    ans["load"] = (rep.ok, rep.optimizer_loaded, extra["step"], all(torch.equal(sa[k], st[k]) for k in sa))

    # verify, API and CLI
    ans["verify"] = (checkpoint.verify(a, **kw).ok, run_cli("verify", a, capsys=capsys, as_json=True)[0])

    # diff: optimizer-only difference, identical copies, and against the local copy of the same save
    ans["diff_a_b"] = _diff(capsys, a, b)
    ans["diff_a_a2"] = _diff(capsys, a, same_as_a)
    ans["diff_local_a"] = _diff(capsys, local, a)

    # inspect a checkpoint
    rc, out, _ = run_cli("inspect", a, capsys=capsys, as_json=True)
    ans["inspect"] = (rc, out["format"], out["tensors"], out["total_bytes"], out["parts"]["optimizer"]["optimizer_class"],
                      out["parts"]["optimizer"]["tensors"], out["parts"]["extra_state"], "leftovers" in out)  # fmt: skip

    # migrate (fqnckpt -> fqnckpt on the same backend), then load it
    mig = checkpoint.migrate(a, f"{root}/mig", **kw)
    mm, _ = trained(tiny_model(seed=2), torch.optim.Adam, steps=0)
    ans["migrate"] = (bool(mig.written), sorted(mig.keys_written) if hasattr(mig, "keys_written") else None,
                      checkpoint.load(mm, f"{root}/mig", **kw).ok, torch.equal(mm[0].weight, m[0].weight))  # fmt: skip

    # the manager: retention keeps the newest two; inspect lists the root
    mgr = checkpoint.CheckpointManager(f"{root}/run", keep_latest=2, rng_state=False, **kw)
    for step in (1, 2, 3):
        mgr.save(step, m, opt, extra_state={"step": step})
    mgr.wait()
    rc, out, _ = run_cli("inspect", f"{root}/run", capsys=capsys, as_json=True)
    ans["manager"] = (mgr.steps(), rc, out["format"], [(s["step"], s["complete"]) for s in out["steps"]],
                      out["latest"].rsplit("/", 1)[-1])  # fmt: skip

    # migrate through the CLI onto the same backend
    rc, _, _ = run_cli("migrate", a, f"{root}/cli-mig", capsys=capsys, as_json=True)
    ans["cli_migrate"] = (rc, _diff(capsys, a, f"{root}/cli-mig"))

    # conversion recipes: reading this backend (written locally), writing to it (save(recipe=),
    # Meta's consolidated.NN.pth with its record, overwritten with fewer shards)
    ans["recipe"] = _recipe(root, tmp_path, kw)
    ans["recipe_out"] = _recipe_out(root, kw)

    assert ans["user_object_kept"] is True
    assert ans["load"] == (True, True, 2, True)
    assert ans["verify"] == (True, 0)
    assert ans["diff_a_b"] == (1, {"model": True, "optimizer": False, "extra_state": True})  # DIFFERENT: exit 1
    assert ans["diff_a_a2"] == ans["diff_local_a"] == (0, {"model": True, "optimizer": True, "extra_state": True})
    assert ans["inspect"][:7] == (0, "safetensors-sharded", 4, 92, "Adam", 12, {"step": "int"})
    assert ans["inspect"][7] is False  # no leftovers
    assert ans["migrate"][0] and ans["migrate"][2:] == (True, True)
    assert ans["manager"] == ([2, 3], 0, "checkpoint-manager", [(2, True), (3, True)], "step-00000003")
    assert ans["cli_migrate"] == (0, (0, {"model": True, "optimizer": True, "extra_state": True}))
    meta_names = [".fqnckpt-record.json", "consolidated.00.pth", "conversion_report.json", "params.json"]
    assert ans["recipe_out"] == (True, meta_names + ["tokenizer.model"], meta_names[1:], True)
    ANSWERS[backend] = ans
    if backend != "local" and "local" in ANSWERS:
        assert ans == ANSWERS["local"]


def _put_user_object(path, opts) -> None:
    backends.put(path, opts, "notes.0123456789ab.txt", b"mine")


def _get_user_object(path, opts) -> bool:
    return backends.get(path, opts, "notes.0123456789ab.txt") == b"mine"


def _recipe(root, tmp_path, kw):
    transformers = pytest.importorskip("transformers")
    import safetensors.torch

    cfg = transformers.LlamaConfig(vocab_size=16, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=False)  # fmt: skip
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(cfg)
    checkpoint.save(hf, f"{root}/hf", **kw)
    out = tmp_path / f"tt-{uuid.uuid4().hex[:6]}"
    rep = checkpoint.migrate(f"{root}/hf", out, recipe="hf-to-torchtitan-llama3", **kw)
    (f,) = out.glob("*.safetensors")
    tt = safetensors.torch.load_file(str(f))
    fresh = transformers.LlamaForCausalLM(cfg)
    back = checkpoint.load(fresh, out, recipe="torchtitan-llama3-to-hf").ok
    same = all(torch.equal(v, fresh.state_dict()[k]) for k, v in hf.state_dict().items())
    return (rep.dims["n_heads"], rep.dims["n_kv_heads"], sorted(tt), back, same)


def _recipe_out(root, kw):
    """Conversions written to this backend: ``save(recipe=...)`` read back through the inverse
    recipe, and Meta's layout (two shards, then one over it: the record removes the stale
    ``consolidated.01.pth``, a user's ``tokenizer.model`` stays)."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=16, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=2, tie_word_embeddings=False)  # fmt: skip
    torch.manual_seed(3)
    hf = transformers.LlamaForCausalLM(cfg)
    checkpoint.save(hf, f"{root}/tt-out", recipe="hf-to-torchtitan-llama3", **kw)
    fresh = transformers.LlamaForCausalLM(cfg)
    back = checkpoint.load(fresh, f"{root}/tt-out", recipe="torchtitan-llama3-to-hf", **kw).ok
    back = back and all(torch.equal(v, fresh.state_dict()[k]) for k, v in hf.state_dict().items())
    checkpoint.save(hf, f"{root}/hf-src", **kw)
    meta = f"{root}/meta"
    checkpoint.migrate(f"{root}/hf-src", meta, recipe="hf-to-meta-llama", dims={"shards": 2}, **kw)
    opts = kw.get("storage_options")
    two = backends.names(meta, opts)
    backends.put(meta, opts, "tokenizer.model", b"mine")
    checkpoint.migrate(f"{root}/hf-src", meta, recipe="hf-to-meta-llama", overwrite=True, **kw)
    record = json.loads(backends.get(meta, opts, ".fqnckpt-record.json"))["objects"]
    return (back, sorted(backends.names(meta, opts)), record, "consolidated.01.pth" in two and backends.get(meta, opts, "tokenizer.model") == b"mine")
