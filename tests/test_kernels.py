"""Triton kernels against the plain PyTorch reference (interpreted on CPU tensors; `-m gpu` on CUDA)."""

import os

import pytest
import torch

from batchrun_kernels import paged_attention, ref_paged_attention, ref_write_kv_cache, write_kv_cache

ON_GPU = os.environ.get("BATCHRUN_TRITON_GPU") == "1" and torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def rel_err(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12)).item()


def make_case(
    query_lens, context_lens, page_size, num_kv_heads, gqa, head_dim, dtype, spare_pages=3, gen=None
):
    """Random pages in shuffled physical order; each sequence's block table lists its own pages."""
    blocks = [-(-c // page_size) for c in context_lens]
    num_pages = sum(blocks) + spare_pages
    k_cache = torch.randn(num_pages, page_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    v_cache = torch.randn(num_pages, page_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    order = torch.randperm(num_pages, generator=gen).tolist()
    tables, i = [], 0
    for b in blocks:
        tables.append(order[i : i + b] + [order[-1]] * (max(blocks) - b))  # padding points at a real page
        i += b
    q = torch.randn(sum(query_lens), num_kv_heads * gqa, head_dim, generator=gen).to(dtype)
    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)
    to = dict(device=DEVICE)
    return (
        q.to(**to),
        k_cache.to(**to),
        v_cache.to(**to),
        torch.tensor(tables, dtype=torch.int32, **to),
        torch.tensor(starts, dtype=torch.int32, **to),
        torch.tensor(context_lens, dtype=torch.int32, **to),
    )


def check(
    query_lens,
    context_lens,
    page_size=16,
    num_kv_heads=2,
    gqa=1,
    head_dim=32,
    dtype=torch.float32,
    seed=0,
    **extras,  # window, chunk, softcap, sinks (True: random ones per head, "token": per query token and head),
    # relative_bias (R: random ones per query token and head for distances 0..R-1), alibi_slopes (True: a random
    # positive slope per head)
):
    gen = torch.Generator().manual_seed(seed)
    q, kc, vc, bt, qsl, sl = make_case(
        query_lens, context_lens, page_size, num_kv_heads, gqa, head_dim, dtype, gen=gen
    )
    T, num_heads = q.shape[:2]
    if extras.get("sinks"):
        shape = (T, num_heads) if extras["sinks"] == "token" else (num_heads,)
        extras["sinks"] = torch.randn(shape, generator=gen).to(DEVICE)
    if extras.get("relative_bias"):
        extras["relative_bias"] = torch.randn(T, num_heads, extras["relative_bias"], generator=gen).to(DEVICE)
    if extras.get("alibi_slopes"):
        extras["alibi_slopes"] = torch.rand(num_heads, generator=gen).to(DEVICE)
    scale = head_dim**-0.5
    out = torch.full_like(q, float("nan"))  # poisoned: an element the kernel fails to write fails the test
    paged_attention(q, kc, vc, bt, qsl, sl, scale, out=out, **extras)
    cpu = {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in extras.items()}
    ref = ref_paged_attention(q.cpu(), kc.cpu(), vc.cpu(), bt.cpu(), qsl.cpu(), sl.cpu(), scale, **cpu)
    assert not out.isnan().any(), "unwritten output elements"
    err = rel_err(out.cpu(), ref)
    assert err < TOL[dtype], f"relative error {err:.2e} for {dtype}"
    if extras:
        plain = ref_paged_attention(q.cpu(), kc.cpu(), vc.cpu(), bt.cpu(), qsl.cpu(), sl.cpu(), scale)
        assert rel_err(plain, ref) > 10 * TOL[dtype], "the case does not tell the feature apart"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("ctx", [1, 16, 15, 17, 70])  # one token, one page, page boundary -1 / +1, many pages
def test_decode_context_lengths(ctx, dtype):
    check([1, 1], [ctx, max(1, ctx // 2)], dtype=dtype, seed=ctx)


@pytest.mark.parametrize("gqa", [1, 3, 4, 8])
def test_gqa_ratios_mixed_batch(gqa):
    # prefill from scratch, prefix-cached prefill (context longer than the queries), decode: one launch
    check([9, 5, 1, 1], [9, 37, 20, 3], num_kv_heads=1 if gqa == 8 else 2, gqa=gqa, seed=gqa)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_mixed_batch_every_dtype(dtype):
    check([12, 4, 1], [12, 40, 33], gqa=3, num_kv_heads=1, head_dim=64, dtype=dtype, seed=7)


@pytest.mark.parametrize("page_size", [8, 32, 128])
@pytest.mark.parametrize("head_dim", [32, 64])
def test_page_sizes_and_head_dims(page_size, head_dim):
    check(
        [3, 1],
        [page_size + 3, 2 * page_size - 1],
        page_size=page_size,
        head_dim=head_dim,
        gqa=2,
        num_kv_heads=1,
        seed=page_size + head_dim,
    )


@pytest.mark.parametrize("head_dim", [128, 256])
def test_large_head_dims(head_dim):
    check([2, 1], [5, 18], head_dim=head_dim, num_kv_heads=1, gqa=1, seed=head_dim)


@pytest.mark.parametrize(
    "extras",
    [
        dict(window=20),
        dict(chunk=16),
        dict(softcap=2.0),
        dict(sinks=True),
        dict(window=9, softcap=3.0, sinks=True),
        dict(sinks="token"),
        dict(relative_bias=24),
        dict(window=20, relative_bias=20, sinks="token"),
        dict(alibi_slopes=True),
        dict(window=20, relative_bias=20, alibi_slopes=True),
    ],
    ids=lambda e: "-".join(f"{k}{v}" for k, v in e.items()),
)
def test_layer_features_in_a_mixed_batch(extras):
    # a prompt from scratch, a chunk behind cached pages, decodes: windows and chunks cut inside pages
    check([40, 9, 1, 1], [40, 57, 70, 18], gqa=2, num_kv_heads=2, seed=11, **extras)


def test_shape_mistakes_are_assertions():
    q, kc, vc, bt, qsl, sl = make_case([1], [4], 16, 2, 1, 32, torch.float32)
    with pytest.raises(AssertionError):
        paged_attention(q, kc[:, :, :1], vc, bt, qsl, sl, 1.0)  # K and V caches differ
    with pytest.raises(AssertionError):
        paged_attention(q, kc, vc, bt, qsl[:1], sl, 1.0)  # query_start_loc of the wrong length
    with pytest.raises(AssertionError):
        paged_attention(q.half(), kc, vc, bt, qsl, sl, 1.0)  # dtypes differ


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_kv_cache_matches_reference(dtype):
    gen = torch.Generator().manual_seed(1)
    T, H, D, P, N = 7, 3, 32, 8, 6
    key = torch.randn(T, H, D, generator=gen).to(dtype).to(DEVICE)
    value = torch.randn(T, H, D, generator=gen).to(dtype).to(DEVICE)
    slots = torch.randperm(N * P, generator=gen)[:T].to(DEVICE)
    kc = torch.full((N, P, H, D), float("nan"), dtype=dtype, device=DEVICE)
    vc = kc.clone()
    kr, vr = kc.clone().cpu(), vc.clone().cpu()
    write_kv_cache(key, value, kc, vc, slots)
    ref_write_kv_cache(key.cpu(), value.cpu(), kr, vr, slots.cpu())
    assert torch.equal(kc.cpu().nan_to_num(7.0), kr.nan_to_num(7.0))
    assert torch.equal(vc.cpu().nan_to_num(7.0), vr.nan_to_num(7.0))


@pytest.mark.skipif(
    ON_GPU,
    reason="the GPU check's machine has no embedded model; bench/gpu_bench.py runs random-weight models",
)
def test_engine_with_triton_attention_matches_torch(model_dir):
    """The engine's Triton path (interpreted here) against its torch path, token for token, on the embedded
    model's first four layers and its own weights: the interpreter runs every layer call, and the whole model's
    30 layers made this test one of the suite's slowest (the GPU check runs it whole on a GPU)."""
    from helpers import chat_ids, make_engine, run_engine
    from transformers import AutoConfig

    from batchrun.engine import SamplingParams
    from batchrun.engine.model.loading import load_model

    config = AutoConfig.from_pretrained(model_dir)
    config.num_hidden_layers = 4
    tok_model = load_model(model_dir, torch.float32, torch.device("cpu"), config=config)
    tok, _ = tok_model
    prompts = [chat_ids(tok, p) for p in ("Hi!", "Name a color.", "What is 3 + 4?")]
    params = SamplingParams(max_new_tokens=4)
    torch_seqs, _ = run_engine(make_engine(tok_model, attention="torch"), prompts, params)
    triton_seqs, _ = run_engine(make_engine(tok_model, attention="triton"), prompts, params)
    assert [s[0].output_token_ids for s in triton_seqs] == [s[0].output_token_ids for s in torch_seqs]


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs CUDA and BATCHRUN_TRITON_GPU=1")
def test_gpu_large_decode_batch():
    check([1] * 64, [2048] * 64, num_kv_heads=8, gqa=4, head_dim=128, dtype=torch.bfloat16)


# The GPU check's fp32 exactness: shapes of real models with random weights (no checkpoint travels to the GPU
# machine). hidden, intermediate, layers, query heads, KV heads, head dim.
EXACT_SHAPES = {"smollm2-135m": (576, 1536, 30, 9, 3, 64), "llama-8b-4-layers": (4096, 14336, 4, 32, 8, 128)}


def engine_equals_hf_generate(sizes, device: str, rows: int = 8, new_tokens: int = 24):
    """fp32: the engine's batch (Triton attention) against HF `generate` one row at a time (no padding)."""
    from helpers import paged_model_from_config, run_engine
    from transformers import AutoModelForCausalLM, LlamaConfig

    from batchrun.engine import Engine, EngineConfig, LoadedModel, SamplingParams

    names = "hidden_size intermediate_size num_hidden_layers num_attention_heads num_key_value_heads head_dim"
    config = lambda: LlamaConfig(
        vocab_size=49152, max_position_embeddings=1024, **dict(zip(names.split(), sizes))
    )  # noqa: E731 - one each: a model sets its attention on its config
    torch.manual_seed(0)
    with torch.device(device):  # made where they run: an 8B layer's weights are slow to make on the host
        ours = paged_model_from_config(config())
        ref = AutoModelForCausalLM.from_config(config(), attn_implementation="eager", dtype=torch.float32)
    ref.load_state_dict(ours.state_dict())
    ref.eval()
    gen = torch.Generator().manual_seed(2)
    prompts = [
        torch.randint(100, 40000, (n,), generator=gen).tolist() for n in torch.randint(16, 300, (rows,))
    ]
    expected = []
    with torch.inference_mode():
        for p in prompts:
            ids = ref.generate(torch.tensor([p], device=device), max_new_tokens=new_tokens, do_sample=False)
            expected.append(ids[0, len(p) :].tolist())
    cfg = EngineConfig(device=device, num_pages=1024, attention="triton", max_num_batched_tokens=512)
    engine = Engine(LoadedModel(ours, max_model_len=1024), cfg, torch.device(device))
    seqs, _ = run_engine(engine, prompts, SamplingParams(max_new_tokens=new_tokens))
    got = [s[0].output_token_ids for s in seqs]
    diff = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None) for a, b in zip(got, expected)]
    assert got == expected, f"first differing position per row: {diff}"


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs CUDA and BATCHRUN_TRITON_GPU=1")
@pytest.mark.parametrize("shape", sorted(EXACT_SHAPES))
def test_gpu_engine_equals_hf_generate_fp32(shape):
    # 20 rows: decodes over the scheduler's columns beside prompt chunks, on the device
    engine_equals_hf_generate(EXACT_SHAPES[shape], "cuda", rows=20)
