"""Host memory of a CPU engine. Large blocks are reused between steps once the engine tells glibc's malloc to keep
them (engine/model/ops/cpu_allocator.py): a step's logits over 200 rows (39 MB, above glibc's largest own mmap threshold)
are mapped afresh and faulted in page by page every step by default, and come from the heap after. The KV pool
is zeroed lazily, 4 KiB at a time (kv_cache.py)."""

import os
import subprocess
import sys

import pytest
import torch

from batchrun.engine.core.cache_spec import KVCacheSpec, KVGroups, KVShape
from batchrun.engine.worker.kv_cache import KVCache

PROBE = """
import random, resource, sys, torch
from batchrun.engine.model.ops import cpu_allocator
if sys.argv[2] == "default":
    cpu_allocator.keep_freed_blocks = lambda: False
from batchrun import LLM, SamplingParams
llm = LLM(model=sys.argv[1], dtype="float32", device="cpu", max_num_seqs=256)
prompts = [[random.Random(i).randrange(100, 40000) for _ in range(8)] for i in range(200)]
params = SamplingParams(max_new_tokens=8, ignore_eos=True)
llm.generate(prompts[:4], params, use_tqdm=False)
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
llm.generate(prompts, params, use_tqdm=False)
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


@pytest.fixture(scope="module")
def one_layer_model(model_dir, tmp_path_factory):
    """The default model's shape and tokenizer with one layer of random weights: its forward costs little."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    config = AutoConfig.from_pretrained(model_dir)
    config.num_hidden_layers = 1
    target = tmp_path_factory.mktemp("one-layer")
    AutoModelForCausalLM.from_config(config).save_pretrained(target)
    AutoTokenizer.from_pretrained(model_dir).save_pretrained(target)
    return target


def page_faults(model, mode: str) -> int:
    cmd = [sys.executable, "-c", PROBE, str(model), mode]
    return int(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.split()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_large_blocks_are_reused_between_steps(one_layer_model):
    default, keep = page_faults(one_layer_model, "default"), page_faults(one_layer_model, "keep")
    logits_pages = 200 * 49152 * 4 // 4096
    assert default > 8 * logits_pages  # the logits' pages faulted in at every one of the 8 steps (at least)
    assert keep < default / 2, (keep, default)


def smaps_total(start: int, end: int) -> dict[str, int]:
    """The kB fields of /proc/self/smaps summed over the mappings that overlap [start, end)."""
    total: dict[str, int] = {}
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):  # a mapping's first line: start-end perms ...
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo < end and start < hi
            elif inside and line.rstrip().endswith(" kB"):
                key = head.rstrip(":")
                total[key] = total.get(key, 0) + int(line.split()[1])
    return total


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="Linux's /proc")
def test_the_kv_pool_grows_by_the_pages_written():
    """The CPU pool is zeroed lazily by the OS in 4 KiB pages: writing one page of it makes that page resident
    and no more. (In 2 MiB pages, as numpy's calloc asked for, a first write zeroes 2 MiB: on the reference
    workload the K/V writes took 1.4-1.5 s instead of 0.35.)"""
    groups = KVGroups.of_layers([("full", KVShape(num_kv_heads=2, head_dim=64, v_head_dim=64))] * 4)
    spec = KVCacheSpec(groups, page_size=16, dtype=torch.float32)
    cache = KVCache(spec, num_pages=4096, num_cpu_pages=0, device=torch.device("cpu"))  # 256 MiB
    k, v = cache.layer(1)
    k[100].fill_(1.0)  # one page of one layer's keys: 8 KiB
    pool = cache.pages
    start = pool.data_ptr()
    mapped = smaps_total(start, start + pool.numel() * 4)
    assert mapped["Size"] >= pool.numel() * 4 // 1024
    assert mapped.get("AnonHugePages", 0) == 0, mapped
    assert mapped["Rss"] <= 64, mapped
    assert pool.sum().item() == 16 * 2 * 64 and v.sum().item() == 0  # zeros but the page written


@pytest.mark.parametrize(
    "flags, bf16",
    [
        ("fpu sse2 avx avx2 fma", False),  # an AMD EPYC with AVX2 only: oneDNN's bf16 reorder raised there
        ("avx2 avx512f avx512bw avx512vl avx512dq", True),
        ("avx2 avx_ne_convert", True),
        ("avx2 avx512f avx512bw", False),
    ],
)
def test_bf16_weights_are_packed_only_where_the_cpu_can(monkeypatch, flags, bf16):
    """issue 24, item 6: `dtype: bfloat16` on an AVX2-only CPU crashed in the weight packing; the capability
    check decides, forced here since the test machine's CPU varies."""
    from batchrun import host
    from batchrun.engine.model.ops import cpu_linear

    monkeypatch.setattr(host, "cpu_description", lambda: f"model name\t: test CPU\nflags\t\t: {flags}")
    assert cpu_linear.available(torch.bfloat16) is bf16
    assert cpu_linear.available(torch.float32) is torch.backends.mkldnn.is_available()


def test_an_llm_on_a_cpu_without_bf16_packing_runs_bf16_unpacked(monkeypatch):
    from batchrun import LLM, SamplingParams, host

    monkeypatch.setattr(host, "cpu_description", lambda: "model name\t: test CPU\nflags\t\t: avx2 fma")
    llm = LLM(device="cpu", dtype="bfloat16", num_pages=64)
    assert not llm.rewrites["packed_linear"]
    assert not any(type(m).__name__ == "PackedLinear" for m in llm.engine.runner.model.modules())
    out = llm.generate(["Hello"], SamplingParams(max_new_tokens=3), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3


RESIDENT = """
import sys
def file_mib():
    return int(open("/proc/self/status").read().split("RssFile:")[1].split()[0]) / 1024
import torch, transformers
from batchrun import LLM
before = file_mib()
llm = LLM(model=sys.argv[1], dtype="float32", device="cpu", num_pages=16, pack_weights=sys.argv[2] == "pack")
print(llm.rewrites["packed_linear"] > 0, file_mib() - before)
"""


def test_packed_weights_do_not_keep_the_checkpoint_file_resident(tmp_path, model_dir):
    """transformers maps an fp32 safetensors file loaded as fp32; packing reads every page of it, and while any
    tensor left unpacked (the embedding, the norms) pointed into the map, all of those pages stayed resident
    beside the packed copies (weights held twice). Unpacked, the map is the weights: it stays."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=49152, hidden_size=512, intermediate_size=1536, num_hidden_layers=4, num_attention_heads=8,
        num_key_value_heads=4, max_position_embeddings=512, tie_word_embeddings=True,
    )  # fmt: skip
    LlamaForCausalLM(config).save_pretrained(tmp_path)  # fp32 on disk: 144 MiB
    AutoTokenizer.from_pretrained(model_dir).save_pretrained(tmp_path)
    size = sum(f.stat().st_size for f in tmp_path.glob("*.safetensors")) / 2**20
    resident = {}
    for mode in ("pack", "plain"):
        r = subprocess.run(
            [sys.executable, "-c", RESIDENT, str(tmp_path), mode], capture_output=True, text=True
        )
        assert r.returncode == 0, r.stderr[-2000:]
        packed, mib = r.stdout.split()[-2:]
        assert packed == str(mode == "pack")
        resident[mode] = float(mib)
    # each figure also counts the libraries the load maps (20 to 45 MiB, by environment): the difference is
    # the map, resident unpacked (where it is the weights) and let go packed
    assert resident["plain"] - resident["pack"] > 0.8 * size, (resident, size)
