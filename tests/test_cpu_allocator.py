"""Large host blocks are reused between steps once the engine tells glibc's malloc to keep them
(engine/cpu_allocator.py): a step's logits over 200 rows (39 MB, above glibc's largest own mmap threshold) are
mapped afresh and faulted in page by page every step by default, and come from the heap after."""

import subprocess
import sys

import pytest

PROBE = """
import random, resource, sys, torch
from batchrun.engine import cpu_allocator
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
