"""param_groups.muon_param_groups: the Muon/AdamW split by role, the same through compile and
activation-checkpoint wrappers, expert weights by key, and a logged reason for every param."""

import logging

import pytest
import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

from nanomuon.gpt import GPT, config_from_depth
from nanomuon.optim import MuonAdamW
from nanomuon.param_groups import muon_param_groups, normalize_fqn

MUON = dict(lr=0.02, momentum=0.95, ns_steps=5, beta2=0.95, weight_decay=0.0)
ADAMW = dict(lr=3e-3, betas=(0.8, 0.95), eps=1e-10, weight_decay=0.0)


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = torch.nn.Linear(16, 16)  # weight -> muon, bias -> adamw
        self.norm = torch.nn.LayerNorm(16)  # 1-D gains -> adamw
        self.router = torch.nn.Linear(16, 4, bias=False)  # a 2-D matrix -> muon
        self.experts = torch.nn.ParameterDict({"w1": torch.nn.Parameter(torch.randn(4, 32, 16))})  # -> muon
        self.conv = torch.nn.Conv2d(4, 4, 3)  # 4-D, not an expert -> adamw


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.tok = torch.nn.Embedding(50, 16)  # an nn.Embedding whatever its name -> adamw
        self.blocks = torch.nn.ModuleList([Block(), Block()])
        self.output = torch.nn.Linear(16, 50, bias=False)  # skip key 'output' -> adamw
        self.frozen = torch.nn.Parameter(torch.randn(16, 16), requires_grad=False)


def split(model, **kw):
    muon, adamw = muon_param_groups(model, MUON, ADAMW, **kw)
    names = {id(p): normalize_fqn(n) for n, p in model.named_parameters()}
    return sorted(names[id(p)] for p in muon["params"]), sorted(names[id(p)] for p in adamw["params"])


def test_split_by_role():
    muon, adamw = split(Net(), expert_keys=("experts",))
    assert muon == sorted(f"blocks.{i}.{n}" for i in range(2) for n in ("attn.weight", "router.weight", "experts.w1"))
    assert adamw == sorted(["tok.weight", "output.weight"] + [f"blocks.{i}.{n}" for i in range(2) for n in (
        "attn.bias", "norm.weight", "norm.bias", "conv.weight", "conv.bias")])
    # without expert keys, the 3-D expert weight is not taken for a batch of matrices
    assert "blocks.0.experts.w1" in split(Net(), expert_keys=())[1]


def test_wrappers_do_not_change_the_split():
    torch.manual_seed(0)
    plain = split(Net(), expert_keys=("experts",))
    wrapped = Net()
    wrapped.blocks[0] = checkpoint_wrapper(wrapped.blocks[0])
    compiled = torch.compile(wrapped)  # lazy: wraps names in _orig_mod, compiles nothing until called
    names = [n for n, _ in compiled.named_parameters()]
    assert any("_orig_mod" in n for n in names) and any("_checkpoint_wrapped_module" in n for n in names)
    assert split(compiled, expert_keys=("experts",)) == plain


def test_every_param_gets_a_logged_reason(caplog):
    model = Net()
    with caplog.at_level(logging.DEBUG, logger="nanomuon"):
        groups = muon_param_groups(model, MUON, ADAMW, expert_keys=("blocks.0.experts",))
    lines = caplog.messages
    assert any(m.startswith("blocks.0.experts.w1 (4, 32, 16) -> muon: expert weight") for m in lines)
    assert any(m.startswith("blocks.1.experts.w1 (4, 32, 16) -> adamw: 3-D and not an expert") for m in lines)
    assert any(m.startswith("tok.weight (50, 16) -> adamw: an nn.Embedding weight") for m in lines)
    assert any(m == "frozen: frozen, left out" for m in lines)
    assert len(lines) == len(list(model.named_parameters()))
    MuonAdamW(groups)  # the groups are valid as they are


def test_agrees_with_the_gpt_own_split():
    model = GPT(config_from_depth(2, 64, 16, aspect_ratio=32, head_dim=16))
    matrices = next(g for g in model.setup_optimizer().param_groups if g["name"] == "matrices")["params"]
    muon, _ = muon_param_groups(model, MUON, ADAMW)
    assert {id(p) for p in muon["params"]} == {id(p) for p in matrices}


def hf_model(name, **kw):
    """A tiny transformers model of the family `name`, built from a config (no download)."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.AutoConfig.for_model(name, vocab_size=100, hidden_size=32, n_embd=32, num_hidden_layers=1,
                                            n_layer=1, num_attention_heads=4, n_head=4, num_key_value_heads=2,
                                            intermediate_size=64, **kw)
    auto = transformers.AutoModelForMaskedLM if name == "bert" else transformers.AutoModelForCausalLM
    transformers.logging.set_verbosity_error()
    return auto.from_config(cfg)


HF = {
    "llama": ({}, {"model.layers.0.mlp.gate_proj.weight"}, {}),
    "mixtral": (dict(num_local_experts=4), {"model.layers.0.mlp.experts.down_proj"},
                {"model.layers.0.mlp.experts.gate_up_proj": dict(split=(64, 64))}),
    "qwen3_moe": (dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16),
                  {"model.layers.0.mlp.experts.down_proj"},
                  {"model.layers.0.mlp.experts.gate_up_proj": dict(split=(16, 16))}),
    "olmoe": (dict(num_experts=4, num_experts_per_tok=2), {"model.layers.0.mlp.experts.down_proj"},
              {"model.layers.0.mlp.experts.gate_up_proj": dict(split=(64, 64))}),
    "gpt2": ({}, set(), {"transformer.h.0.attn.c_attn.weight": dict(split=(32, 32, 32), transposed=True),
                         "transformer.h.0.mlp.c_fc.weight": dict(transposed=True),
                         "transformer.h.0.attn.c_proj.weight": dict(transposed=True)}),
    "bert": ({}, {"bert.encoder.layer.0.attention.output.dense.weight", "bert.encoder.layer.0.output.dense.weight",
                  "bert.encoder.layer.0.attention.self.query.weight", "cls.predictions.transform.dense.weight"}, {}),
}


@pytest.mark.parametrize("name", HF)
def test_hugging_face_models(name):
    """Hidden matrices to Muon (fused and (in, out) ones to groups with their layout), embeddings, heads
    and vectors to AdamW; one step of MuonAdamW on a real forward and backward."""
    kw, plain_muon, layouts = HF[name]
    model = hf_model(name, **kw)
    groups = muon_param_groups(model, MUON, ADAMW)
    names = {id(p): n for n, p in model.named_parameters()}
    where = {names[id(p)]: g for g in groups for p in g["params"]}
    assert all(where[n]["kind"] == "adamw" for n, p in model.named_parameters() if p.ndim < 2 or "embed" in n
               or n.startswith(("lm_head", "transformer.wte", "transformer.wpe")))
    assert all(where[n]["kind"] == "muon" and not where[n].get("split") and not where[n].get("transposed")
               for n in plain_muon)
    for n, layout in layouts.items():
        assert {k: where[n].get(k) for k in layout} == layout, (n, where[n])
    if name != "gpt2":  # every Linear weight except the head is a Muon matrix
        linears = {f"{m}.weight" for m, mod in model.named_modules() if isinstance(mod, torch.nn.Linear)}
        assert {n for n in linears if where.get(n, {}).get("kind") == "adamw"} <= {"lm_head.weight"}
    opt = MuonAdamW(groups)
    ids = torch.randint(0, 100, (2, 8))
    model(input_ids=ids, labels=ids).loss.backward()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt.step()
    assert all(not torch.equal(before[n], p) for n, p in model.named_parameters() if p.grad is not None
               and p.grad.abs().sum() > 0)


