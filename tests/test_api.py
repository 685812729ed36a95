"""The Python API (`LLM`, `SamplingParams`, `run_job`) against Hugging Face `generate` and the job runner."""

import pyarrow.parquet as pq
import pytest
from helpers import ROOT, hf_greedy, read_outputs, write_prompts

from batchrun import LLM, BadInput, SamplingParams, run_job

CONVERSATIONS = [
    [{"role": "user", "content": f"Write one sentence about {topic}."}]
    for topic in ["the sea", "bread", "owls", "glass", "trains", "coffee"]
] + [
    [
        {"role": "system", "content": "You answer in French."},
        {"role": "user", "content": "What is a cat?"},
    ],
    [
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "Blue."},
        {"role": "user", "content": "Name another one."},
    ],
    [{"role": "user", "content": "Count to five. " * 20}],
    [{"role": "user", "content": "Hi"}],
    [
        {"role": "user", "content": "What is 2 + 2?"},
        {"role": "assistant", "content": "4."},
        {"role": "user", "content": "And 3 + 3?"},
    ],
    [{"role": "user", "content": "Describe a map of a city in detail, street by street."}],
]


@pytest.fixture(scope="module")
def llm():
    return LLM(device="cpu", dtype="float32", num_pages=512, max_num_seqs=32, swap_space="64MiB")


def test_chat_equals_hf_generate_token_for_token(llm, model_dir):
    assert len(CONVERSATIONS) == 12
    outs = llm.chat(CONVERSATIONS, SamplingParams(max_new_tokens=24), use_tqdm=False)
    tok = llm.tokenizer
    want_prompts = [
        tok(tok.apply_chat_template(c, add_generation_prompt=True, tokenize=False), add_special_tokens=False)[
            "input_ids"
        ]
        for c in CONVERSATIONS
    ]
    expected = hf_greedy(model_dir, want_prompts, 24)
    assert [o.request_id for o in outs] == list(range(12)), "outputs come back in input order"
    for i, (out, want_prompt, want) in enumerate(zip(outs, want_prompts, expected)):
        assert out.prompt == CONVERSATIONS[i]
        assert out.prompt_token_ids == want_prompt
        assert len(out.outputs) == 1
        assert out.outputs[0].token_ids == want, f"conversation {i} differs"
        assert out.outputs[0].text == tok.decode(want, skip_special_tokens=True)
        assert out.outputs[0].finish_reason in ("eos", "length")
        assert out.outputs[0].logprobs is None
    assert not llm.engine.has_unfinished() and llm.engine.num_used_pages == 0


def test_generate_is_raw_text_without_chat_template(llm, model_dir):
    prompts = ["Once upon a time", "The capital of France is", "def fibonacci(n):"]
    outs = llm.generate(prompts, SamplingParams(max_new_tokens=16), use_tqdm=False)
    ids = [llm.tokenizer(p)["input_ids"] for p in prompts]
    expected = hf_greedy(model_dir, ids, 16)
    for p, out, want_ids, want in zip(prompts, outs, ids, expected):
        assert out.prompt == p and out.prompt_token_ids == want_ids
        assert out.outputs[0].token_ids == want
    # token ids are taken as they are
    again = llm.generate([ids[0]], SamplingParams(max_new_tokens=16), use_tqdm=False)
    assert again[0].outputs[0].token_ids == expected[0]


def test_n_samples_and_per_prompt_params(llm, model_dir):
    conv = CONVERSATIONS[:2]
    greedy = llm.chat(conv, SamplingParams(max_new_tokens=12, n=2), use_tqdm=False)
    for out in greedy:
        assert [c.index for c in out.outputs] == [0, 1]
        assert out.outputs[0].token_ids == out.outputs[1].token_ids  # greedy samples agree
    sampled = llm.chat(conv, SamplingParams(max_new_tokens=12, n=2, temperature=1.0, seed=3), use_tqdm=False)
    assert any(o.outputs[0].token_ids != o.outputs[1].token_ids for o in sampled)
    # the same call again draws the same samples: each sample's generator is seeded from (seed, prompt, sample)
    again = llm.chat(conv, SamplingParams(max_new_tokens=12, n=2, temperature=1.0, seed=3), use_tqdm=False)
    assert [[c.token_ids for c in o.outputs] for o in again] == [
        [c.token_ids for c in o.outputs] for o in sampled
    ]
    per_prompt = [
        SamplingParams(max_new_tokens=3, ignore_eos=True),
        SamplingParams(max_new_tokens=7, ignore_eos=True),
    ]
    outs = llm.chat(conv, per_prompt, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [3, 7]
    assert all(o.outputs[0].finish_reason == "length" for o in outs)


def test_sampling_params_check_types_as_the_job_file_does(llm):
    """issue 24, item 9: these were a TypeError, an accepted 1.5, and a KeyError: 0."""
    with pytest.raises(ValueError, match="SamplingParams.temperature must be a number"):
        SamplingParams(temperature="hot")
    with pytest.raises(ValueError, match="SamplingParams.max_new_tokens must be an integer"):
        SamplingParams(max_new_tokens=1.5)
    with pytest.raises(ValueError, match=r"SamplingParams.stop\[1\] must be a string"):
        SamplingParams(stop=["a", 2])
    assert SamplingParams(stop=None).stop == () and SamplingParams(stop="x").stop == ("x",)
    assert isinstance(SamplingParams(temperature=1).temperature, float)
    with pytest.raises(ValueError, match="conversations: one turn"):
        llm.chat({"role": "user", "content": "Hi"}, use_tqdm=False)


def test_api_mistakes_are_clear(llm):
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(BadInput, match="max_num_seqs"):
        LLM(device="cpu", max_num_seqs=0)
    with pytest.raises(BadInput, match="unexpected keyword"):
        LLM(device="cpu", num_pagez=3)
    # a prompt that can never run is that prompt's error; its batch-mates finish
    outs = llm.generate(["hi", "word " * 9000, "yo"], SamplingParams(max_new_tokens=4), use_tqdm=False)
    assert outs[1].error and "prompt 1: " in outs[1].error and "max_model_len" in outs[1].error
    assert [c.finish_reason for c in outs[1].outputs] == ["error"] and outs[1].outputs[0].token_ids == []
    assert outs[0].error is None and outs[2].error is None
    assert all(len(o.outputs[0].token_ids) == 4 for o in (outs[0], outs[2]))
    with pytest.raises(ValueError, match="one per prompt"):
        llm.generate(["a", "b"], [SamplingParams()], use_tqdm=False)
    assert not llm.engine.has_unfinished(), "a refused batch leaves nothing queued"


def test_run_job_and_api_agree(llm, tmp_path):
    prompts = [f"Tell me about {t}." for t in ["rain", "jazz", "chess"]]
    data = write_prompts(tmp_path / "p.parquet", prompts, ids=[0, 1, 2])
    job = {
        "name": "api",
        "input": {"parquet": str(data), "id_column": "id"},
        "sampling": {"max_new_tokens": 10},
        "engine": {"device": "cpu", "num_pages": 256},
        "model": {"dtype": "float32"},
        "output": {"path": str(tmp_path / "out"), "stats": str(tmp_path / "stats.parquet")},
    }
    summary = run_job(job, overrides={"sampling.temperature": 0.8, "sampling.n": 2}, progress=False)
    assert summary["rows"] == 3 and summary["generated_tokens"] > 0
    rows = read_outputs(tmp_path / "out")
    assert len(rows) == 6
    # the job's row with id k is the API's prompt k: the same seeded draws
    msgs = [[{"role": "user", "content": p}] for p in prompts]
    outs = llm.chat(msgs, SamplingParams(max_new_tokens=10, temperature=0.8, n=2), use_tqdm=False)
    for k, out in enumerate(outs):
        for c in out.outputs:
            assert rows[(k, c.index)]["completion"] == c.text
    assert run_job(job, overrides={"sampling.temperature": 0.8, "sampling.n": 2}, progress=False) is None
    with pytest.raises(BadInput, match="sampling.top_p"):
        run_job(job, overrides={"sampling.top_p": 2})
    with pytest.raises(BadInput, match="unknown key"):
        run_job(ROOT / "jobs" / "demo.yaml", overrides=["engine.nope=1"])
    assert pq.read_table(tmp_path / "out").num_rows == 6


def test_generate_takes_vllms_prompt_dicts_and_refuses_other_shapes(llm, model_dir):
    """Issue 43, item 1: vLLM's TextPrompt and TokensPrompt failed deep in the engine (a TypeError: the dict's
    keys taken as token ids)."""
    ids = llm.encode("Once upon a time")
    prompts = [{"prompt": "Once upon a time"}, {"prompt_token_ids": ids}, "Once upon a time", ids]
    outs = llm.generate(prompts, SamplingParams(max_new_tokens=8), use_tqdm=False)
    expected = hf_greedy(model_dir, [ids], 8)[0]
    assert [o.outputs[0].token_ids for o in outs] == [expected] * 4
    assert [o.prompt_token_ids for o in outs] == [ids] * 4
    assert [o.prompt for o in outs] == ["Once upon a time", ids, "Once upon a time", ids]
    assert (
        llm.generate({"prompt": "Once upon a time"}, SamplingParams(max_new_tokens=8), use_tqdm=False)[0]
        .outputs[0]
        .token_ids
        == expected
    )
    for bad, words in [
        ({"prompt_ids": ids}, "a dict with keys 'prompt_ids'"),
        ({"prompt": ids}, "a dict with keys 'prompt'"),
        (7, "of type int"),
        ([1, "a"], "of type list"),
    ]:
        with pytest.raises(ValueError, match=r"prompts\[1\]: ") as e:
            llm.generate(["hi", bad], use_tqdm=False)
        assert words in str(e.value) and '{"prompt_token_ids": [token ids]}' in str(e.value)
    with pytest.raises(ValueError, match="this model takes no images"):
        llm.generate([{"prompt": "hi", "multi_modal_data": {"image": "x.png"}}], use_tqdm=False)
    assert not llm.engine.has_unfinished()


def test_sampling_params_take_vllms_max_tokens(llm):
    """Issue 43, item 2: SamplingParams(max_tokens=4) was a TypeError."""
    assert SamplingParams(max_tokens=4) == SamplingParams(max_new_tokens=4)
    assert SamplingParams(max_tokens=4, max_new_tokens=4).max_new_tokens == 4
    assert SamplingParams().max_new_tokens == 256
    with pytest.raises(ValueError, match="max_tokens: 4 and max_new_tokens 5 are both given"):
        SamplingParams(max_tokens=4, max_new_tokens=5)
    with pytest.raises(ValueError, match="max_tokens: must be a number >= 0, got -1"):
        SamplingParams(max_tokens=-1)
    with pytest.raises(ValueError, match="max_tokens: must be an integer, got 1.5"):
        SamplingParams(max_tokens=1.5)
    outs = llm.generate(["hi"], SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert len(outs[0].outputs[0].token_ids) == 3 and outs[0].outputs[0].finish_reason == "length"


def test_a_token_id_outside_the_vocabulary_is_that_prompts_error(llm, model_dir):
    """Issue 43, item 3: an id >= vocab_size (or negative) raised a raw IndexError from the embedding and the
    valid prompts of the call got nothing."""
    from safetensors import safe_open

    with safe_open(str(model_dir / "model.safetensors"), "pt") as f:  # the embedding's rows: the bound
        vocab = f.get_slice("model.embed_tokens.weight").get_shape()[0]
    outs = llm.generate(
        [[5, 6, 7], [10**7], [5, -1], [5, vocab]], SamplingParams(max_tokens=6), use_tqdm=False
    )
    assert outs[0].error is None
    assert outs[0].outputs[0].token_ids == hf_greedy(model_dir, [[5, 6, 7]], 6)[0]
    for i, bad, position in [(1, 10**7, 0), (2, -1, 1), (3, vocab, 1)]:
        assert outs[i].error == (
            f"prompt {i}: token id {bad} (position {position}) is outside the vocabulary: this model's input "
            f"embedding has {vocab} rows (token ids 0 .. {vocab - 1})"
        )
        assert [(c.finish_reason, c.token_ids) for c in outs[i].outputs] == [("error", [])]
    empty = llm.generate([[], {"prompt_token_ids": []}], use_tqdm=False)  # no ids: each prompt's error
    assert [o.error for o in empty] == [
        "prompt 0: the prompt has no tokens",
        "prompt 1: the prompt has no tokens",
    ]
    assert not llm.engine.has_unfinished() and llm.engine.num_used_pages == 0
