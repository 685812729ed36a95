"""Sibling linear layers made one packed product (engine/model/ops/fused_linear.py): fused where every member is a plain
float linear batchrun packs, left alone where one is not, and the model's outputs those of the model packed layer
by layer. The family matrix (tests/test_families.py, the `torch` backend) holds the fused models' tokens equal to
HF `generate`.

Fused and unfused logits are compared within 1e-5 relative, not bit for bit: oneDNN splits a product's rows and
columns between threads, not its sums, so each column of the joined product is summed as the member's own product
sums it (equal bit for bit on the development machine), but nothing in oneDNN's contract promises that on every
CPU and thread count."""

from __future__ import annotations

import copy

import pytest
import torch
from model_families import TINY, perturb

from batchrun.engine.model.ops import cpu_linear
from batchrun.engine.model.ops.cpu_linear import PackedLinear, pack_linear_layers
from batchrun.engine.model.ops.fused_linear import FusedMember, FusedProduct, fused_groups

pytestmark = pytest.mark.skipif(not cpu_linear.available(torch.float32), reason="oneDNN packing unavailable")


def tiny_llama():
    """Two Llama layers with biases on q/k/v (perturbed: from_config leaves them 0), k_proj's of layer 0 taken
    away (a member without a bias adds zeros in the joined product)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**TINY, attention_bias=True)).eval()
    model.model.layers[0].self_attn.k_proj.bias = None
    perturb(model, seed=1)
    return model


def logits(model, ids):
    with torch.inference_mode():
        return model(ids).logits


IDS = torch.randint(3, 256, (2, 21), generator=torch.Generator().manual_seed(0))


def packed_apart(model):
    """The model packed layer by layer, as before fusion."""
    model = copy.deepcopy(model)
    pack_linear_layers(model, fuse=False)
    return model


def test_llama_attention_and_mlp_become_one_product_each():
    model = tiny_llama()
    reference = packed_apart(model)
    products = pack_linear_layers(model)
    groups = fused_groups(model)
    layers = model.config.num_hidden_layers
    assert len(groups) == 2 * layers
    h, mlp = TINY["hidden_size"], TINY["intermediate_size"]
    kv = TINY["num_key_value_heads"] * TINY["head_dim"]
    assert sorted(g.widths for g in groups) == [[h, kv, kv]] * layers + [[mlp, mlp]] * layers
    # a fused group is one product in the place of its members; o_proj, down_proj and the LM head are packed apart
    assert products == 2 * layers + 2 * layers + 1
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        assert all(isinstance(m, FusedMember) for m in (attn.q_proj, attn.k_proj, attn.v_proj, mlp.gate_proj))
        assert type(attn.o_proj) is PackedLinear and type(mlp.down_proj) is PackedLinear
    torch.testing.assert_close(logits(model, IDS), logits(reference, IDS), rtol=1e-5, atol=1e-5)
    # HF's modules call every member on the same input: one product per group and forward, none recomputed
    assert all(g.products == 1 and g.calls == len(g.widths) for g in groups)


class Adapter(torch.nn.Module):
    """What a LoRA wrapper looks like: the base layer inside, a low-rank term added to its output."""

    def __init__(self, base: torch.nn.Linear):
        super().__init__()
        self.base_layer = base
        self.down = torch.nn.Linear(base.in_features, 2, bias=False)
        self.up = torch.nn.Linear(2, base.out_features, bias=False)

    def forward(self, x):
        return self.base_layer(x) + self.up(self.down(x))


class ScaledLinear(torch.nn.Linear):
    """A linear subclass (a quantized format's layers subclass `nn.Linear`): not a layer batchrun packs."""

    def forward(self, x):
        return super().forward(x) * 0.5


def test_a_group_with_a_member_batchrun_would_not_pack_is_left_alone():
    model = tiny_llama()
    first, second = model.model.layers
    first.self_attn.k_proj = Adapter(first.self_attn.k_proj)
    seen = []
    second.self_attn.v_proj.register_forward_hook(lambda *_: seen.append(1))
    scaled = ScaledLinear(TINY["hidden_size"], TINY["intermediate_size"], bias=False)
    scaled.load_state_dict(second.mlp.gate_proj.state_dict())
    second.mlp.gate_proj = scaled
    reference = packed_apart(model)

    pack_linear_layers(model)
    (group,) = fused_groups(model)  # the first layer's MLP alone: every other group has a member apart
    assert isinstance(first.mlp.gate_proj, FusedMember) and first.mlp.gate_proj.group is group
    assert type(first.self_attn.k_proj) is Adapter and type(first.self_attn.q_proj) is PackedLinear
    assert type(second.self_attn.q_proj) is PackedLinear
    # hooked: not packed either (a PackedLinear in its place would never call the hook)
    assert type(second.self_attn.v_proj) is torch.nn.Linear
    assert type(second.mlp.gate_proj) is ScaledLinear and type(second.mlp.up_proj) is PackedLinear
    got = logits(model, IDS)
    assert seen == [1]  # the hook still sees v_proj's own call
    torch.testing.assert_close(got, logits(reference, IDS), rtol=1e-5, atol=1e-5)


def test_a_member_the_model_reads_directly_keeps_its_group_apart(monkeypatch):
    """A layer whose weight the model's code reads stays `nn.Linear` (cpu_linear.read_directly): its group is not
    fused, the other groups are."""
    monkeypatch.setattr(cpu_linear, "read_directly", lambda model: {"up_proj"})
    model = tiny_llama()
    pack_linear_layers(model)
    assert [len(g.widths) for g in fused_groups(model)] == [3, 3]
    assert all(type(layer.mlp.up_proj) is torch.nn.Linear for layer in model.model.layers)
    assert all(type(layer.mlp.gate_proj) is PackedLinear for layer in model.model.layers)


def test_bert_query_key_value_become_one_product():
    """A BERT-style encoder (the pooling models'): query, key and value of each layer are one product."""
    from transformers import BertConfig, BertModel

    config = BertConfig(
        vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128
    )
    torch.manual_seed(0)
    model = BertModel(config, add_pooling_layer=False).eval()
    perturb(model, seed=2)
    reference = packed_apart(model)
    pack_linear_layers(model)
    groups = fused_groups(model)
    assert [g.widths for g in groups] == [[64, 64, 64]] * 2
    with torch.inference_mode():
        got, want = model(IDS).last_hidden_state, reference(IDS).last_hidden_state
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert all(g.products == 1 for g in groups)


def three_members():
    torch.manual_seed(0)
    linears = [torch.nn.Linear(8, n) for n in (8, 4, 4)]
    group = FusedProduct(linears, pack=lambda joined: joined)  # the joined nn.Linear itself: no oneDNN needed
    return linears, [FusedMember(group, i) for i in range(3)], group


def test_a_member_called_on_another_input_computes_its_own_columns():
    """Cross-attention projects queries from one tensor and keys and values from another: each member's output is
    its product of its own input, whatever the kept product was computed from."""
    linears, (q, k, v), group = three_members()
    x, y = torch.randn(5, 8), torch.randn(3, 8)
    with torch.no_grad():
        outs = [q(x), k(y), v(y)]
        for out, lin, inp in zip(outs, linears, (x, y, y)):
            torch.testing.assert_close(out, lin(inp))
    assert group.products == 2 and group.calls == 3


def test_an_input_changed_in_place_or_a_member_called_twice_gets_a_new_product():
    linears, (q, k, _), group = three_members()
    x = torch.randn(5, 8)
    with torch.no_grad():
        q(x)
        x.mul_(2)  # the kept product is of x before this
        torch.testing.assert_close(k(x), linears[1](x))
        first = q(x)
        torch.testing.assert_close(q(x), first)  # the same member again: computed again, not handed out twice
    assert group.products == 3


def test_the_summary_counts_the_fused_products():
    """`LLM` on the CPU (the embedded SmolLM2, 30 layers): q/k/v and gate/up of each layer fused."""
    from batchrun import LLM

    llm = LLM(device="cpu", dtype="float32", num_pages=16)
    layers = llm.engine.runner.model.config.num_hidden_layers
    assert llm.rewrites["packed_linear"] and llm.rewrites["fused_products"] == 2 * layers
