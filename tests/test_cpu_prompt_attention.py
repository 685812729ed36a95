"""The bf16 prompt attention kernel (cpu_prompt_attention.cpp) against plain PyTorch: fp32 arithmetic on the same
bf16 inputs, a softmax over the keys masks.py's `MaskKind.visible` lets each query see."""

import pytest
import torch

from batchrun.engine.attention.masks import MaskKind
from batchrun.engine.cpu_kernels import load

KERNEL = load()
pytestmark = pytest.mark.skipif(KERNEL is None, reason="no C++ compiler here")
needs_bf16 = pytest.mark.skipif(
    KERNEL is None or not KERNEL.prompt_attention_bf16_supported(64, 64, 1),
    reason="a CPU without AVX512-BF16: the kernel is not built, the SDPA path runs instead",
)
# tests/test_cpu_kernels.py's bf16 bound (relative, in norm): the probabilities rounded to bf16 for the PV
# product (relative error 2^-9 each) and the output rounded once stay well inside it
TOL = 1e-2


def prompt_case(queries, contexts, page_size, num_kv_heads, gqa, head_dim, seed, null_before=None):
    """bf16 pages holding each sequence's context (shuffled page ids), its queries the last of its context
    among other packed rows in a head-major buffer. `null_before`: per sequence, pages wholly before this key
    are NULL (-1), as a window's pages given back."""
    gen = torch.Generator().manual_seed(seed)
    blocks = [-(-c // page_size) for c in contexts]
    num_pages = sum(blocks) + 2
    shape = (num_pages, page_size, num_kv_heads, head_dim)
    k_cache = torch.randn(*shape, generator=gen).bfloat16()
    v_cache = torch.randn(*shape, generator=gen).bfloat16()
    order = torch.randperm(num_pages, generator=gen).tolist()
    tables, i = [], 0
    for s, b in enumerate(blocks):
        row = order[i : i + b] + [order[-1]] * (max(blocks) - b)
        if null_before is not None:
            row = [-1 if (j + 1) * page_size <= null_before[s] else p for j, p in enumerate(row)]
        tables.append(row)
        i += b
    T = sum(queries) + 3
    query = torch.randn(num_kv_heads * gqa, T, head_dim, generator=gen).bfloat16().transpose(0, 1)
    starts, t = [], 1  # row 0 and the last two belong to no sequence here
    for q in queries:
        starts.append(t)
        t += q
    return query, k_cache, v_cache, torch.tensor(tables, dtype=torch.int32), starts


def reference(
    query, k_cache, v_cache, tables, starts, queries, contexts, scale, kind, softcap=0.0, sinks=None
):
    """Each sequence's rows: fp32 scores of its queries against its context read through its block table,
    soft-capped, masked by `kind.visible`, a sink column, softmax, times V."""
    out = {}
    gqa = query.shape[1] // k_cache.shape[2]
    for s, (q, c, start) in enumerate(zip(queries, contexts, starts)):
        pages = tables[s, : -(-c // k_cache.shape[1])].clamp(min=0).long()
        k = k_cache[pages].flatten(0, 1)[:c].float().repeat_interleave(gqa, 1).transpose(0, 1)  # [Hq, c, D]
        v = v_cache[pages].flatten(0, 1)[:c].float().repeat_interleave(gqa, 1).transpose(0, 1)
        qs = query[start : start + q].float().transpose(0, 1)  # [Hq, q, D]
        scores = qs @ k.transpose(1, 2) * scale
        if softcap:
            scores = softcap * torch.tanh(scores / softcap)
        seen = kind.visible(torch.arange(c - q, c), torch.arange(c))
        scores = scores.masked_fill(~seen, float("-inf"))
        if sinks is not None:
            scores = torch.cat([scores, sinks.view(-1, 1, 1).expand(-1, q, 1)], dim=-1)
        probs = scores.softmax(-1)[..., :c]
        out[s] = (probs @ v).transpose(0, 1)  # [q, Hq, D]
    return out


def run_kernel(
    query, k_cache, v_cache, tables, starts, queries, contexts, scale, kind, softcap=0.0, sinks=None
):
    out = torch.full(query.shape, float("nan"), dtype=torch.bfloat16)
    i32 = lambda x: torch.tensor(x, dtype=torch.int32)  # noqa: E731
    KERNEL.paged_prompt_attention(
        out, query, k_cache, v_cache, tables, i32(starts), i32(queries), i32(contexts), scale,
        kind.window or 0, kind.chunk or 0, softcap, sinks,
    )  # fmt: skip
    return out


def check(out, ref, starts, queries):
    written = torch.zeros(out.shape[0], dtype=torch.bool)
    for s, (start, q) in enumerate(zip(starts, queries)):
        got = out[start : start + q].float()
        assert not got.isnan().any(), f"sequence {s}: a row was not written"
        err = ((got - ref[s]).norm() / ref[s].norm()).item()
        assert err < TOL, f"sequence {s}: relative error {err:.2e}"
        written[start : start + q] = True
    assert out[~written].isnan().all(), "rows of no sequence were written"


# whole prompts (context = queries), later chunks and prompts behind cached pages (context > queries), lengths
# across the 16-query tiles and 64-key blocks, one short of and one past them
QUERIES = [1, 17, 64, 100, 5, 40, 200]
CONTEXTS = [1, 17, 64, 100, 70, 129, 333]


@needs_bf16
@pytest.mark.parametrize(
    "kind", [MaskKind(), MaskKind(window=20), MaskKind(window=70), MaskKind(chunk=32)], ids=str
)
@pytest.mark.parametrize(
    "page_size,num_kv_heads,gqa,head_dim", [(16, 3, 3, 64), (8, 2, 1, 64), (16, 1, 4, 128), (32, 2, 3, 32)]
)
def test_prompt_attention_matches_the_reference(kind, page_size, num_kv_heads, gqa, head_dim):
    case = prompt_case(QUERIES, CONTEXTS, page_size, num_kv_heads, gqa, head_dim, seed=gqa + head_dim)
    scale = head_dim**-0.5
    out = run_kernel(*case, QUERIES, CONTEXTS, scale, kind)
    check(out, reference(*case, QUERIES, CONTEXTS, scale, kind), case[4], QUERIES)


@needs_bf16
@pytest.mark.parametrize(
    "extras", [dict(softcap=5.0), dict(sinks=True), dict(softcap=3.0, sinks=True)], ids=str
)
def test_prompt_attention_with_softcap_and_sinks(extras):
    num_kv_heads, gqa, head_dim = 2, 3, 64
    case = prompt_case(QUERIES, CONTEXTS, 16, num_kv_heads, gqa, head_dim, seed=7)
    sinks = (
        torch.randn(num_kv_heads * gqa, generator=torch.Generator().manual_seed(1)) + 5
        if "sinks" in extras
        else None
    )
    softcap = extras.get("softcap", 0.0)
    # queries scaled up so that soft-capping changes the scores
    scale = 4 * head_dim**-0.5 if softcap else head_dim**-0.5
    out = run_kernel(*case, QUERIES, CONTEXTS, scale, MaskKind(), softcap, sinks)
    ref = reference(*case, QUERIES, CONTEXTS, scale, MaskKind(), softcap, sinks)
    check(out, ref, case[4], QUERIES)
    plain = reference(*case, QUERIES, CONTEXTS, scale, MaskKind())
    differs = [not torch.allclose(plain[s], ref[s], atol=3e-2) for s in ref]
    assert all(differs[1:]), "the case does not tell the feature apart"


@needs_bf16
def test_keys_no_query_sees_are_never_read():
    """A windowed sequence's pages wholly behind its first query's window are NULL (-1) or given back and not
    cleared since, and the slots past its context were never written: NaN there changes nothing."""
    queries, contexts, window, P = [30, 50], [300, 150], 40, 16
    first = [c - q - window + 1 for q, c in zip(queries, contexts)]  # the first query's first key
    case = prompt_case(queries, contexts, P, 2, 2, 64, seed=11, null_before=[first[0], 0])
    query, k_cache, v_cache, tables, starts = case
    assert (tables[0] < 0).any()
    kind = MaskKind(window=window)
    ref = reference(*case, queries, contexts, 0.125, kind)
    for s, c in enumerate(contexts):
        for key in range(tables.shape[1] * P):
            page = tables[s, key // P].item()
            if page >= 0 and (key < first[s] or key >= c):
                k_cache[page, key % P] = float("nan")
                v_cache[page, key % P] = float("nan")
    assert k_cache.isnan().any()
    check(run_kernel(*case, queries, contexts, 0.125, kind), ref, starts, queries)


@needs_bf16
def test_a_rows_output_is_the_same_alone_or_among_batch_mates():
    num_kv_heads, gqa, head_dim = 3, 3, 64
    case = prompt_case(QUERIES, CONTEXTS, 16, num_kv_heads, gqa, head_dim, seed=5)
    query, k_cache, v_cache, tables, starts = case
    together = run_kernel(*case, QUERIES, CONTEXTS, 0.125, MaskKind())
    for s in (0, 3, 6):
        alone = run_kernel(query, k_cache, v_cache, tables[s : s + 1], starts[s : s + 1], QUERIES[s : s + 1],
                           CONTEXTS[s : s + 1], 0.125, MaskKind())  # fmt: skip
        rows = slice(starts[s], starts[s] + QUERIES[s])
        assert torch.equal(alone[rows], together[rows]), f"sequence {s} differs among batch-mates"


@needs_bf16
def test_unsupported_head_dims_are_refused():
    assert not KERNEL.prompt_attention_bf16_supported(80, 80, 1)
    assert not KERNEL.prompt_attention_bf16_supported(64, 32, 1)  # MLA: K and V of different dims
    case = prompt_case([4], [4], 16, 1, 1, 80, seed=2)
    with pytest.raises(RuntimeError, match="head dims"):
        run_kernel(*case, [4], [4], 0.1, MaskKind())


@needs_bf16
def test_more_than_16_query_heads_per_kv_head_are_refused():
    """A tile holds 16 queries of up to 16 heads each: 16 query heads per KV head are taken (and computed as
    plain attention computes them), 17 refused, by the same answer the engine asks at load."""
    assert KERNEL.prompt_attention_bf16_supported(64, 64, 16)
    assert not KERNEL.prompt_attention_bf16_supported(64, 64, 17)
    for gqa in (16, 17):
        case = prompt_case([20], [20], 16, 1, gqa, 64, seed=3)
        if gqa == 16:
            out = run_kernel(*case, [20], [20], 0.1, MaskKind())
            want = reference(*case, [20], [20], 0.1, MaskKind())
            check(out, want, case[4], [20])
        else:
            with pytest.raises(RuntimeError, match="query heads per KV head"):
                run_kernel(*case, [20], [20], 0.1, MaskKind())


def saved_tiny(tmp_path, family: str, model_dir, **overrides):
    """A tiny bf16-able model of `family` (head dim 64, three query heads per KV head), saved with the default
    model's tokenizer."""
    from helpers import save_with_tokenizer
    from model_families import perturb, tiny_config
    from transformers import AutoModelForCausalLM

    # weights of 0.1: at TINY's 0.3 a bf16 forward is logprobs apart from the fp32 one, which would hide a kernel's
    # fault in the tolerance
    shape = dict(hidden_size=192, num_attention_heads=3, num_key_value_heads=1, head_dim=64, vocab_size=49152)
    shape["initializer_range"] = 0.1
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(family, {**shape, **overrides}))
    perturb(model, seed=0)
    return save_with_tokenizer(model, tmp_path / family, model_dir)


class Counting:
    """The compiled module, counting its prompt and decode kernels' calls."""

    def __init__(self, kernel):
        self.kernel, self.prompt_calls, self.decode_calls = kernel, 0, 0

    def paged_prompt_attention(self, *args):
        self.prompt_calls += 1
        return self.kernel.paged_prompt_attention(*args)

    def paged_decode_attention(self, *args):
        self.decode_calls += 1
        return self.kernel.paged_decode_attention(*args)

    def __getattr__(self, name):
        return getattr(self.kernel, name)


def prompt_logprobs(llm, prompts) -> list[torch.Tensor]:
    from batchrun import SamplingParams

    params = SamplingParams(max_new_tokens=1, prompt_logprobs=True)
    return [torch.tensor(o.prompt_logprobs[1:]) for o in llm.generate(prompts, params, use_tqdm=False)]


@needs_bf16
@pytest.mark.parametrize(
    "family,overrides",
    [
        ("llama", {}),
        ("qwen2", dict(use_sliding_window=True, sliding_window=32, max_window_layers=1)),
        ("gemma2", dict(sliding_window=32, num_hidden_layers=2, attn_logit_softcapping=5.0)),  # soft-capping
        ("gpt_oss", dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=32)),  # sinks per head
    ],
)
def test_a_bf16_llm_takes_the_kernel_within_bf16_tolerance_of_hf(tmp_path, model_dir, family, overrides):
    """Whole prompts, later chunks (48 tokens a step) and prompts behind shared pages through the kernel: their
    prompt logprobs no farther from HF's fp32 forward than twice HF's own bf16 forward is (a window ignored by
    the kernel lands several times past it)."""
    import random

    from transformers import AutoModelForCausalLM

    from batchrun import LLM

    path = saved_tiny(tmp_path, family, model_dir, **overrides)
    llm = LLM(str(path), dtype="bfloat16", device="cpu", num_pages=64, max_num_batched_tokens=48)
    backend = llm.engine.attention
    assert backend.prompt_groups == (True,) * len(backend.prompt_groups)
    gen = random.Random(0)
    common = [gen.randrange(3, 49152) for _ in range(40)]
    prompts = [common + [gen.randrange(3, 49152) for _ in range(n)] for n in (5, 30, 70)]
    backend.kernel = counting = Counting(backend.kernel)
    got = prompt_logprobs(llm, prompts)
    assert counting.prompt_calls > 0
    # bf16's own error, the scale to hold the kernel's to: HF's bf16 forward against its fp32 one
    hf = {dt: AutoModelForCausalLM.from_pretrained(path, dtype=dt) for dt in (torch.bfloat16, torch.float32)}
    for i, p in enumerate(prompts):
        want = {}
        for dt, model in hf.items():
            with torch.inference_mode():
                logits = model(torch.tensor([p])).logits[0].float()
            want[dt] = logits[:-1].log_softmax(-1).gather(1, torch.tensor(p[1:])[:, None])[:, 0]
        bf16_err = (want[torch.bfloat16] - want[torch.float32]).abs().max().item()
        err = (got[i] - want[torch.float32]).abs().max().item()
        assert err <= 2 * bf16_err, f"prompt {i}: {err:.3f} from fp32's logprobs, HF's bf16 {bf16_err:.3f}"


@needs_bf16
@pytest.mark.parametrize(
    "family,overrides",
    [("llama", {}), ("qwen2", dict(use_sliding_window=True, sliding_window=32, max_window_layers=1))],
)
def test_a_bf16_llm_decodes_within_bf16_tolerance_of_hf(tmp_path, model_dir, family, overrides):
    """Decodes through the bf16 decode kernel (cpu_decode_bf16.cpp, AVX512-BF16 dot products), contexts past
    the window: the generated tokens' logprobs no farther from HF's fp32 forward over the same tokens than twice
    HF's own bf16 forward is."""
    import random

    from transformers import AutoModelForCausalLM

    from batchrun import LLM, SamplingParams

    path = saved_tiny(tmp_path, family, model_dir, **overrides)
    llm = LLM(str(path), dtype="bfloat16", device="cpu", num_pages=64)
    backend = llm.engine.attention
    backend.kernel = counting = Counting(backend.kernel)
    gen = random.Random(1)
    prompts = [[gen.randrange(3, 49152) for _ in range(n)] for n in (5, 30, 70)]
    outs = llm.generate(prompts, SamplingParams(max_new_tokens=40, logprobs=0), use_tqdm=False)
    assert counting.decode_calls > 0
    hf = {dt: AutoModelForCausalLM.from_pretrained(path, dtype=dt) for dt in (torch.bfloat16, torch.float32)}
    for i, (p, o) in enumerate(zip(prompts, outs)):
        tokens = o.outputs[0].token_ids
        assert len(tokens) > 30, "the case decodes past the window"
        got = torch.tensor([e["logprob"] for e in o.outputs[0].logprobs])
        want = {}
        for dt, model in hf.items():
            with torch.inference_mode():
                logits = model(torch.tensor([p + tokens])).logits[0, len(p) - 1 : -1].float()
            want[dt] = logits.log_softmax(-1).gather(1, torch.tensor(tokens)[:, None])[:, 0]
        bf16_err = (want[torch.bfloat16] - want[torch.float32]).abs().max().item()
        err = (got - want[torch.float32]).abs().max().item()
        assert err <= 2 * bf16_err, f"prompt {i}: {err:.3f} from fp32's logprobs, HF's bf16 {bf16_err:.3f}"


def test_fp32_and_head_dims_the_kernel_does_not_take_stay_on_sdpa(tmp_path, model_dir):
    """Decided once, when the backend is made: fp32 (its tokens equal HF generate's) and head dims of 16 never
    take the kernel."""
    from batchrun import LLM

    llama = saved_tiny(tmp_path, "llama", model_dir)
    assert LLM(str(llama), dtype="float32", device="cpu", num_pages=16).engine.attention.prompt_groups == (
        False,
    )
    narrow = saved_tiny(tmp_path / "narrow", "llama", model_dir, hidden_size=48, head_dim=16)
    assert LLM(str(narrow), dtype="bfloat16", device="cpu", num_pages=16).engine.attention.prompt_groups == (
        False,
    )
