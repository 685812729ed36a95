"""The paged engine against Hugging Face `generate`, and seeded sampling independent of batch-mates."""

from helpers import hf_greedy, make_engine, run_engine

from batchrun.engine import SamplingParams


def test_prompt_lengths_cover_the_required_range(chat_prompts):
    lengths = [len(p) for p in chat_prompts]
    assert len(lengths) >= 16 and min(lengths) <= 40 and max(lengths) >= 350, lengths


def test_greedy_equals_hf_generate_token_for_token(tok_model, model_dir, chat_prompts):
    # a small token budget forces chunked prefill of the long prompts next to decodes in the same steps
    engine = make_engine(tok_model, max_num_batched_tokens=512, num_pages=256)
    seqs, steps = run_engine(engine, chat_prompts, SamplingParams(max_new_tokens=32))
    expected = hf_greedy(model_dir, chat_prompts, 32)
    for i, (got, want) in enumerate(zip(seqs, expected)):
        assert got[0].output_token_ids == want, f"prompt {i} ({len(chat_prompts[i])} tokens) differs"
    assert any(s.plan.num_batched_tokens == 512 for s in steps), "chunked prefill was not exercised"
    mixed = [s for s in steps if {x.num_new_tokens == 1 for x in s.plan.scheduled} == {True, False}]
    assert mixed, "no step mixed prefill and decode"
    engine.check_integrity()
    assert engine.num_used_pages == 0


def test_seeded_sample_is_the_same_alone_and_in_a_batch(tok_model, chat_prompts):
    params = SamplingParams(max_new_tokens=16, temperature=0.9, top_p=0.95, top_k=50)
    target = chat_prompts[3]
    alone, _ = run_engine(make_engine(tok_model), [target], params, seeds=[[1234]])
    batch = chat_prompts[:16] * 2  # 32 rows, the target among them
    seeds = [[1234] if i == 3 else [i] for i in range(32)]
    together, _ = run_engine(make_engine(tok_model), batch, params, seeds=seeds)
    assert alone[0][0].output_token_ids == together[3][0].output_token_ids
    # and the draw really is random: other seeds give other completions for the same prompt
    assert together[19][0].output_token_ids != together[3][0].output_token_ids


def test_no_step_uses_more_pages_than_exist(tok_model, chat_prompts):
    engine = make_engine(tok_model, num_pages=48, max_num_batched_tokens=1024)

    def check(eng, result):
        snap = eng.memory_snapshot()
        assert 0 <= eng.num_used_pages == snap.pages_used <= eng.num_pages
        assert snap.logical_pages >= snap.pages_used

    run_engine(engine, chat_prompts[:10], SamplingParams(max_new_tokens=20), on_step=check)


def test_a_character_cut_by_the_length_limit_is_dropped(tok_model):
    """issue 24, item 7: a completion cut at max_new_tokens in the middle of a multi-byte character ended in
    U+FFFD; the text drops the incomplete character, the token ids keep its bytes."""
    from batchrun.engine import Sequence

    tok, _ = tok_model
    engine = make_engine(tok_model, num_pages=16)
    ids = tok.encode("日本語", add_special_tokens=False)
    assert tok.decode(ids[:-1]).endswith("\ufffd"), "the case needs a character split over tokens"
    seq = Sequence(0, [1], SamplingParams(max_new_tokens=len(ids) - 1))
    seq.output_token_ids = ids[:-1]
    seq.finish_reason = "length"
    assert engine.completion_text(seq) == "日本"
    seq.output_token_ids = ids
    assert engine.completion_text(seq) == "日本語"


def test_the_engine_constructors_take_at_most_four_arguments():
    """A load-time fact is a field of the value it belongs to (loading.LoadedModel, the model plan, the services
    the runner reaches), not one more parameter threaded through every constructor (issue 51)."""
    import inspect

    from batchrun.engine.core.scheduler import Scheduler
    from batchrun.engine.engine import Engine
    from batchrun.engine.worker.model_runner import ModelRunner

    for cls in (Engine, ModelRunner, Scheduler):
        params = [p for p in inspect.signature(cls.__init__).parameters if p != "self"]
        assert len(params) <= 4, f"{cls.__name__}{params}"
