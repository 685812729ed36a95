"""The architecture matrix (tests/model_families.py): every supported family equal to HF `generate` (eager
attention, one prompt at a time) token for token in fp32 on prompts longer than its window, on each CPU backend
and once under preemption (tests/test_families_preemption.py, a file of its own so that the test workers share
the matrix); every refused family refused at load with its reason; docs/models.md's table generated
from the same lists."""

from __future__ import annotations

import functools
import re
from pathlib import Path

import pytest
import torch
from helpers import paged_model_from_config, run_engine, save_with_tokenizer
from model_families import REFUSED, SUPPORTED, WINDOW, perturb, tiny_config

from batchrun.engine import SamplingParams
from batchrun.engine.attention import FULL, UnsupportedModel

NEW_TOKENS = 24
# for the Triton kernels (head dims from 32): the interpreter takes minutes over 8 layers, so Gemma 4 there as 1
# sliding and 1 full layer of wider heads; Inkling 2's sliding layers' own head dim
INTERPRETED_SMALLER = {
    "gemma4_text": dict(num_hidden_layers=2, num_kv_shared_layers=0, global_head_dim=64),
    "inkling2_text": dict(swa_head_dim=32),
    **{family: dict(num_attention_heads=2) for family in ("bloom", "mpt")},  # head dim: hidden / heads
}
MODELS_PAGE = Path(__file__).resolve().parent.parent / "docs" / "models.md"


def prompts(vocab: int) -> list[list[int]]:
    """Six prompts of 4-75 tokens (ids 3.. keep clear of pad, bos and eos)."""
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in (4, 11, 30, 33, 50, 75)]


def build(family: str, overrides: dict, attn: str):
    from transformers import AutoModelForCausalLM

    cfg = tiny_config(family, overrides)
    torch.manual_seed(0)
    if attn == "paged":
        model = paged_model_from_config(cfg)
    else:
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation=attn, dtype=torch.float32)
    return model.eval()


@functools.cache
def models(family: str, head_dim: int = 16):
    """batchrun's model of the family (perturbed) and the reference: the same weights, eager attention."""
    overrides = dict(SUPPORTED[family][1])
    if head_dim != 16:  # for the Triton kernels
        overrides.update(head_dim=head_dim, **INTERPRETED_SMALLER.get(family, {}))
    ours = build(family, overrides, "paged")
    perturb(ours, seed=len(family))
    ref = build(family, overrides, "eager")
    ref.load_state_dict(ours.state_dict())
    ref.generation_config.eos_token_id = None  # the engine below runs without EOS too: all 24 tokens
    ref.generation_config.pad_token_id = 0
    return ours, ref


def hf_tokens(ref, token_lists: list[list[int]]) -> list[list[int]]:
    """HF `generate`, greedy, one prompt at a time: the reference's new token ids."""
    out = []
    with torch.inference_mode():
        for p in token_lists:
            fresh_rotary_state(ref)
            ids = ref.generate(torch.tensor([p]), max_new_tokens=NEW_TOKENS, do_sample=False)
            out.append(ids[0, len(p) :].tolist())
    return out


def fresh_rotary_state(model) -> None:
    """Each prompt as on a freshly loaded model: dynamic NTK's rotary module keeps the longest length it has
    seen, and uses its frequencies for any later sequence between the original context and that length
    (transformers' `dynamic_rope_update`), so without this a prompt would depend on the prompts before it."""
    for m in model.modules():
        if getattr(m, "rope_type", None) == "dynamic":
            m.register_buffer("inv_freq", m.original_inv_freq, persistent=False)
            m.max_seq_len_cached = m.original_max_seq_len


@functools.cache
def model_and_reference(family: str, head_dim: int = 16):
    """batchrun's model of the family and the reference's token ids for `prompts`, made once per family."""
    ours, ref = models(family, head_dim)
    return ours, hf_tokens(ref, prompts(ours.config.vocab_size))


def run(model, family: str, attention: str, full_pages: int = 256, on_step=None, **engine):
    """Run the prompts on batchrun's engine (`family_engine`)."""
    eng = family_engine(model, attention, full_pages, **engine)
    params = SamplingParams(max_new_tokens=NEW_TOKENS)
    seqs, steps = run_engine(eng, prompts(model.config.vocab_size), params, on_step=on_step)
    eng.check_integrity()
    return [s[0].output_token_ids for s in seqs], steps, eng


def family_engine(model, attention: str, full_pages: int = 256, **engine):
    """batchrun's engine on `model`; `full_pages`: the KV memory of that many pages of all the model's layers
    (a model with KV cache groups has more, smaller pages), plus a hybrid's state slots."""
    from batchrun.engine import Engine, EngineConfig, LoadedModel
    from batchrun.engine.model.architecture import inspect_model

    found = inspect_model(model)
    full_page = found.kv_spec(16, torch.float32).bytes_per_page * found.groups.num_groups
    cfg = dict(
        device="cpu",
        kv_cache_memory=str(full_pages * full_page),
        page_size=16,
        max_num_seqs=8,
        max_num_batched_tokens=64,  # the long prompts are prefilled in chunks, beside decodes
        prefix_sharing=True,
        preemption="swap",
        attention=attention,
        swap_space=1 << 22,
    )
    cfg.update(engine)
    if (
        found.states
    ):  # a hybrid: the pages alone, the state slots on top (one per sequence, not from the budget)
        cfg["num_pages"] = full_pages * found.groups.num_groups
    return Engine(LoadedModel(model, max_model_len=512), EngineConfig(**cfg), torch.device("cpu"))


@pytest.mark.parametrize("attention", ["torch", "gather"])
@pytest.mark.parametrize("family", sorted(SUPPORTED))
def test_family_equals_hf_generate(family, attention):
    """On `torch` the model's linear layers are packed for oneDNN, q/k/v and gate/up fused where the family has
    them (what `LLM` does on a CPU: engine/model/ops/cpu_linear.py, engine/model/ops/fused_linear.py); on `gather` they stay
    `nn.Linear`: both ways equal HF `generate`."""
    import copy

    from batchrun.engine.model.ops.cpu_linear import available, pack_linear_layers

    model, expected = model_and_reference(family)
    if attention == "torch" and available(torch.float32):
        model = copy.deepcopy(model)
        pack_linear_layers(model)
    got, _, engine = run(model, family, attention)
    assert engine.attention.name == attention
    for i, (g, e) in enumerate(zip(got, expected)):
        assert g == e, f"{family} on {attention}: prompt {i} differs"


@pytest.mark.parametrize(
    "family",
    [
        *("mistral", "gemma2", "gpt_oss", "llama4_text", "gemma3_text", "phimoe", "zaya"),
        *("modernbert-decoder", "bloom", "mpt"),
    ],
)
def test_the_matrix_sees_a_dropped_feature(family, monkeypatch):
    """The matrix can fail: attention that drops the layer's window, chunk, soft-capping, sinks and ALiBi (plain
    causal attention, what batchrun computed before) differs from the reference on these families."""
    import dataclasses

    from batchrun.engine.attention import interface

    model, expected = model_and_reference(family)
    real = interface.read_call
    monkeypatch.setattr(
        interface,
        "read_call",
        lambda *a: dataclasses.replace(real(*a), kind=FULL, softcap=None, sinks=None, alibi_slopes=None),
    )
    got, _, _ = run(model, family, "gather")
    assert got != expected


@pytest.mark.parametrize("family", ["modernbert-decoder", "phimoe", "zaya"])
def test_a_long_prompt_alone_runs_in_chunks_that_sample_nothing(family):
    """The longest prompt alone overfills the step's 64 tokens: its first step samples nothing and runs the decoder
    alone (decoder_stack.HFForward.decoder; transformers' `get_decoder` finds ModernBERT-decoder's LM head, named
    `decoder`), and its tokens equal HF `generate`'s."""
    model, expected = model_and_reference(family)
    long = prompts(model.config.vocab_size)[-1]
    engine = family_engine(model, "torch")
    assert len(long) > engine.config.max_num_batched_tokens
    seqs, _ = run_engine(engine, [long], SamplingParams(max_new_tokens=NEW_TOKENS))
    assert seqs[0][0].output_token_ids == expected[-1]


def test_a_window_the_mask_applies_is_taken_from_there():
    """HF's eager and SDPA attention apply a window through the mask alone: Phi-MoE's mask has its config's window,
    its attention call passes none, and every layer's frozen call has the mask's window (equal to HF `generate`:
    the matrix). A config's `sliding_window` that the model's code never builds a mask from (Llama's) is not."""
    from batchrun.engine.model.architecture import inspect_model

    model, _ = models("phimoe")
    calls = inspect_model(model).calls
    assert all("sliding_window" not in c.signature.keywords for c in calls)
    assert {c.kind.window for c in calls} == {WINDOW}
    llama = build("llama", {"sliding_window": WINDOW}, "paged")
    assert llama.config.sliding_window == WINDOW
    assert {c.kind for c in inspect_model(llama).calls} == {FULL}


def test_a_call_whose_window_is_not_its_masks_is_refused_at_load():
    """Gemma 3's layers pass their window to the attention call, and its mask applies the config's: a layer whose
    call passes another window than its mask's (which of the two HF applies depends on its attention
    implementation: the mask's in eager and SDPA) is refused at load, naming the model and the argument."""
    from batchrun.engine.model.architecture import inspect_model

    model = build("gemma3_text", SUPPORTED["gemma3_text"][1], "paged")
    model.model.layers[0].self_attn.sliding_window = WINDOW // 2
    with pytest.raises(UnsupportedModel) as err:
        inspect_model(model)
    message = str(err.value)
    assert "gemma3_text" in message and "`sliding_window` 16" in message and "window of 32" in message, (
        message
    )


def test_llama4_query_temperature_needs_true_positions(monkeypatch):
    """Llama 4's NoRoPE layers scale queries by position; the packed row's indices are not the positions."""
    from batchrun.engine.model import families

    model, expected = model_and_reference("llama4_text")
    assert 0 in model.config.no_rope_layers and model.config.floor_scale < 40, "no layer's scale varies here"
    monkeypatch.setattr(families.QueryScaleFix, "factor", lambda self, pos: torch.ones(len(pos)))
    got, _, _ = run(model, "llama4_text", "gather")
    assert got != expected


@pytest.mark.parametrize("term", ["relative_bias", "sinks"])
def test_inklings_terms_of_each_query_count(term, monkeypatch):
    """Inkling 2's relative position bias and its sink logits (both from each query token's hidden state): a
    backend that drops either differs from HF `generate`."""
    import dataclasses

    from batchrun.engine.attention import interface

    model, expected = model_and_reference("inkling2_text")
    real = interface.token_scores
    monkeypatch.setattr(interface, "token_scores", lambda *a: dataclasses.replace(real(*a), **{term: None}))
    got, _, _ = run(model, "inkling2_text", "gather")
    assert got != expected


@pytest.mark.parametrize("adapter", ["InklingRelativeBias", "InklingOwnAttention"])
def test_inkling_without_its_adapters_is_refused(adapter, monkeypatch):
    """Without batchrun's adapter, Inkling 2's bias over the packed row's indices (not the tokens' positions),
    and its attention over the stack of earlier layers' outputs, are refused at load, never computed."""
    from batchrun.engine.model import families
    from batchrun.engine.model.architecture import inspect_model

    others = tuple(a for a in families.ADAPTERS if type(a).__name__ != adapter)
    assert len(others) == len(families.ADAPTERS) - 1
    monkeypatch.setattr(families, "ADAPTERS", others)
    model = build("inkling2_text", SUPPORTED["inkling2_text"][1], "paged")
    with pytest.raises(UnsupportedModel) as err:
        inspect_model(model)
    expected = "position_bias" if adapter == "InklingRelativeBias" else "step metadata"
    assert expected in str(err.value), err.value


@pytest.mark.parametrize(("family", "attribute"), [("bloom", "query_key_value"), ("mpt", "clip_qkv")])
def test_alibi_attention_of_another_structure_is_refused(family, attribute):
    """Bloom's and MPT's attention, computed in their own code, is routed through the paged attention only where
    the module has what the route reads (families.alibi_attention); a module without it is refused at load,
    naming the module and the attribute, never computed otherwise."""
    from batchrun.engine.model.architecture import inspect_model

    model = build(family, SUPPORTED[family][1], "paged")
    for m in model.modules():
        if type(m).__name__.endswith("Attention"):
            delattr(m, attribute)
    with pytest.raises(UnsupportedModel, match=f"Attention computes its ALiBi .* lacks {attribute}"):
        inspect_model(model)


@pytest.mark.parametrize("family", sorted(REFUSED))
def test_unsupported_family_is_refused_at_load(family):
    reason, overrides = REFUSED[family]
    from batchrun.engine import Engine, EngineConfig, LoadedModel

    with pytest.raises(UnsupportedModel) as err:
        model = build(family, overrides, "paged")
        Engine(
            LoadedModel(model, max_model_len=512),
            EngineConfig(device="cpu", num_pages=16),
            torch.device("cpu"),
        )
    message = str(err.value)
    assert family in message and reason in message, message


def test_the_sequences_outgrow_the_window():
    lengths = [len(p) + NEW_TOKENS for p in prompts(256)]
    assert max(lengths) > 3 * WINDOW and min(len(p) for p in prompts(256)) < WINDOW


def families_table() -> str:
    lines = ["| family (`model_type`) | what the test model exercises | status |", "|---|---|---|"]
    for family, (what, _) in sorted(SUPPORTED.items()):
        lines.append(f"| `{family}` | {what} | exact |")
    for family, (reason, _) in sorted(REFUSED.items()):
        lines.append(f"| `{family}` | refused at load: {reason} | refused |")
    return "\n".join(lines)


def test_families_table_is_generated_from_the_matrix():
    text = MODELS_PAGE.read_text()
    found = re.search(r"<!-- families:begin -->\n(.*?)\n<!-- families:end -->", text, re.S)
    assert found, "docs/models.md lacks the families table markers"
    assert found.group(1) == families_table(), (
        "docs/models.md's table differs: paste tests/test_families.families_table()"
    )


def saved_model(tmp_path, family: str, overrides: dict, model_dir) -> Path:
    """A tiny model of `family` saved as a model directory, with the embedded model's tokenizer."""
    from transformers import AutoModelForCausalLM

    cfg = tiny_config(family, {**overrides, "vocab_size": 49152})
    model = AutoModelForCausalLM.from_config(cfg)
    return save_with_tokenizer(model, tmp_path / family, model_dir)


def test_a_refused_model_is_exit_2_at_load_naming_it(tmp_path, model_dir):
    from helpers import run_cli, write_job, write_prompts

    reason, overrides = REFUSED["deepseek_v32"]
    path = saved_model(tmp_path, "deepseek_v32", overrides, model_dir)
    write_prompts(tmp_path / "in.parquet", ["a", "b"])
    job = write_job(
        tmp_path / "job.yaml",
        f"name: t\nmodel: {{path: {path}, chat_template: false}}\ninput: {{parquet: {tmp_path / 'in.parquet'}}}\n"
        f"output: {{path: {tmp_path / 'out'}}}\nengine: {{num_pages: 16}}\n",
    )
    r = run_cli("submit", str(job))
    assert r.returncode == 2, r.stderr
    assert "deepseek_v32" in r.stderr and reason in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert not list((tmp_path / "out").glob("part-*.parquet"))


def test_window_freed_pages_are_counted_and_recounted():
    """Gemma 3's shape (5 sliding : 1 full): the sliding groups give pages back as the sequences outgrow the
    window; every step's statistics from the block tables equal a slot-by-slot recount, and the page
    bookkeeping stays exact."""
    from batchrun.engine import Engine, EngineConfig, LoadedModel

    model, expected = model_and_reference("gemma3_text")
    engine = Engine(
        LoadedModel(model, max_model_len=512),
        EngineConfig(device="cpu", num_pages=512, max_num_batched_tokens=64),
        torch.device("cpu"),
    )
    assert engine.kv_groups.sizes == (1,) * 6
    freed = []

    def check(eng, result):
        counted = eng.memory_snapshot()
        assert counted == eng.memory_snapshot(recount=True)
        eng.check_integrity()
        freed.append(counted.window_freed_pages)

    seqs, _ = run_engine(engine, prompts(256), SamplingParams(max_new_tokens=NEW_TOKENS), on_step=check)
    assert [s[0].output_token_ids for s in seqs] == expected
    assert max(freed) > 0 and engine.block_manager.num_window_freed > 0
    assert engine.num_used_pages == 0


def test_a_window_holds_fewer_pages_than_full_attention(monkeypatch):
    """The same model with every page kept (no page given back behind its window, as before KV cache groups)
    holds more. Only the pages' layout is changed: the KV groups, and so each layer's mask, stay the model's."""
    from batchrun.engine import Engine, EngineConfig, LoadedModel
    from batchrun.engine.core.page_pool import PageLayout

    model, expected = model_and_reference("mistral")
    peaks = {}
    real_layout = PageLayout.__init__
    for mode in ("groups", "kept"):
        if mode == "kept":  # every group's first key stays 0: no page goes back

            def kept(self, page_size, first_keys=None):
                real_layout(self, page_size, [lambda pos: 0 for _ in first_keys or [None]])

            monkeypatch.setattr(PageLayout, "__init__", kept)
        engine = Engine(
            LoadedModel(model, max_model_len=512),
            EngineConfig(device="cpu", num_pages=512),
            torch.device("cpu"),
        )
        used = []
        seqs, _ = run_engine(
            engine,
            prompts(256),
            SamplingParams(max_new_tokens=NEW_TOKENS),
            on_step=lambda e, r, used=used: used.append(e.num_used_pages),
        )
        assert [s[0].output_token_ids for s in seqs] == expected
        peaks[mode] = max(used)
    assert peaks["groups"] < peaks["kept"], peaks


@pytest.mark.parametrize("family", ["gemma3_text", "gemma4_text", "gpt_oss", "llama4_text"])
def test_prefix_sharing_and_copy_on_write_per_group(family):
    """Prompts sharing a prefix longer than the window, two greedy samples each (they share every page until
    they write): prefix hits and copy-on-write happen in every group, and each sample equals HF `generate`."""
    from batchrun.engine import Engine, EngineConfig, LoadedModel

    ours, ref = models(family)
    gen = torch.Generator().manual_seed(3)
    common = torch.randint(3, 256, (3 * WINDOW + 5,), generator=gen).tolist()
    shared = [common + torch.randint(3, 256, (n,), generator=gen).tolist() for n in (1, 7, 20, 40)]
    expected = hf_tokens(ref, shared)
    engine = Engine(
        LoadedModel(ours, max_model_len=512),
        EngineConfig(device="cpu", num_pages=512, max_num_seqs=4),
        torch.device("cpu"),
    )
    seqs, _ = run_engine(engine, shared, SamplingParams(max_new_tokens=NEW_TOKENS, n=2))
    for i, samples in enumerate(seqs):
        assert [s.output_token_ids for s in samples] == [expected[i]] * 2, f"prompt {i}"
    bm = engine.block_manager
    assert bm.prefix_cache.hit_tokens >= 3 * WINDOW and bm.num_cow_copies > 0 and bm.num_window_freed > 0
    engine.check_integrity()
    assert engine.num_used_pages == 0


def test_kv_shared_layers_write_nothing(monkeypatch):
    """Gemma 4's KV-shared layers are handed their source layer's very K/V, which that layer wrote into the same
    pages earlier in the step: they write nothing (6 of its 8 layers write each step), and it still equals HF."""
    from batchrun.engine.attention.backends import gather

    model, expected = model_and_reference("gemma4_text")
    writes = []
    real = gather.write_kv
    monkeypatch.setattr(gather, "write_kv", lambda *a: (writes.append(1), real(*a))[1])
    got, steps, engine = run(model, "gemma4_text", "gather")
    assert got == expected
    assert len(engine.kv_groups.readers) == 2
    assert len(writes) == (8 - 2) * len(steps)
    specs = engine.runner.services.specs
    assert [s.layer for s in specs if not s.writes] == sorted(engine.kv_groups.readers)


def test_weight_packing_leaves_the_linears_a_model_reads_itself():
    """Hunyuan's MoE router reads `self.wg.weight.dtype`: packed for oneDNN it has no plain weight, and the
    model was refused at load. Such linears stay `nn.Linear`; the rest are packed; the load probe passes."""
    import copy

    from batchrun.engine.model.architecture import inspect_model
    from batchrun.engine.model.ops.cpu_linear import PackedLinear, pack_linear_layers

    model = copy.deepcopy(models("hunyuan_v1_moe")[0])
    assert pack_linear_layers(model) > 0
    routers = [m.wg for m in model.modules() if hasattr(m, "wg")]
    assert routers and all(type(r) is torch.nn.Linear for r in routers)
    assert any(isinstance(m, PackedLinear) for m in model.modules())
    inspect_model(model)


# forwards that read token values, which the meta device has not: checked on their byte sizes alone before the load
NOT_ON_META = {"llama:dynamic_ntk", "longcat_flash"}


@pytest.mark.parametrize("family", sorted(SUPPORTED))
def test_the_pre_load_page_is_the_engines_page(family):
    """`engine.num_pages` means the same pages to the memory check made before the load as to the engine: the
    check runs the load's own probe on the model made on the meta device from its config (no second reading of
    the config), so a page is one KV cache group's layers there too."""
    from batchrun.engine.model.architecture import inspect_model
    from batchrun.engine.model.sizing import kv_page_bytes

    model, _ = models(family)
    before = kv_page_bytes(tiny_config(family, dict(SUPPORTED[family][1])), 16, torch.float32)
    probed = inspect_model(model).kv_spec(16, torch.float32).bytes_per_page
    assert before == (0 if family in NOT_ON_META else probed)


@pytest.mark.parametrize("family", ["gemma4_text", "llama", "gemma3_text"])
def test_the_probe_finds_the_kv_layout_on_the_meta_device(family):
    """The probe finds which layers read an earlier layer's K/V by where their tensors' elements are, not by
    data pointers (0 for every meta tensor): a model made on the meta device, with no weights, probes to the
    layout the loaded model does (the first step to sizing before the load from the probe itself)."""
    from batchrun.engine.model.architecture import inspect_model

    model, _ = models(family)
    with torch.device("meta"):
        meta = paged_model_from_config(tiny_config(family, dict(SUPPORTED[family][1]))).eval()
    probed, on_meta = inspect_model(model), inspect_model(meta)
    assert on_meta.groups == probed.groups and on_meta.kv_reads == probed.kv_reads
    assert bool(probed.kv_reads) == (family == "gemma4_text")


@pytest.mark.parametrize("family", ["qwen2_5_vl", "llava", "gemma3", "gemma4"])
def test_a_vision_language_config_is_sized_from_its_text_config(family):
    """The pre-load memory check read a vision-language model's page shape from the top-level config (which has
    no hidden_size: exit 1 with a raw AttributeError before any row); it reads the language model's config."""
    from transformers import AutoConfig

    from batchrun.engine.model.sizing import kv_page_bytes, model_max_len

    cfg = AutoConfig.for_model(family)
    text = cfg.get_text_config()
    assert kv_page_bytes(cfg, 16, torch.float32) > 0
    assert model_max_len(cfg) == model_max_len(text)


def test_kv_groups_of_two_shapes_share_one_page_size_without_overlap():
    """Gemma 4 E4B's proportions (35 sliding layers of 512 K/V elements per token, 7 full of 1024, the last 2 of
    each reading an earlier layer's K/V): the sliding layers go two to a page's worth, the last of them leaving
    half its pages unused; each layer's K and V views are disjoint columns of the page rows, every element of a
    page belongs to at most one layer, and a reusing layer sees its source's pages."""
    from batchrun.engine.core.cache_spec import KVCacheSpec, KVGroups, KVShape
    from batchrun.engine.worker.kv_cache import KVCache

    sliding, full = ("sliding", KVShape(1, 256, 256)), ("full", KVShape(1, 512, 512))
    layers = [full if i % 6 == 5 else sliding for i in range(42)]
    reads = {40: 34, 41: 35}  # 40 is sliding, 41 full: each reads the last earlier layer of its kind
    assert layers[40] == layers[34] and layers[41] == layers[35]
    groups = KVGroups.of_layers(layers, reads)
    counted = {k: [layers[i] for i in range(42) if i not in reads].count(k) for k in (sliding, full)}
    assert counted == {sliding: 34, full: 6}
    # gcd(34, 6) = 2 layers of the full shape fill a page: 2 x 1024 elements per token; sliding groups take 4
    assert groups.elements_per_token == 2 * 1024
    assert sorted(zip(groups.mask_kinds, groups.sizes)) == sorted(
        [("sliding", 4)] * 8 + [("sliding", 2)] + [("full", 2)] * 3
    )
    spec = KVCacheSpec(groups, page_size=4, dtype=torch.float32)

    def padding_bytes(g: int) -> int:  # of each of g's pages: a page's elements per token less its layers'
        return spec.page_size * (groups.elements_per_token - groups.sizes[g] * groups.shapes[g].elements) * 4

    padded = [g for g in range(groups.num_groups) if padding_bytes(g)]
    assert [groups.sizes[g] for g in padded] == [2] and padding_bytes(padded[0]) == 4 * 1024 * 4
    cache = KVCache(spec, num_pages=3, num_cpu_pages=0, device=torch.device("cpu"))
    owners = torch.zeros(groups.num_groups, 3, spec.page_elements)  # a page is one group's at a time
    for layer in range(42):
        group = groups.layer_group[layer]
        k, v = cache.layer(layer)
        assert k.shape[1:] == (4, 1, layers[layer][1].head_dim)
        if layer in reads:
            source = cache.layer(reads[layer])
            assert (k.data_ptr(), v.data_ptr()) == (source.k.data_ptr(), source.v.data_ptr())
            continue
        cache.pages.zero_()
        k.fill_(1.0)
        v.fill_(2.0)
        assert cache.pages.sum().item() == 3 * 4 * 3 * layers[layer][1].head_dim  # its own elements, no more
        owners[group] += cache.pages != 0
    assert owners.max().item() == 1  # no element of a group's page is two layers'
    unused = (owners[:, 0] == 0).sum(dim=1) * 4  # bytes of a group's page none of its layers holds
    assert unused.tolist() == [padding_bytes(g) for g in range(groups.num_groups)]
