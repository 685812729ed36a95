"""Real batch data in and out: conversations, per-row sampling, logprobs and token ids in Parquet, OpenAI batch
files in and out, and an output directory that holds completions only."""

import json
import signal
import subprocess
import time

import pyarrow as pa
import pyarrow.parquet as pq
import torch
from helpers import BATCHRUN, chat_ids, hf_greedy, read_outputs, run_cli, write_job

SYSTEM = "You are a terse assistant for a bakery. " * 5

CONVERSATIONS = [
    [{"role": "user", "content": "Name a bread."}],
    [
        {"role": "user", "content": "Name a bread."},
        {"role": "assistant", "content": "Rye."},
        {"role": "user", "content": "And a cake?"},
    ],
    [{"role": "system", "content": "Answer in one word."}, {"role": "user", "content": "Best pastry?"}],
    [
        {"role": "user", "content": "What is flour made of?"},
        {"role": "assistant", "content": "Grain."},
        {"role": "user", "content": "Which grain?"},
    ],
]


def job_text(
    d, data, output="", model="", inp="", sampling="  max_new_tokens: 12\n", prompt_column="messages"
):
    return f"""
name: fmt
model:
  dtype: float32
{model}input:
  parquet: {data}
  id_column: id
  prompt_column: {prompt_column}
{inp}sampling:
{sampling}engine:
  num_pages: 256
output:
  path: {d / "out"}
{output}"""


def write_table(path, columns: dict):
    pq.write_table(pa.table(columns), path)
    return path


def test_conversations_column_equals_hf_generate(tmp_path, tok_model, model_dir):
    tok, _ = tok_model
    bad = [
        [{"role": "bot", "content": "hi"}],
        [{"role": "user"}],
        [{"role": "assistant", "content": "hello"}],
        [],
    ]
    data = write_table(tmp_path / "in.parquet", {"id": list(range(8)), "messages": CONVERSATIONS + bad})
    job = write_job(tmp_path / "job.yaml", job_text(tmp_path, data, model=f"  system_prompt: {SYSTEM!r}\n"))
    r = run_cli("submit", str(job), "--quiet")
    assert r.returncode == 0, r.stderr
    rows = read_outputs(tmp_path / "out")
    prompts = []
    for conv in CONVERSATIONS:  # model.system_prompt goes first only where the conversation has none
        msgs = conv if conv[0]["role"] == "system" else [{"role": "system", "content": SYSTEM}, *conv]
        text = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
        prompts.append(tok(text, add_special_tokens=False)["input_ids"])
    expected = hf_greedy(model_dir, prompts, 12)
    for i, want in enumerate(expected):
        row = rows[(i, 0)]
        assert row["completion"] == tok.decode(want, skip_special_tokens=True), i
        assert row["prompt_tokens"] == len(prompts[i]) and row["completion_tokens"] == len(want)
    reasons = [rows[(i, 0)]["error"] for i in range(4, 8)]
    assert all(rows[(i, 0)]["finish_reason"] == "error" for i in range(4, 8))
    assert "unknown role 'bot'" in reasons[0]
    assert "turn 1 (user) has no content" in reasons[1]
    assert "nothing to answer" in reasons[2] and "nothing to answer" in reasons[3]


def test_openai_content_parts_in_a_parquet_conversation(tmp_path, tok_model):
    """Conversations whose content is a list of OpenAI content parts (as Parquet stores them: every part has
    every field, `image_url` null beside a text part): text parts are the text, joined by newlines, and the row
    equals the same conversation written as strings; an image part is that row's error naming turn and part
    (every such row was "has no content (a string)")."""
    text = lambda t: {"type": "text", "text": t, "image_url": None}  # noqa: E731
    image = {"type": "image_url", "text": None, "image_url": {"url": "data:image/png;base64,AAAA"}}
    parts = [
        [{"role": "user", "content": [text("Name a colour."), text("One word.")]}],
        [{"role": "user", "content": [text("Describe this."), image]}],
    ]
    plain = [[{"role": "user", "content": "Name a colour.\nOne word."}]]
    for name, convs in (("parts", parts), ("plain", plain)):
        data = write_table(tmp_path / f"{name}.parquet", {"id": list(range(len(convs))), "messages": convs})
        job = job_text(tmp_path, data).replace(str(tmp_path / "out"), str(tmp_path / f"out-{name}"))
        r = run_cli("submit", str(write_job(tmp_path / f"{name}.yaml", job)), "--quiet")
        assert r.returncode == 0, r.stderr
    got, want = read_outputs(tmp_path / "out-parts"), read_outputs(tmp_path / "out-plain")
    assert got[(0, 0)]["completion"] == want[(0, 0)]["completion"] and got[(0, 0)]["error"] is None
    assert (
        got[(1, 0)]["finish_reason"] == "error"
        and "turn 1 (user), content part 2: an image" in got[(1, 0)]["error"]
    )


def test_per_row_sampling_columns(tmp_path):
    n = 5
    data = write_table(
        tmp_path / "in.parquet",
        {
            "id": [f"r{i}" for i in range(n)],
            "messages": [
                [{"role": "user", "content": f"Tell a long story about {i} cats."}] for i in range(n)
            ],
            "limit": pa.array([3, 7, None, 2, 5], pa.int64()),
            "temp": pa.array([0.0, 0.0, 0.0, 0.0, -1.0]),
            "samples": pa.array([1, 2, None, 1, 1], pa.int64()),
        },
    )
    text = job_text(
        tmp_path,
        data,
        inp="  sampling_columns: {max_new_tokens: limit, temperature: temp, n: samples}\n",
        sampling="  max_new_tokens: 4\n  ignore_eos: true\n",
    )
    r = run_cli("submit", str(write_job(tmp_path / "job.yaml", text)), "--quiet")
    assert r.returncode == 0, r.stderr
    rows = read_outputs(tmp_path / "out")
    assert sorted(rows) == [("r0", 0), ("r1", 0), ("r1", 1), ("r2", 0), ("r3", 0), ("r4", 0)]
    assert [rows[(f"r{i}", 0)]["completion_tokens"] for i in range(4)] == [3, 7, 4, 2]  # null: the job's 4
    assert rows[("r1", 1)]["completion"] == rows[("r1", 0)]["completion"]  # greedy samples agree
    bad = rows[("r4", 0)]
    assert bad["finish_reason"] == "error" and "'temp'" in bad["error"] and ">= 0" in bad["error"]


def hf_logprobs(model_dir, ids):
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        return ref(torch.tensor([ids])).logits[0].float().log_softmax(-1)


def test_logprobs_prompt_logprobs_and_token_ids_columns(tmp_path, tok_model, model_dir):
    tok, _ = tok_model
    data = write_table(
        tmp_path / "in.parquet",
        {"id": [0, 1, 2], "messages": [[{"role": "user", "content": f"Why is {w} good?"}] for w in "abc"]},
    )
    text = job_text(
        tmp_path,
        data,
        output="  token_ids: true\n",
        model=f"  system_prompt: {SYSTEM!r}\n",
        sampling="  max_new_tokens: 6\n  logprobs: 3\n  prompt_logprobs: true\n",
    )
    r = run_cli("submit", str(write_job(tmp_path / "job.yaml", text)), "--quiet")
    assert r.returncode == 0, r.stderr
    table = pq.read_table(tmp_path / "out")
    assert table.schema.field("logprobs").type.value_type.field("top").type.value_type.names == [
        "token_id",
        "token",
        "logprob",
    ]
    for row in table.to_pylist():
        prompt, completion = row["prompt_token_ids"], row["completion_token_ids"]
        assert prompt == chat_ids(tok, f"Why is {'abc'[row['id']]} good?", SYSTEM)
        ref = hf_logprobs(model_dir, prompt + completion)
        # the shared system prompt is in the prefix cache: the rows still score their whole prompt
        want = ref[:-1].gather(1, torch.tensor(prompt[1:] + completion)[:, None])[:, 0]
        assert row["prompt_logprobs"][0] is None
        assert torch.allclose(torch.tensor(row["prompt_logprobs"][1:]), want[: len(prompt) - 1], atol=1e-3)
        for i, entry in enumerate(row["logprobs"]):
            assert entry["token_id"] == completion[i]
            assert abs(entry["logprob"] - want[len(prompt) - 1 + i].item()) < 1e-3
            assert [t["token_id"] for t in entry["top"]] == ref[len(prompt) - 1 + i].topk(3).indices.tolist()
            assert entry["token"] == tok.decode([completion[i]])


def openai_lines():
    chat = lambda cid, content, **body: {  # noqa: E731
        "custom_id": cid,
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {"model": "smol", "messages": [{"role": "user", "content": content}], **body},
    }
    lines = [
        json.dumps(chat("c-plain", "Name a fruit.", max_tokens=8)),
        json.dumps(chat("c-n2", "Name a colour.", max_tokens=6, n=2, temperature=0.9, seed=5)),
        json.dumps(
            chat("c-logprobs", "Name a tree.", max_completion_tokens=5, logprobs=True, top_logprobs=2)
        ),
        json.dumps(
            chat(
                "c-stop",
                "Count from one to ten in words, separated by commas.",
                max_tokens=30,
                stop=["5", ","],
            )
        ),
        "{this is not json",
        json.dumps({"custom_id": "c-nomsg", "method": "POST", "url": "/v1/chat/completions", "body": {}}),
        json.dumps(
            {
                "custom_id": "t-text",
                "method": "POST",
                "url": "/v1/completions",
                "body": {"model": "smol", "prompt": "Once upon a time", "max_tokens": 7, "logprobs": 2},
            }
        ),
        "",
        json.dumps(chat("c-penalty", "Hi", frequency_penalty=1.0)),
    ]
    for i in range(7):
        lines.append(json.dumps(chat(f"bulk-{i}", f"Say the number {i}.", max_tokens=10)))
    lines.append(
        json.dumps(
            chat(
                "c-json",
                "Give a fruit and its colour as JSON.",
                max_tokens=40,
                response_format={"type": "json_object"},
            )
        )
    )
    return lines


def openai_job(d, out):
    (d / "batch.jsonl").write_text("\n".join(openai_lines()) + "\n")
    return write_job(
        d / "job.yaml",
        f"""
name: oai
model:
  dtype: float32
  name: smol  # what the requests' body.model names the base model
input:
  openai_batch: {d / "batch.jsonl"}
engine:
  num_pages: 256
  max_num_seqs: 2
output:
  path: {out}
  rows_per_part: 1
  flush_seconds: 0
""",
    )


def read_lines(out):
    lines = [json.loads(t) for p in sorted(out.glob("part-*.jsonl")) for t in p.read_text().splitlines()]
    ids = [(line["custom_id"], line["id"]) for line in lines]
    assert len(set(ids)) == len(ids), "a request written twice"
    return {line["custom_id"] or line["id"]: line for line in lines}


def test_openai_batch_file_both_endpoints(tmp_path, tok_model):
    tok, _ = tok_model
    job = openai_job(tmp_path, tmp_path / "out")
    r = run_cli("submit", str(job), "--quiet")
    assert r.returncode == 0, r.stderr
    lines = read_lines(tmp_path / "out")
    assert len(lines) == 16
    plain = lines["c-plain"]["response"]
    assert plain["status_code"] == 200 and lines["c-plain"]["error"] is None
    body = plain["body"]
    assert body["object"] == "chat.completion" and body["model"] == "smol"
    assert body["choices"][0]["message"]["role"] == "assistant"
    assert body["choices"][0]["finish_reason"] in ("stop", "length")
    usage = body["usage"]
    assert usage["prompt_tokens"] == len(chat_ids(tok, "Name a fruit."))
    assert (
        usage["total_tokens"]
        == usage["prompt_tokens"] + usage["completion_tokens"]
        <= usage["prompt_tokens"] + 8
    )
    n2 = lines["c-n2"]["response"]["body"]["choices"]
    assert [c["index"] for c in n2] == [0, 1]
    lp = lines["c-logprobs"]["response"]["body"]["choices"][0]["logprobs"]["content"]
    assert 1 <= len(lp) <= 5 and all(len(e["top_logprobs"]) == 2 and e["logprob"] <= 0 for e in lp)
    assert all(e["bytes"] == list(e["token"].encode()) for e in lp)
    stop = lines["c-stop"]["response"]["body"]["choices"][0]
    assert stop["finish_reason"] == "stop" and not {"5", ","} & set(stop["message"]["content"])
    text = lines["t-text"]["response"]["body"]
    assert text["object"] == "text_completion" and isinstance(text["choices"][0]["text"], str)
    tl = text["choices"][0]["logprobs"]
    assert len(tl["tokens"]) == len(tl["token_logprobs"]) == len(tl["top_logprobs"]) == len(tl["text_offset"])
    assert usage_of(lines["t-text"])["prompt_tokens"] == len(tok("Once upon a time")["input_ids"])
    broken = [v for k, v in lines.items() if v["custom_id"] is None]
    assert len(broken) == 1 and broken[0]["response"] is None and "not JSON" in broken[0]["error"]["message"]
    assert "line 5" in broken[0]["error"]["message"]
    assert "messages" in lines["c-nomsg"]["error"]["message"] and lines["c-nomsg"]["response"] is None
    assert "frequency_penalty" in lines["c-penalty"]["error"]["message"]
    structured = lines["c-json"]["response"]["body"]["choices"][0]
    assert structured["finish_reason"] == "stop" and isinstance(
        json.loads(structured["message"]["content"]), dict
    )
    assert not list((tmp_path / "out").glob("*.parquet")), "the output directory holds the JSONL parts only"


def usage_of(line):
    return line["response"]["body"]["usage"]


def test_openai_batch_resumes_after_kill_9(tmp_path):
    out = tmp_path / "out"
    job = openai_job(tmp_path, out)
    proc = subprocess.Popen(
        [BATCHRUN, "submit", str(job), "--quiet"], stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    t0 = time.time()
    while time.time() - t0 < 120 and len(list(out.glob("part-*.jsonl"))) < 6 and proc.poll() is None:
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    before = len(read_lines(out))
    assert 0 < before < 16, before
    r = run_cli("submit", str(job), "--quiet")
    assert r.returncode == 0, r.stderr
    assert len(read_lines(out)) == 16
    r = run_cli("submit", str(job), "--quiet")
    assert r.returncode == 0 and "nothing to do" in r.stdout


def test_output_directory_holds_completions_only(tmp_path):
    data = write_table(
        tmp_path / "in.parquet",
        {"id": list(range(6)), "messages": [[{"role": "user", "content": f"Hi {i}"}] for i in range(6)]},
    )
    job = write_job(tmp_path / "job.yaml", job_text(tmp_path, data))
    assert run_cli("submit", str(job), "--quiet").returncode == 0
    out = tmp_path / "out"
    r = run_cli("stats", str(out), "--plot", str(out / ".batchrun" / "memory.png"))
    assert r.returncode == 0, r.stderr
    assert run_cli("slurm", str(job), "--array", "2").returncode == 0
    assert (out / ".batchrun" / "stats.parquet").is_file() and (
        out / ".batchrun" / "slurm" / "fmt.sbatch"
    ).is_file()
    import datasets
    import pandas as pd
    import pyarrow.dataset as pads

    assert len(pd.read_parquet(out)) == 6
    assert pads.dataset(out).count_rows() == 6
    assert len(datasets.load_dataset("parquet", data_dir=str(out), split="train")) == 6


def test_legacy_statistics_move_out_of_the_output_directory(tmp_path):
    data = write_table(
        tmp_path / "in.parquet", {"id": [0, 1], "messages": [[{"role": "user", "content": "x"}]] * 2}
    )
    job = write_job(tmp_path / "job.yaml", job_text(tmp_path, data))
    out = tmp_path / "out"
    out.mkdir()
    (out / "memory.png").write_bytes(b"png")
    assert run_cli("submit", str(job), "--quiet", "--limit", "1").returncode == 0
    assert not (out / "memory.png").exists() and (out / ".batchrun" / "memory.png").read_bytes() == b"png"
    # an earlier layout's statistics are the job's earlier runs, moved before this run's file is opened
    (out / ".batchrun" / "stats.parquet").rename(out / "stats.parquet")
    assert run_cli("submit", str(job), "--quiet", "--limit", "2").returncode == 0
    summary = json.loads(run_cli("stats", str(out), "--json").stdout)
    assert summary["runs"] == 2 and summary["rows"] == 2, summary


def test_hub_id_offline_says_so(tmp_path):
    data = write_table(tmp_path / "in.parquet", {"id": [0], "messages": [[{"role": "user", "content": "x"}]]})
    job = write_job(tmp_path / "job.yaml", job_text(tmp_path, data, model="  path: nobody/nothing-model\n"))
    r = run_cli("submit", str(job), "--quiet", env={"HF_HUB_OFFLINE": "1"})
    assert r.returncode == 2 and "HF_HUB_OFFLINE=1" in r.stderr and "nobody/nothing-model" in r.stderr, (
        r.stderr
    )


def test_hub_id_is_downloaded_when_online(monkeypatch, tmp_path):
    import huggingface_hub

    from batchrun import model_loader

    calls = []

    def fake_download(repo_id, local_files_only=False, **kw):
        calls.append(local_files_only)
        if local_files_only:
            raise FileNotFoundError("not cached")
        (tmp_path / "config.json").write_text("{}")
        return str(tmp_path)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_download)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    assert model_loader.resolve_model_dir("someone/some-model") == tmp_path
    assert calls == [True, False], "the cache first, then a download"


def test_scoring_job(tmp_path, model_dir, tok_model):
    tok, _ = tok_model
    data = write_table(
        tmp_path / "in.parquet", {"id": [0, 1], "prompt": ["The sky is blue.", "Dogs bark loudly."]}
    )
    text = job_text(
        tmp_path,
        data,
        model="  chat_template: false\n",
        sampling="  max_new_tokens: 0\n  prompt_logprobs: true\n",
        prompt_column="prompt",
    )
    r = run_cli("submit", str(write_job(tmp_path / "job.yaml", text)), "--quiet")
    assert r.returncode == 0, r.stderr
    for row in pq.read_table(tmp_path / "out").to_pylist():
        ids = tok(["The sky is blue.", "Dogs bark loudly."][row["id"]])["input_ids"]
        ref = hf_logprobs(model_dir, ids)[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
        assert row["completion"] == "" and row["completion_tokens"] == 0
        assert torch.allclose(torch.tensor(row["prompt_logprobs"][1:]), ref, atol=1e-3)
    bad = text.replace("  prompt_logprobs: true", "")
    r = run_cli("submit", str(write_job(tmp_path / "bad.yaml", bad)), "--quiet")
    assert r.returncode == 2 and "scoring" in r.stderr, r.stderr


def test_openai_error_lines_name_the_body_field_and_the_file_line(tmp_path):
    """Issue 24, item 10: errors named batchrun's keys (max_new_tokens, logprobs) for the body's max_tokens and
    top_logprobs; they now name the body's field and the file's own 1-based line (blank lines counted)."""

    def req(custom_id, url="/v1/chat/completions", **body):
        body.setdefault("messages", [{"role": "user", "content": "Hi"}])
        return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body})

    lines = [
        req("ok", max_tokens=2),
        "",
        req("a", max_tokens="abc"),
        req("b", logprobs=True, top_logprobs=50),
        req("c", max_completion_tokens=1.5),
        "{not json",
    ]
    (tmp_path / "b.jsonl").write_text("\n".join(lines) + "\n")
    job = write_job(
        tmp_path / "job.yaml",
        f"name: e\ninput: {{openai_batch: {tmp_path / 'b.jsonl'}}}\nengine: {{num_pages: 64}}\n"
        f"output: {{path: {tmp_path / 'out'}}}\n",
    )
    assert run_cli("submit", str(job), "--quiet").returncode == 0
    got = {(x["custom_id"] or "broken"): x["error"] for x in read_lines(tmp_path / "out").values()}
    assert got["ok"] is None
    assert got["a"]["message"].startswith("b.jsonl line 3: key `body.max_tokens` must be an integer"), got
    assert got["b"]["message"].startswith(
        "b.jsonl line 4: key `body.top_logprobs` must be a number in [0, 20]"
    )
    assert got["c"]["message"].startswith("b.jsonl line 5: key `body.max_completion_tokens`"), got
    assert got["broken"]["message"].startswith("b.jsonl line 6: not JSON"), got


def test_a_prompt_column_of_token_ids(tmp_path, tok_model, model_dir):
    """Issue 43, items 2 to 4: a pre-tokenized column (list<int>) was refused ("expected strings, or
    conversations"). Its ids are taken as they are, with no chat template (model.chat_template is on), as
    `LLM.generate` takes them; a row with an id outside the vocabulary is that row's error and the job goes on.
    The job file's `sampling.max_tokens` (vLLM's name) is max_new_tokens."""
    tok, _ = tok_model
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    good = [tok("Once upon a time")["input_ids"], tok("The capital of France is")["input_ids"]]
    ids = pa.array([good[0], [5, vocab], good[1], [-3, 5]], pa.list_(pa.int64()))
    data = write_table(tmp_path / "in.parquet", {"id": list(range(4)), "tokens": ids})
    text = job_text(
        tmp_path, data, prompt_column="tokens", sampling="  max_tokens: 7\n", output="  token_ids: true\n"
    )
    r = run_cli("submit", str(write_job(tmp_path / "job.yaml", text)), "--quiet")
    assert r.returncode == 0, r.stderr
    rows = read_outputs(tmp_path / "out")
    for i, want in zip((0, 2), hf_greedy(model_dir, good, 7)):
        assert (
            rows[(i, 0)]["prompt_token_ids"] == good[i // 2] and rows[(i, 0)]["completion_token_ids"] == want
        )
    for i, bad, position in [(1, vocab, 1), (3, -3, 0)]:
        assert rows[(i, 0)]["finish_reason"] == "error" and rows[(i, 0)]["completion"] is None
        assert rows[(i, 0)]["error"] == (
            f"token id {bad} (position {position}) is outside the vocabulary: this model's input embedding has "
            f"{vocab} rows (token ids 0 .. {vocab - 1})"
        )
    both = job_text(tmp_path, data, prompt_column="tokens", sampling="  max_tokens: 7\n  max_new_tokens: 8\n")
    r = run_cli("validate", str(write_job(tmp_path / "both.yaml", both)))
    assert (
        r.returncode == 2 and "key `sampling.max_tokens`: 7 and max_new_tokens 8 are both given" in r.stderr
    )
