"""LoRA adapters (engine/model/lora/layers.py): rows of several adapters and of the base model in one packed step, each equal
to PEFT's unmerged adapter (`PeftModel.from_pretrained(base, folder)`) running `generate` for that row alone,
greedy fp32 — on a Llama, a Qwen3 and a Gemma 3 (sliding windows) base, on the torch and gather backends, under
preemption, and with identical prompts of different adapters side by side (the prefix cache keys the adapter).
"""

from __future__ import annotations

import copy
import functools
from pathlib import Path

import pytest
import torch
from helpers import paged_model_from_config
from model_families import SUPPORTED, perturb, tiny_config
from test_families import family_engine
from test_ray import cluster as ray_cluster  # noqa: F401 - the Ray test's one-node cluster, as a fixture here

from batchrun.adapters import read_adapters
from batchrun.engine import SamplingParams
from batchrun.engine.model.lora.layers import LoRALinear, attach
from batchrun.errors import BadInput

peft = pytest.importorskip("peft")

NEW_TOKENS = 16
FAMILIES = ["llama", "qwen3", "gemma3_text"]
# two adapters of different ranks, targets and scalings (b: rsLoRA and a per-module alpha); scalings that are powers
# of two are folded into B at load (a's 2), the others multiply the product (b's 3)
ADAPTERS = {
    "a": dict(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]),
    "b": dict(
        r=4,
        lora_alpha=6,  # rsLoRA: 6 / sqrt(4) = 3, multiplied after B; down_proj's 2 / sqrt(4) = 1 rides on B
        use_rslora=True,
        target_modules=["q_proj", "gate_proj", "up_proj", "down_proj"],
        alpha_pattern={"down_proj": 2},
    ),
}
# the rows' adapters: base rows among them, and the same prompt under three adapters (rows 0, 1, 2)
ROW_ADAPTERS = [None, "a", "b", "a", "b", None, "b", "a"]


def prompts(vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(1)
    lens = (40, 40, 40, 11, 33, 50, 75, 4)
    out = [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in lens]
    out[1] = out[2] = out[0]  # one prompt, three adapters: their pages must not be shared
    return out


@functools.cache
def base(family: str):
    """The family's tiny base (random, perturbed weights) as the engine loads it, and the same weights with
    eager attention for PEFT."""
    from transformers import AutoModelForCausalLM

    cfg = tiny_config(family, SUPPORTED[family][1])
    torch.manual_seed(0)
    ours = paged_model_from_config(cfg).eval()
    perturb(ours, seed=len(family))
    cfg = tiny_config(family, SUPPORTED[family][1])  # a config of its own (from_config sets its attention)
    ref = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager", dtype=torch.float32).eval()
    ref.load_state_dict(ours.state_dict())
    ref.generation_config.eos_token_id = None
    ref.generation_config.pad_token_id = 0
    return ours, ref


@functools.cache
def adapter_folders(family: str, root: str) -> dict[str, Path]:
    """Each adapter saved by PEFT from random weights (init_lora_weights=False: B is not zero)."""
    _, ref = base(family)
    folders = {}
    for i, (name, kw) in enumerate(ADAPTERS.items()):
        torch.manual_seed(100 + i)
        model = peft.get_peft_model(copy.deepcopy(ref), peft.LoraConfig(init_lora_weights=False, **kw))
        folders[name] = Path(root) / family / name
        model.save_pretrained(folders[name])
    return folders


@functools.cache
def peft_tokens(family: str, root: str) -> list[list[int]]:
    """Each row as PEFT runs it alone: its adapter loaded unmerged over the base (the base for a base row)."""
    _, ref = base(family)
    folders = adapter_folders(family, root)
    models = {None: ref}
    for name, folder in folders.items():
        models[name] = peft.PeftModel.from_pretrained(copy.deepcopy(ref), folder).eval()
    out = []
    with torch.inference_mode():
        for p, name in zip(prompts(ref.config.vocab_size), ROW_ADAPTERS):
            ids = models[name].generate(
                input_ids=torch.tensor([p]), max_new_tokens=NEW_TOKENS, do_sample=False
            )
            out.append(ids[0, len(p) :].tolist())
    return out


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("adapters"))


def adapted(family: str, root: str, max_loras: int = 4):
    """A copy of the family's base with the two adapters attached, as a job loads them."""
    model = copy.deepcopy(base(family)[0])
    folders = {name: str(f) for name, f in adapter_folders(family, root).items()}
    attach(model, read_adapters(folders, 64, "test"), max_loras, "cpu")
    return model


def run_rows(engine, vocab: int, adapters=ROW_ADAPTERS, on_step=None, rows=None, new_tokens=NEW_TOKENS):
    """The rows (`rows`: their indices; None: all) on `engine`, each with its adapter; their new tokens."""
    picked = range(len(adapters)) if rows is None else rows
    all_prompts = prompts(vocab)
    seqs = [
        engine.add(all_prompts[i], SamplingParams(max_new_tokens=new_tokens), request=i, adapter=adapters[i])
        for i in picked
    ]
    steps = []
    while engine.has_unfinished():
        steps.append(engine.step())
        if on_step:
            on_step(engine, steps[-1])
    engine.check_integrity()
    return [s.output_token_ids for s in seqs], steps


@pytest.mark.parametrize("attention", ["torch", "gather"])
@pytest.mark.parametrize("family", FAMILIES)
def test_rows_of_two_adapters_and_the_base_each_equal_peft_alone(family, attention, root):
    model = adapted(family, root)
    targets = {t for kw in ADAPTERS.values() for t in kw["target_modules"]}  # q_proj in both: wrapped once
    assert (
        sum(isinstance(m, LoRALinear) for m in model.modules())
        == len(targets) * model.config.num_hidden_layers
    )
    runs = []

    def watch(engine, step):  # each step's sequences of one adapter side by side (one run of tokens each)
        order = [s.seq.adapter for s in step.plan.scheduled]
        runs.append(len([a for i, a in enumerate(order) if i == 0 or a != order[i - 1]]) == len(set(order)))

    got, _ = run_rows(family_engine(model, attention), model.config.vocab_size, on_step=watch)
    want = peft_tokens(family, root)
    assert got == want
    assert all(runs) and len(runs) > NEW_TOKENS
    # the adapters change the tokens (else the test would not see one ignored), and the three rows of one prompt
    # differ (else the prefix cache could have handed one adapter's pages to another)
    assert len({tuple(want[0]), tuple(want[1]), tuple(want[2])}) == 3


def test_rows_equal_peft_under_preemption_by_swap_and_recompute(root):
    model = adapted("llama", root)
    want = peft_tokens("llama", root)
    for preemption in ("swap", "recompute"):
        got, steps = run_rows(family_engine(model, "torch", full_pages=12, preemption=preemption), 256)
        assert sum(s.num_preempted for s in steps) > 0, preemption
        assert got == want, preemption


def test_a_step_runs_at_most_max_loras_adapters_and_rows_still_equal_peft(root):
    """One slot: the adapters take turns (the scheduler admits rows of the running adapter, and the base model's,
    while the other's wait), each loaded again when its turn comes; every row still equals PEFT."""
    model = adapted("llama", root, max_loras=1)
    seen = []

    def watch(engine, step):
        seen.append({s.seq.adapter for s in step.plan.scheduled} - {None})

    got, _ = run_rows(family_engine(model, "torch", max_loras=1), 256, on_step=watch)
    assert got == peft_tokens("llama", root)
    assert max(len(s) for s in seen) == 1 and {a for s in seen for a in s} == {0, 1}
    stats = model.batchrun_lora.stats
    assert stats.loads >= 2 and stats.evictions == stats.loads - 1


def test_an_unknown_adapter_is_the_prompts_error(root):
    model = adapted("llama", root)
    engine = family_engine(model, "torch")
    with pytest.raises(ValueError, match=r"adapter 'c' is not one of this job's adapters \(a, b\)"):
        engine.add([5, 6, 7], SamplingParams(max_new_tokens=2), adapter="c")


# ---- jobs -------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def job_model(tmp_path_factory, model_dir):
    """A tiny Llama saved with the embedded model's tokenizer, and two PEFT adapters of it saved beside it."""
    from test_families import saved_model
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("job_model")
    torch.manual_seed(0)
    path = saved_model(root, "llama", {}, model_dir)
    folders = {}
    for i, (name, kw) in enumerate(ADAPTERS.items()):
        torch.manual_seed(200 + i)
        base_model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        peft_model = peft.get_peft_model(base_model, peft.LoraConfig(init_lora_weights=False, **kw))
        folders[name] = root / f"adapter-{name}"
        peft_model.save_pretrained(folders[name])
    return path, folders


def peft_generate(path: Path, folder: Path | None, prompt: list[int], new_tokens: int) -> list[int]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    if folder is not None:
        model = peft.PeftModel.from_pretrained(model, folder).eval()
    with torch.inference_mode():
        ids = model.generate(
            input_ids=torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=False, eos_token_id=None
        )
    return ids[0, len(prompt) :].tolist()


def adapter_job(tmp_path: Path, job_model, adapter_cells: list, extra: str = "") -> Path:
    from helpers import write_job, write_prompts

    path, folders = job_model
    texts = [f"row {i}: the quick brown fox jumps over the lazy dog {i}" for i in range(len(adapter_cells))]
    write_prompts(tmp_path / "in.parquet", texts, extra={"adapter": adapter_cells})
    adapters = ", ".join(f"{name}: {folder}" for name, folder in folders.items())
    return write_job(
        tmp_path / "job.yaml",
        f"name: lora\nmodel: {{path: {path}, dtype: float32, chat_template: false, adapters: {{{adapters}}}{extra}}}\n"
        f"input: {{parquet: {tmp_path / 'in.parquet'}, adapter_column: adapter}}\n"
        f"output: {{path: {tmp_path / 'out'}, token_ids: true}}\n"
        "sampling: {max_new_tokens: 8, ignore_eos: true}\nengine: {num_pages: 64, attention: torch}\n",
    )


@pytest.mark.parametrize("replicas", [1, 2])
def test_a_job_runs_each_rows_adapter_counts_them_and_makes_an_unknown_one_that_rows_error(
    tmp_path, job_model, replicas
):
    """Also with two replica processes: each row goes to a replica with its adapter cell."""
    from helpers import read_outputs, run_cli

    cells = [None, "a", "b", "c", "a", None]
    job = adapter_job(tmp_path, job_model, cells)
    r = run_cli("submit", str(job), "--quiet", "--set", f"engine.replicas={replicas}")
    assert r.returncode == 0, r.stderr
    rows = read_outputs(tmp_path / "out")
    path, folders = job_model
    for i, cell in enumerate(cells):
        row = rows[(i, 0)]
        if cell == "c":
            assert row["error"].startswith(
                "column 'adapter': 'c' is neither one of model.adapters nor the base model (known: a, b, base, "
            )
            continue
        assert row["error"] is None
        want = peft_generate(path, folders.get(cell), row["prompt_token_ids"], 8)
        assert row["completion_token_ids"] == want, (i, cell)
    s = run_cli("stats", str(tmp_path / "out"), "--json")
    summary = __import__("json").loads(s.stdout)
    assert summary["error_rows"] == 1
    assert summary["adapter_rows"] == {"a": 2, "b": 1}
    assert summary["adapter_generated_tokens"] == {"a": 16, "b": 8}
    counted = {
        name: sum(len(rows[(i, 0)]["prompt_token_ids"]) for i, c in enumerate(cells) if c == name)
        for name in ("a", "b")
    }
    assert summary["adapter_prompt_tokens"] == counted
    assert (
        summary["adapter_loads"] >= 2 and summary["adapter_bytes"] > 0
    )  # each replica loads what its rows need


@pytest.mark.ray
def test_ray_actors_and_the_ray_data_processor_carry_each_rows_adapter(
    tmp_path,
    job_model,
    ray_cluster,  # noqa: F811 - the fixture imported above
):
    """`submit --ray` on two actors, and the Ray Data processor (jobs/ray_data_pipeline.py), run an adapter
    column's rows as one process runs them: each row with its own adapter, the unknown one an error row."""
    import subprocess
    import sys

    import pyarrow.parquet as pq
    from helpers import ROOT, read_outputs, run_cli

    cells = [None, "a", "b", "c", "a", None, "b", "a"]
    job = adapter_job(tmp_path, job_model, cells)
    assert run_cli("submit", str(job), "--quiet").returncode == 0
    want = {k[0]: (r["completion"], r["error"]) for k, r in read_outputs(tmp_path / "out").items()}
    assert [want[i][1] is not None for i in range(len(cells))] == [c == "c" for c in cells]
    assert len({want[1][0], want[2][0]}) == 2  # the adapters change the text
    out = tmp_path / "ray"
    r = run_cli(
        "submit", str(job), "--quiet", "--ray", ray_cluster, "--replicas", "2", "--set", f"output.path={out}"
    )
    assert r.returncode == 0, r.stderr
    assert {k[0]: (r["completion"], r["error"]) for k, r in read_outputs(out).items()} == want
    pipeline = tmp_path / "pipeline"
    args = [
        str(job),
        str(tmp_path / "in.parquet"),
        str(pipeline),
        "--address",
        ray_cluster,
        "--batch-size",
        "3",
    ]
    p = subprocess.run(
        [sys.executable, str(ROOT / "jobs" / "ray_data_pipeline.py"), *args],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert p.returncode == 0, p.stderr
    rows = pq.read_table(pipeline).to_pylist()  # the batch's own id column comes along: r0, r1, ...
    assert {int(r["id"][1:]): (r["completion"], r["error"]) for r in rows} == want


def _adapter_config(folder: Path, **changes) -> None:
    import json

    path = folder / "adapter_config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"use_dora": True}, "key `use_dora`: DoRA (weight-decomposed LoRA) is not applied by batchrun"),
        ({"modules_to_save": ["lm_head"]}, "key `modules_to_save`: modules saved whole beside the adapter"),
        ({"bias": "all"}, "key `bias` is 'all': trained biases are not applied by batchrun"),
        ({"init_lora_weights": "pissa"}, "rewrites the base model's weights"),
        ({"peft_type": "IA3"}, "key `peft_type` is 'IA3'; batchrun applies LoRA adapters only"),
        ({"r": 128, "lora_alpha": 16}, "rank 128 is over engine.max_lora_rank (64)"),
    ],
)
def test_an_adapter_batchrun_does_not_apply_exactly_is_exit_2_at_validation(
    tmp_path, job_model, changes, message
):
    import shutil

    from helpers import run_cli

    path, folders = job_model
    copied = tmp_path / "adapter-b"
    shutil.copytree(folders["b"], copied)
    _adapter_config(copied, **changes)
    job = adapter_job(tmp_path, (path, {"a": folders["a"], "b": copied}), ["a", "b"])
    r = run_cli("validate", str(job))
    assert r.returncode == 2 and message in r.stderr and "model.adapters.b" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr


def test_an_adapter_of_another_base_model_is_exit_2_at_validation_and_before_the_load_naming_the_module(
    tmp_path, job_model, model_dir
):
    """Decided by the model's config and the adapter file's names and shapes: `validate` says it (it said ok),
    and `submit` before the weights load, in the words the load's own check uses."""
    from helpers import run_cli
    from test_families import saved_model
    from transformers import AutoModelForCausalLM

    path, folders = job_model
    wider = saved_model(tmp_path, "llama", {"hidden_size": 96, "head_dim": 24}, model_dir)
    other = peft.get_peft_model(
        AutoModelForCausalLM.from_pretrained(wider), peft.LoraConfig(r=4, target_modules=["q_proj"])
    )
    other.save_pretrained(tmp_path / "other")
    job = adapter_job(tmp_path, (path, {"a": folders["a"], "b": tmp_path / "other"}), ["a", "b"])
    for command in ("validate", "submit"):
        r = run_cli(command, str(job))
        assert r.returncode == 2, (command, r.stderr)
        assert (
            "model.adapters.b: module 'model.layers.0.self_attn.q_proj': lora_A (4, 96) and lora_B (96, 4) do "
            "not fit its 64 -> 64 layer (an adapter for another base model?)" in r.stderr
        ), r.stderr
        assert "Traceback" not in r.stderr


@pytest.mark.parametrize(
    "targets, module, kind",
    [
        (["embed_tokens", "q_proj"], "model.embed_tokens", "an Embedding"),
        (["lm_head"], "lm_head", "a Linear"),
    ],
)
def test_lora_on_the_embeddings_or_the_lm_head_is_exit_2_at_validation_and_at_load(
    tmp_path, job_model, targets, module, kind
):
    from helpers import run_cli
    from transformers import AutoModelForCausalLM

    from batchrun.engine.model.lora.config import read_adapter_config

    path, folders = job_model
    made = peft.get_peft_model(
        AutoModelForCausalLM.from_pretrained(path), peft.LoraConfig(r=4, target_modules=targets)
    )
    made.save_pretrained(tmp_path / "other")
    job = adapter_job(tmp_path, (path, {"b": tmp_path / "other"}), ["b"])
    r = run_cli("validate", str(job))
    refusal = f"model.adapters.b: module '{module}' is {kind} batchrun does not adapt"
    assert r.returncode == 2 and refusal in r.stderr and "Traceback" not in r.stderr, r.stderr
    # the load's check on the loaded model, the same function, says the same
    model = copy.deepcopy(base("llama")[0])
    config = read_adapter_config(tmp_path / "other", "test")
    with pytest.raises(BadInput, match=refusal):
        attach(model, {"b": (tmp_path / "other", config)}, 4, "cpu")


def test_validate_counts_one_adapter_in_the_singular_and_checks_its_shapes_as_the_load_does(
    tmp_path, job_model
):
    from helpers import run_cli

    path, folders = job_model
    r = run_cli("validate", str(adapter_job(tmp_path, (path, {"a": folders["a"]}), ["a"])))
    assert r.returncode == 0 and "with 1 LoRA adapter, output" in r.stdout, r.stdout + r.stderr


@pytest.mark.parametrize(
    "job, message",
    [
        ("task: embed\n", "key `model.adapters`: LoRA adapters apply to task generate, and task is embed"),
        ("model: {adapters: {}}\n", "key `input.adapter_column` names each row's LoRA adapter"),
        (
            "model: {adapters: {a: /x}, adapter: b}\n",
            "key `model.adapter`: 'b' is not one of model.adapters (a)",
        ),
    ],
)
def test_adapter_keys_that_do_not_fit_the_job_are_exit_2(tmp_path, job, message):
    import yaml

    from batchrun.config import parse_job

    raw = {
        "name": "t",
        "input": {"parquet": "x.parquet", "adapter_column": "adapter"},
        "model": {"adapters": {"a": "/x"}},
    }
    for key, value in yaml.safe_load(job).items():
        raw[key] = {**raw.get(key, {}), **value} if isinstance(value, dict) else value
    with pytest.raises(BadInput, match=__import__("re").escape(message)):
        parse_job(raw)


def test_the_python_api_runs_a_list_of_adapters_and_n_samples_share_their_rows(job_model):
    from batchrun import LLM

    path, folders = job_model
    llm = LLM(str(path), dtype="float32", num_pages=64, adapters={k: str(v) for k, v in folders.items()})
    prompts = [[5 + i, 900, 41, 7000 + i, 12, 300] * 3 for i in range(4)]
    params = SamplingParams(max_new_tokens=6, ignore_eos=True, n=2)  # greedy: both samples are the row's
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False, adapter=["b", None, "a", "zz"]
    )
    for p, name, out in zip(prompts, ["b", None, "a"], outs):
        want = peft_generate(path, folders.get(name), p, 6)
        assert [c.token_ids for c in out.outputs] == [want, want], name
    assert outs[3].error == "prompt 3: adapter 'zz' is not one of this job's adapters (a, b)"
    with pytest.raises(ValueError, match="one adapter name"):
        llm.generate([{"prompt_token_ids": prompts[0]}], params, use_tqdm=False, adapter=["a", "b"])


@pytest.mark.parametrize("rows", [1, 15, 60, 333])
def test_the_expand_and_add_as_one_product_equal_the_two_steps(rows):
    """LoRALinear adds a slice's `h B^T` to the base output with one addmm_ where the scaling rode on B, for PEFT's
    `result + B h` (the product, then the add). With a rank far below the library's blocking of the sum, it sums
    the product and then adds C once: bit for bit on the development machine; held here within one rounding of
    fp32 on whatever library the machine has, at the shapes of a decode and a prompt chunk."""
    gen = torch.Generator().manual_seed(rows)
    for n_out, rank in ((576, 16), (1536, 8), (192, 64)):
        h = torch.randn(rows, rank, generator=gen)
        b = torch.randn(n_out, rank, generator=gen)
        out = torch.randn(rows, n_out, generator=gen)
        want = out + torch.nn.functional.linear(h, b)
        got = out.clone().addmm_(h, b.t())
        assert torch.allclose(got, want, rtol=2e-7, atol=2e-6 * want.abs().max().item())
        assert not torch.allclose(got, out, rtol=1e-3)  # the product was added


# ---- the GPU path: Triton kernels over stacked weights (interpreted on the CPU here) ----------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_lora_kernels_equal_plain_pytorch(dtype):
    from batchrun_kernels.lora import lora_apply, ref_lora

    gen = torch.Generator().manual_seed(0)
    slots_n, rank, n_in, n_out, T = 3, 12, 80, 72, 9  # sizes off the kernels' blocks
    a = torch.randn(slots_n, rank, n_in, generator=gen)
    b = torch.randn(slots_n, n_out, rank, generator=gen)
    a[1, 5:] = 0  # slot 1 holds a rank-5 adapter, padded with zeros
    b[1, :, 5:] = 0
    scales = torch.tensor([0.5, 2.0, 1.25])
    x = torch.randn(T, n_in, generator=gen).to(dtype)
    out = torch.randn(T, n_out, generator=gen).to(dtype)
    slots = torch.tensor([0, -1, 1, 1, 2, -1, 0, 2, 2], dtype=torch.int32)
    want = ref_lora(x, a, b, scales, slots, out)
    got = out.clone()
    lora_apply(x, a, b, scales, slots, got)
    assert torch.equal(got[slots < 0], out[slots < 0])  # base rows untouched
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    err = ((got.float() - want.float()).norm() / want.float().norm()).item()
    assert err < tol, err
    assert (
        (out.float() - want.float()).norm() / want.float().norm()
    ).item() > 100 * tol  # the adapters count


def test_the_stacked_kernel_path_equals_peft_in_an_engine(root):
    """The GPU path (stacked weights, one kernel launch per layer for every adapter) run under Triton's
    interpreter on the CPU (slow: one prompt under both adapters and a short one on the base, 4 new tokens):
    each row's tokens still equal PEFT's."""
    model = copy.deepcopy(base("llama")[0])
    folders = {name: str(f) for name, f in adapter_folders("llama", root).items()}
    manager = attach(model, read_adapters(folders, 64, "test"), 4, "cpu", stacked=True)
    assert all(layer.stacked is not None for layer in manager.layers.values())
    rows = [1, 2, 7]
    got, _ = run_rows(family_engine(model, "torch"), model.config.vocab_size, rows=rows, new_tokens=4)
    assert got == [peft_tokens("llama", root)[i][:4] for i in rows]


def test_an_adapter_over_a_quantized_base_is_refused_naming_the_format(root):
    model = copy.deepcopy(base("llama")[0])
    model.config.quantization_config = {"quant_method": "bitsandbytes", "load_in_4bit": True}
    folders = {name: str(f) for name, f in adapter_folders("llama", root).items()}
    with pytest.raises(BadInput, match=r"over a quantized checkpoint \(bitsandbytes\) are not applied"):
        attach(model, read_adapters(folders, 64, "test"), 4, "cpu")


def test_an_adapter_at_a_url_is_copied_into_the_cache_and_read(root, tmp_path, monkeypatch):
    import fsspec

    monkeypatch.setenv("BATCHRUN_CACHE", str(tmp_path / "cache"))
    fs = fsspec.filesystem("memory")
    local = adapter_folders("llama", root)["a"]
    for f in local.iterdir():
        fs.pipe(f"/lora-test/a/{f.name}", f.read_bytes())
    found = read_adapters({"a": "memory://lora-test/a"}, 64, "test")
    folder, config = found["a"]
    assert folder.is_relative_to(tmp_path / "cache" / "adapters")
    assert config.rank == ADAPTERS["a"]["r"]
    assert (folder / "adapter_model.safetensors").read_bytes() == (
        local / "adapter_model.safetensors"
    ).read_bytes()
    with pytest.raises(BadInput, match="memory://lora-test/none has no adapter_config.json"):
        read_adapters({"b": "memory://lora-test/none"}, 64, "test")


def test_an_adapter_named_by_hub_id_is_read_from_the_local_cache_and_offline_an_absent_one_is_exit_2(
    root, tmp_path, monkeypatch
):
    """A hub id resolves in the Hugging Face cache (the layout huggingface_hub writes: refs/main names the
    snapshot), with no network; HF_HUB_OFFLINE=1 and a repo not in the cache is a bad job naming the key."""
    import huggingface_hub.constants

    cache = tmp_path / "hub"
    repo = cache / "models--some-org--tiny-lora"
    snapshot = repo / "snapshots" / ("0" * 40)
    snapshot.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0" * 40)
    local = adapter_folders("llama", root)["a"]
    for f in local.iterdir():
        (snapshot / f.name).write_bytes(f.read_bytes())
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    folder, config = read_adapters({"a": "some-org/tiny-lora"}, 64, "job.yaml")["a"]
    assert folder == snapshot and config.rank == ADAPTERS["a"]["r"]
    model = copy.deepcopy(base("llama")[0])
    attach(model, {"a": (folder, config)}, 4, "cpu")
    want = peft_tokens("llama", root)
    got, _ = run_rows(family_engine(model, "torch"), 256, adapters=[None, "a"], rows=[0, 1])
    assert got == [want[0], want[1]]  # ROW_ADAPTERS: row 0 the base's, row 1 adapter a's
    with pytest.raises(
        BadInput, match=r"key `model.adapters.b`: 'some-org/absent' is not in the local Hugging"
    ):
        read_adapters({"b": "some-org/absent"}, 64, "job.yaml")
