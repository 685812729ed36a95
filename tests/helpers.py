"""Helpers shared by the tests (importable as `helpers`: pytest puts tests/ on sys.path)."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import torch

ROOT = Path(__file__).resolve().parent.parent
BATCHRUN = str(Path(sys.executable).parent / "batchrun")


def chat_ids(tok, text: str, system: str | None = None) -> list[int]:
    messages = ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": text}
    ]
    rendered = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tok(rendered, add_special_tokens=False)["input_ids"]


def within_ulps(got: torch.Tensor, want: torch.Tensor, ulps: int) -> bool:
    """Every value of `got` within `ulps` units in the last place of `want`'s dtype (bf16/fp16 kernels against
    the HF module's own output)."""
    eps = torch.finfo(want.dtype).eps
    err = (got.float() - want.float()).abs()
    return bool((err <= ulps * eps * want.float().abs() + torch.finfo(want.dtype).tiny).all())


# ---- engine/model/ops/fused_elementwise.py's modules against HF's (test_fused_elementwise_families, test_quantized)
def record_calls(model, ids: torch.Tensor, before=lambda: None) -> dict[torch.nn.Module, list]:
    """One forward under HF's modules (after `before()`: a vision tower's, say): each module's calls as (args,
    kwargs, output), in call order."""
    calls: dict[torch.nn.Module, list] = {}

    def hook(module, args, kwargs, output):
        calls.setdefault(module, []).append((args, kwargs, output))

    handles = [m.register_forward_hook(hook, with_kwargs=True) for m in model.modules()]
    with torch.inference_mode():
        before()
        model(ids)
    for h in handles:
        h.remove()  # a hooked module is never rewritten
    return calls


def check_fused(fused: torch.nn.Module, calls: dict) -> tuple[int, int]:
    """Each of the HF module's recorded calls through its fused replacement, every value within the kernel's
    ulps of HF's; returns how many values were bit-equal, of how many."""
    from batchrun.engine.model.ops.fused_elementwise import SiluAndMulMLP

    hf = fused._hf[0]
    assert calls.get(hf), f"{type(hf).__name__} was not called by the forward"
    equal = total = 0
    reached: list[torch.Tensor] = []  # an MLP's down_proj inputs (down_proj is HF's module on both sides)
    mlp = isinstance(fused, SiluAndMulMLP)
    handle = hf.down_proj.register_forward_pre_hook(lambda m, a: reached.append(a[0])) if mlp else None
    for i, (args, kwargs, output) in enumerate(calls[hf]):
        with torch.inference_mode():
            got = fused(*args, **kwargs)
        want, tol = output, 1
        if mlp:  # SiLU-and-mul, read where it reaches down_proj
            got, want, tol = reached[-1], calls[hf.down_proj][i][0][0], 2
        assert got.dtype == want.dtype and got.shape == want.shape
        assert within_ulps(got, want, tol), type(hf).__name__
        equal, total = equal + int((got == want).sum()), total + want.numel()
    if handle is not None:
        handle.remove()
    return equal, total


def fused_modules(model) -> list[torch.nn.Module]:
    from batchrun.engine.model.ops.fused_elementwise import FusedRMSNorm, SiluAndMulMLP

    return [m for m in model.modules() if isinstance(m, FusedRMSNorm | SiluAndMulMLP)]


def make_engine(tok_model, num_cpu_pages: int = 1024, max_model_len: int = 8192, **overrides):
    """An engine on the CPU with the torch backend; `overrides` are EngineConfig keys (the job's engine:)."""
    from batchrun.engine import Engine, EngineConfig, LoadedModel
    from batchrun.engine.model.architecture import inspect_model

    tok, model = tok_model
    cfg = dict(
        device="cpu",
        num_pages=1024,
        page_size=16,
        max_num_seqs=64,
        max_num_batched_tokens=4096,
        prefix_sharing=True,
        preemption="swap",
        attention="torch",
    )
    cfg.update(overrides)
    spec = inspect_model(model).kv_spec(cfg["page_size"], next(model.parameters()).dtype)
    cfg["swap_space"] = num_cpu_pages * spec.bytes_per_page
    loaded = LoadedModel.with_tokenizer(model, tok, max_model_len)
    return Engine(loaded, EngineConfig(**cfg), torch.device("cpu"))


def save_with_tokenizer(model, target: Path, model_dir) -> Path:
    """`model` saved as a model directory at `target`, with the embedded model's tokenizer files beside it."""
    import shutil

    model.save_pretrained(target)
    for f in Path(model_dir).iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "vocab", "merges")):
            shutil.copy(f, target / f.name)
    return target


def paged_model_from_config(config, dtype: torch.dtype = torch.float32):
    """A random-weight model from a config, with batchrun's attention as the engine loads a model directory's
    (the tests' architecture matrix)."""
    from batchrun.engine.attention import register
    from batchrun.engine.model.loading import attention_implementation, model_class, refused_attention

    register()
    with refused_attention(config):
        return model_class(config).from_config(
            config, attn_implementation=attention_implementation(config), dtype=dtype
        )


def run_engine(engine, prompts, params, seeds=None, on_step=None):
    """Run prompts to completion; returns each prompt's sequences (in sample order) and the step results."""
    for i, p in enumerate(prompts):
        engine.add(p, params, request=i, seeds=seeds[i] if seeds else None)
    by_request = {i: [] for i in range(len(prompts))}
    steps = []
    while engine.has_unfinished():
        r = engine.step()
        steps.append(r)
        if on_step:
            on_step(engine, r)
        for s in r.finished:
            by_request[s.request].append(s)
    assert all(len(v) == params.n for v in by_request.values())
    return [sorted(by_request[i], key=lambda s: s.sample_index) for i in range(len(prompts))], steps


def hf_greedy(model_dir, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """The reference: Hugging Face `generate`, greedy, fp32, stock attention, one prompt at a time."""
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    ref.eval()
    out = []
    with torch.inference_mode():
        for p in prompts:
            ids = ref.generate(torch.tensor([p]), max_new_tokens=max_new_tokens, do_sample=False)[0, len(p) :]
            out.append(ids.tolist())
    return out


def write_prompts(path: Path, prompts: list, ids: list | None = None, extra: dict | None = None) -> Path:
    cols = {"id": ids if ids is not None else [f"r{i}" for i in range(len(prompts))], "prompt": prompts}
    cols.update(extra or {})
    pq.write_table(pa.table(cols), path)
    return path


def write_job(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def run_cli(*args, cwd=None, env=None, timeout=600):
    e = dict(os.environ)
    e.update(env or {})
    return subprocess.run([BATCHRUN, *args], capture_output=True, text=True, cwd=cwd, env=e, timeout=timeout)


def start_submit(job_file, out: Path) -> subprocess.Popen:
    """`batchrun submit` of the job in the background, its output at `out`."""
    return subprocess.Popen(
        [BATCHRUN, "submit", str(job_file), "--quiet", "--set", f"output.path={out}"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def wait_for_parts(
    out: Path, n: int, proc: subprocess.Popen, timeout: float = 120, pattern: str = "part-*.parquet"
) -> bool:
    """Until `out` holds n part files (of `pattern`: one shard's, say): True, or False if the run ended first."""
    t0 = time.time()
    while time.time() - t0 < timeout:
        if out.exists() and len(list(out.glob(pattern))) >= n:
            return True
        if proc.poll() is not None:
            return False
        time.sleep(0.05)
    raise AssertionError("no part files appeared")


def save_vlm(cfg, target: Path, perturbed: bool = False) -> None:
    """A tiny vision-language model of `cfg`, random weights from seed 0 (biases and norm weights perturbed
    where a family repeats its last token otherwise), saved in target."""
    from model_families import perturb
    from transformers import AutoModelForImageTextToText

    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_config(cfg)
    if perturbed:
        perturb(model, 0)
    model.save_pretrained(target)


def read_outputs(out_dir: Path) -> dict:
    """(id, sample) -> row dict, asserting no pair appears twice."""
    rows = {}
    for part in sorted(Path(out_dir).glob("part-*.parquet")):
        for r in pq.read_table(part).to_pylist():
            key = (r["id"], r["sample"])
            assert key not in rows, f"{key} written twice"
            rows[key] = r
    return rows


@contextlib.contextmanager
def moto_server(log_dir: Path):
    """A moto S3 server (its own process) on a free port of 127.0.0.1 with a bucket `bkt`, this process's
    environment pointing boto at it while it runs: yields (that environment, an s3fs file system)."""
    import socket
    import time

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    log = open(log_dir / "server.log", "w")  # noqa: SIM115 - closed at the end
    server = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)], stdout=log, stderr=log
    )
    env = {
        "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}",
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
    }
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        import s3fs

        fs = s3fs.S3FileSystem(skip_instance_cache=True)
        t0 = time.time()
        while True:
            try:
                fs.mkdir("bkt")
                break
            except Exception:
                if time.time() - t0 > 30 or server.poll() is not None:
                    raise
                time.sleep(0.2)
        yield env, fs
    finally:
        server.terminate()
        server.wait(10)
        log.close()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
