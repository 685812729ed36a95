"""The CPU kernels (cpu_kernels.cpp): paged decode (reads K/V in the pages) against the plain PyTorch
reference, and the engine with it against Hugging Face `generate`; the greedy argmax against torch.argmax."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import hf_greedy, make_engine, run_engine

from batchrun.engine import SamplingParams
from batchrun.engine.cpu_kernels import argmax_rows, build_dir, load
from batchrun_kernels import ref_paged_attention

KERNEL = load()
pytestmark = pytest.mark.skipif(KERNEL is None, reason="no C++ compiler here")
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


def decode_case(context_lens, page_size, num_kv_heads, gqa, head_dim, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    blocks = [-(-c // page_size) for c in context_lens]
    num_pages = sum(blocks) + 3
    k_cache = torch.randn(num_pages, page_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    v_cache = torch.randn(num_pages, page_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    order = torch.randperm(num_pages, generator=gen).tolist()
    tables, i = [], 0
    for b in blocks:
        tables.append(order[i : i + b] + [order[-1]] * (max(blocks) - b))
        i += b
    G = len(context_lens)
    # the queries sit among other packed rows (prefill tokens), in a [Hq, T, D] buffer seen as [T, Hq, D]
    T = G + 5
    query = torch.randn(num_kv_heads * gqa, T, head_dim, generator=gen).to(dtype).transpose(0, 1)
    rows = torch.randperm(T, generator=gen)[:G]
    return query, k_cache, v_cache, torch.tensor(tables, dtype=torch.int32), rows


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 5, 300])  # one decode, a few, a prompt over several threads' share
def test_write_kv_puts_each_tokens_k_and_v_where_index_put_does(dtype, tokens):
    """K/V as the attention module gives them ([1, H, T, D] seen as [T, H, D]: head-major), keys wider than
    values (MLA), into pages with a page stride of their own (kv_cache.py's views): the bytes index_put_ writes."""
    gen = torch.Generator().manual_seed(tokens)
    pages, page_size, heads, dk, dv = 40, 16, 3, 24, 16
    pool = torch.randn(pages, page_size * heads * (dk + dv) + 5, generator=gen).to(dtype)
    k_cache = pool[:, : page_size * heads * dk].unflatten(1, (page_size, heads, dk))
    v_cache = pool[:, page_size * heads * dk : page_size * heads * (dk + dv)].unflatten(
        1, (page_size, heads, dv)
    )
    slots = torch.randperm(pages * page_size, generator=gen)[:tokens]
    slot_pages, slot_offsets = slots // page_size, slots % page_size
    key = torch.randn(1, heads, tokens, dk, generator=gen).to(dtype)[0].transpose(0, 1)
    value = torch.randn(1, heads, tokens, dv, generator=gen).to(dtype)[0].transpose(0, 1)
    want = pool.clone()
    want_k = want[:, : page_size * heads * dk].unflatten(1, (page_size, heads, dk))
    want_v = want[:, page_size * heads * dk : page_size * heads * (dk + dv)].unflatten(
        1, (page_size, heads, dv)
    )
    want_k.index_put_((slot_pages, slot_offsets), key)
    want_v.index_put_((slot_pages, slot_offsets), value)
    assert KERNEL.write_kv(key, value, k_cache, v_cache, slot_pages, slot_offsets)
    assert torch.equal(pool, want)  # the padding past each page's V untouched too
    other = key.to(torch.float16)  # a dtype the cache does not have: declined, nothing written
    assert not KERNEL.write_kv(other, value, k_cache, v_cache, slot_pages, slot_offsets)
    with pytest.raises(RuntimeError, match="out of range"):
        KERNEL.write_kv(key, value, k_cache, v_cache, slot_pages + pages, slot_offsets)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab", [1, 15, 64, 65, 1000, 49152])  # under one vector, whole vectors, a tail
def test_argmax_matches_torch(dtype, vocab):
    gen = torch.Generator().manual_seed(vocab)
    x = torch.randn(12, vocab, generator=gen).to(dtype)
    x[1] = float("-inf")  # all masked: index 0
    x[2, vocab // 2] = float("nan")  # a NaN counts as the largest
    x[3, -1] = float("nan")
    x[4] = 0.0  # all tied: the first
    x[5, -1] = 50.0  # the largest in the tail
    x[6] = torch.randint(0, 3, (vocab,), generator=gen).to(dtype)  # ties among many
    x[7, 0] = float("inf")
    expected = x.float().argmax(dim=-1)
    assert torch.equal(KERNEL.argmax_rows(x), expected)
    assert torch.equal(argmax_rows(x), expected)
    wide = torch.randn(12, vocab + 3, generator=gen).to(dtype)[:, :vocab]  # rows with a stride of their own
    assert torch.equal(argmax_rows(wide), wide.float().argmax(dim=-1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(  # head dims 32, 64, 128 take the AVX-512 path (pages of 8, 16, 32 keys) and, bf16 with
    # AVX512-BF16, cpu_decode_bf16.cpp (GQA heads over one or more passes of its PV product); 24 and pages of an
    # odd size the generic loops
    "page_size,num_kv_heads,gqa,head_dim",
    [
        (16, 3, 3, 64),
        (8, 2, 1, 32),
        (32, 1, 4, 128),
        (8, 2, 2, 64),
        (8, 2, 1, 24),
        (8, 1, 9, 32),
        (5, 2, 3, 64),
    ],
)
def test_paged_decode_matches_the_reference(dtype, page_size, num_kv_heads, gqa, head_dim):
    context_lens = [1, page_size, page_size + 1, 3 * page_size - 1, 200]
    q, kc, vc, bt, rows = decode_case(context_lens, page_size, num_kv_heads, gqa, head_dim, dtype, seed=gqa)
    scale = head_dim**-0.5
    out = torch.full_like(q, float("nan"))
    seq_lens = torch.tensor(context_lens, dtype=torch.int32)
    KERNEL.paged_decode_attention(out, q, kc, vc, bt, seq_lens, rows, scale)
    qsl = torch.arange(len(context_lens) + 1, dtype=torch.int32)
    ref = ref_paged_attention(q[rows].float(), kc.float(), vc.float(), bt, qsl, seq_lens, scale)
    got = out[rows].float()
    assert not got.isnan().any(), "a decoding row was not written"
    others = torch.ones(q.shape[0], dtype=torch.bool)
    others[rows] = False
    assert out[others].isnan().all(), "rows that are not decoding were written"
    err = ((got - ref).norm() / ref.norm()).item()
    assert err < TOL[dtype], f"relative error {err:.2e} for {dtype}"


@pytest.mark.parametrize("attention", ["torch", "gather"])
def test_engine_on_the_cpu_equals_hf_generate(tok_model, model_dir, chat_prompts, attention):
    prompts = chat_prompts[:8]
    engine = make_engine(tok_model, attention=attention, max_num_batched_tokens=512, num_pages=256)
    assert engine.attention.name == attention
    seqs, _ = run_engine(engine, prompts, SamplingParams(max_new_tokens=24))
    expected = hf_greedy(model_dir, prompts, 24)
    for i, (got, want) in enumerate(zip(seqs, expected)):
        assert got[0].output_token_ids == want, f"prompt {i} differs"
    engine.check_integrity()


def test_a_build_killed_midway_does_not_hang_the_next_process():
    """torch's builder waits, forever, for its `lock` file to go; a process killed mid-build leaves it behind."""
    stale = build_dir() / "lock"
    stale.touch()  # what a process killed while compiling leaves
    probe = "from batchrun.engine.cpu_kernels import load; assert load() is not None"
    subprocess.run([sys.executable, "-c", probe], check=True, timeout=300)
    assert not stale.exists()


def test_the_build_folder_is_keyed_by_source_checkout_torch_and_cpu(tmp_path, monkeypatch):
    """Issue 24, item 5: two checkouts (or installed versions) of other sources, or two torch versions, rebuilt
    each other's build in turn in one folder per CPU; each now has its own, and `make install` builds it. Two
    checkouts of the same sources, or two torch installs, have one each too; two environments over one torch
    install share one."""
    from batchrun.engine import cpu_kernels

    here = build_dir()
    other = tmp_path / "cpu_kernels.cpp"
    other.write_bytes(cpu_kernels.SOURCE.read_bytes() + b"\n// another version\n")
    monkeypatch.setattr(cpu_kernels, "SOURCE", other)
    assert build_dir() != here
    monkeypatch.undo()
    monkeypatch.setattr(torch, "__version__", "0.0.1")
    assert build_dir() != here
    monkeypatch.undo()
    monkeypatch.setattr(cpu_kernels, "cpu_description", lambda: "another CPU")
    assert build_dir() != here
    monkeypatch.undo()
    # a second checkout of the same sources (torch's build file names the sources' paths)
    checkout = tmp_path / "checkout"
    checkout.mkdir()
    (checkout / cpu_kernels.SOURCE.name).write_bytes(cpu_kernels.SOURCE.read_bytes())
    monkeypatch.setattr(cpu_kernels, "SOURCE", checkout / cpu_kernels.SOURCE.name)
    assert build_dir() != here
    monkeypatch.undo()
    # another torch install of the same version (its include folder is in the build file)
    monkeypatch.setattr(torch, "__file__", str(tmp_path / "site-packages" / "torch" / "__init__.py"))
    assert build_dir() != here
    monkeypatch.undo()
    # another environment over the same torch install (make test's .venv-quant over .venv) shares the build:
    # its build file is the same, and a folder of its own compiled the kernels a second time
    monkeypatch.setattr(sys, "prefix", str(tmp_path / ".venv-quant"))
    assert build_dir() == here
    monkeypatch.undo()
    assert build_dir() == here
    makefile = (Path(__file__).parent.parent / "Makefile").read_text()
    assert (
        "python -m batchrun.engine.cpu_kernels"
        in makefile.split("$(STAMP): pyproject.toml")[1].split("\n\n")[0]
    )


def test_batchrun_cpu_isa_avx2_builds_for_an_avx2_cpu_and_reads_its_flags(monkeypatch):
    """Issue 65, item 10: the kernels' non-AVX-512 paths, which most rented CPUs run, can run on a CPU with AVX-512
    (`make test-avx2`): built for x86-64-v3 in a folder of their own, and the CPU's flags read as an AVX2 CPU's
    (no bf16 packing, which oneDNN held to AVX2 refuses; `auto` not bf16). Another value is a clear error."""
    from batchrun import host
    from batchrun.engine import cpu_kernels
    from batchrun.errors import BadInput

    flags = "avx2 fma f16c avx512f avx512bw avx512vl avx512dq avx512_bf16 avx512_fp16 amx_bf16 avx_vnni"
    monkeypatch.setattr(host, "cpu_description", lambda: f"model name\t: test CPU\nflags\t\t: {flags}")
    monkeypatch.delenv("BATCHRUN_CPU_ISA", raising=False)  # make test-avx2 sets it
    native = build_dir()
    assert host.cpu_packs_bf16() and host.cpu_has_fast_bf16()
    monkeypatch.setenv("BATCHRUN_CPU_ISA", "avx2")
    assert cpu_kernels.target_flags() == ["-march=x86-64-v3"] and build_dir() != native
    assert host.cpu_flags() == {"avx2", "fma", "f16c"}
    assert not host.cpu_packs_bf16() and not host.cpu_has_fast_bf16()
    monkeypatch.setenv("BATCHRUN_CPU_ISA", "avx512")
    with pytest.raises(BadInput, match="BATCHRUN_CPU_ISA is 'avx512'"):
        build_dir()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "extras",
    [
        dict(window=20),  # the first visible key mid-page, and whole pages before it skipped
        dict(window=16),
        dict(chunk=32),
        dict(softcap=3.0),
        dict(sinks=True),
        dict(window=24, softcap=2.0, sinks=True),
        dict(sinks="token"),  # Inkling 2's: a sink logit per query token and head
        dict(relative_bias=24),  # and a bias per query token and head by the key's distance back
        dict(window=20, relative_bias=20, sinks="token"),
        dict(alibi=True),  # Bloom's and MPT's: a slope per head times the key's distance back
        dict(window=20, relative_bias=20, alibi=True),
    ],
    ids=lambda e: "-".join(f"{k}{v}" for k, v in e.items()),
)
@pytest.mark.parametrize("head_dim", [64, 32, 24])  # the AVX-512 path (two unrolled dims) and the generic one
def test_paged_decode_with_layer_features_matches_the_reference(dtype, extras, head_dim):
    page_size, num_kv_heads, gqa = 16, 2, 3
    context_lens = [1, 15, 16, 17, 33, 64, 200]
    q, kc, vc, bt, rows = decode_case(context_lens, page_size, num_kv_heads, gqa, head_dim, dtype, seed=3)
    scale = head_dim**-0.5
    window, chunk, softcap = extras.get("window", 0), extras.get("chunk", 0), extras.get("softcap", 0.0)
    gen = torch.Generator().manual_seed(5)
    T, num_heads = q.shape[:2]
    sinks = bias = slopes = (
        None  # the kernel's: per packed row where per token; the reference's: of the decoding rows
    )
    if "sinks" in extras:
        sinks = torch.randn((T, num_heads) if extras["sinks"] == "token" else (num_heads,), generator=gen)
    if "relative_bias" in extras:
        bias = torch.randn(T, num_heads, extras["relative_bias"], generator=gen)
    if "alibi" in extras:
        slopes = torch.rand(num_heads, generator=gen)
    first = [
        max(0, c - window) if window else ((c - 1) - (c - 1) % chunk if chunk else 0) for c in context_lens
    ]
    out = torch.full_like(q, float("nan"))
    seq_lens = torch.tensor(context_lens, dtype=torch.int32)
    first_keys = torch.tensor(first, dtype=torch.int32) if window or chunk else None
    KERNEL.paged_decode_attention(
        out, q, kc, vc, bt, seq_lens, rows, scale, first_keys, softcap, sinks, bias, slopes
    )
    qsl = torch.arange(len(context_lens) + 1, dtype=torch.int32)
    ref = ref_paged_attention(
        q[rows].float(), kc.float(), vc.float(), bt, qsl, seq_lens, scale, window, chunk, softcap,
        sinks if sinks is None or sinks.dim() == 1 else sinks[rows],
        None if bias is None else bias[rows], slopes,
    )  # fmt: skip
    got = out[rows].float()
    assert not got.isnan().any()
    err = ((got - ref).norm() / ref.norm()).item()
    assert err < TOL[dtype], f"relative error {err:.2e} for {dtype}"
    plain = torch.full_like(q, float("nan"))
    KERNEL.paged_decode_attention(plain, q, kc, vc, bt, seq_lens, rows, scale)
    assert not torch.allclose(plain[rows].float(), ref, atol=1e-3), "the case does not tell the feature apart"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_decoding_rows_output_is_the_same_alone_or_among_batch_mates(dtype):
    context_lens = [1, 17, 200, 64, 333, 95]
    q, kc, vc, bt, rows = decode_case(context_lens, 16, 3, 3, 64, dtype, seed=4)
    seq_lens = torch.tensor(context_lens, dtype=torch.int32)
    together = torch.full_like(q, float("nan"))
    KERNEL.paged_decode_attention(together, q, kc, vc, bt, seq_lens, rows, 0.125)
    for g in (0, 2, 4):
        alone = torch.full_like(q, float("nan"))
        KERNEL.paged_decode_attention(
            alone, q, kc, vc, bt[g : g + 1], seq_lens[g : g + 1], rows[g : g + 1], 0.125
        )
        assert torch.equal(alone[rows[g]], together[rows[g]]), f"sequence {g} differs among batch-mates"


def test_paged_decode_with_unequal_key_and_value_dims():
    """MLA: keys of 48 dims, values of 32."""
    gen = torch.Generator().manual_seed(9)
    context_lens, P, H = [5, 40], 16, 2
    q, kc, _, bt, rows = decode_case(context_lens, P, H, 1, 48, torch.float32, seed=9)
    vc = torch.randn(kc.shape[0], P, H, 32, generator=gen)
    out = torch.full((q.shape[0], q.shape[1], 32), float("nan"))
    seq_lens = torch.tensor(context_lens, dtype=torch.int32)
    KERNEL.paged_decode_attention(out, q, kc, vc, bt, seq_lens, rows, 0.2)
    qsl = torch.arange(len(context_lens) + 1, dtype=torch.int32)
    ref = ref_paged_attention(q[rows], kc, vc, bt, qsl, seq_lens, 0.2)
    assert torch.allclose(out[rows], ref, atol=1e-5)
