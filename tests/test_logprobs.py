"""Logprobs and prompt logprobs against the log-softmax of Hugging Face's raw logits (fp32, stock attention)."""

import pytest
import torch

from batchrun import LLM, SamplingParams

SYSTEM = "You are a patient librarian who explains things in plain words. " * 6


@pytest.fixture(scope="module")
def hf_model(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def hf_logprobs(hf_model, token_ids: list[int]) -> torch.Tensor:
    """[len - 1, V]: row p is log p(. | tokens[: p + 1])."""
    with torch.inference_mode():
        logits = hf_model(torch.tensor([token_ids])).logits[0].float()
    return logits.log_softmax(-1)[:-1]


def check_against_hf(hf_model, out, k: int | None, with_prompt: bool) -> None:
    """k: the top-k asked for (None: no logprobs asked)."""
    prompt = out.prompt_token_ids
    for c in out.outputs:
        if k is None:
            assert c.logprobs is None
            continue
        ref = hf_logprobs(hf_model, prompt + c.token_ids)
        assert len(c.logprobs) == len(c.token_ids)
        for i, (token, entry) in enumerate(zip(c.token_ids, c.logprobs)):
            row = ref[len(prompt) - 1 + i]
            assert entry["token_id"] == token
            assert abs(entry["logprob"] - row[token].item()) < 1e-3
            want_lp, want_ids = row.topk(k)
            assert [t["token_id"] for t in entry["top"]] == want_ids.tolist()
            got = torch.tensor([t["logprob"] for t in entry["top"]])
            assert torch.allclose(got, want_lp, atol=1e-3)
    if with_prompt:
        ref = hf_logprobs(hf_model, prompt)
        want = ref.gather(1, torch.tensor(prompt[1:])[:, None])[:, 0]
        got = out.prompt_logprobs
        assert got[0] is None and len(got) == len(prompt)
        assert torch.allclose(torch.tensor(got[1:]), want, atol=1e-3)
    else:
        assert out.prompt_logprobs is None


def conversations():
    topics = ["tides", "ink", "maps", "owls"]
    plain = [[{"role": "user", "content": f"Say something about {t}."}] for t in topics]
    shared = [
        [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"Why {t}?"}] for t in topics
    ]
    return plain + shared


@pytest.mark.parametrize("chunk", [4096, 48])  # 48: prompts are scored across several prefill chunks
def test_logprobs_and_prompt_logprobs_equal_hf(hf_model, chunk):
    llm = LLM(device="cpu", dtype="float32", num_pages=512, max_num_batched_tokens=chunk, swap_space="64MiB")
    convs = conversations()
    # rows without prompt logprobs first: they put the shared system prompt in the prefix cache, which the
    # scoring rows must not use
    params = [SamplingParams(max_new_tokens=6, logprobs=3)] * 4 + [
        SamplingParams(max_new_tokens=6, logprobs=3, prompt_logprobs=True)
    ] * 4
    shared_first = llm.chat(convs[4:5], SamplingParams(max_new_tokens=2), use_tqdm=False)
    assert shared_first[0].outputs[0].logprobs is None
    outs = llm.chat(convs, params, use_tqdm=False)
    for i, out in enumerate(outs):
        check_against_hf(hf_model, out, 3, with_prompt=i >= 4)


def test_scoring_job_with_zero_new_tokens_and_n(hf_model):
    llm = LLM(device="cpu", dtype="float32", num_pages=512, swap_space="64MiB")
    texts = ["The cat sat on the mat.", "Colourless green ideas sleep furiously."]
    outs = llm.generate(texts, SamplingParams(max_new_tokens=0, prompt_logprobs=True), use_tqdm=False)
    for out in outs:
        assert out.outputs[0].token_ids == [] and out.outputs[0].finish_reason == "length"
        check_against_hf(hf_model, out, None, with_prompt=True)
    with pytest.raises(ValueError, match="scoring"):
        SamplingParams(max_new_tokens=0)
    # n samples each carry their own logprobs; top-0 still gives the chosen token's logprob
    outs = llm.generate(
        texts[:1], SamplingParams(max_new_tokens=5, n=2, temperature=1.0, logprobs=0), use_tqdm=False
    )
    assert len(outs[0].outputs) == 2 and all(e["top"] == [] for c in outs[0].outputs for e in c.logprobs)
    check_against_hf(hf_model, outs[0], 0, with_prompt=False)


def test_prompt_logprobs_survive_recompute_preemption(hf_model):
    llm = LLM(device="cpu", dtype="float32", num_pages=12, preemption="recompute", max_num_batched_tokens=64)
    convs = [
        [{"role": "user", "content": f"Write a long story about {t}."}] for t in ["a fox", "a boat", "rain"]
    ]
    params = SamplingParams(max_new_tokens=60, ignore_eos=True, logprobs=2, prompt_logprobs=True)
    outs = llm.chat(convs, params, use_tqdm=False)
    assert sum(o.outputs[0].num_preemptions for o in outs) > 0, "12 pages should force recomputation"
    for out in outs:
        check_against_hf(hf_model, out, 2, with_prompt=True)
