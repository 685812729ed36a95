"""Mutated job files never produce a traceback: always exit 2 with a message (or 0 if still valid)."""

import copy

import yaml
from click.testing import CliRunner
from helpers import write_prompts
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from batchrun.cli import main

VALID = {
    "name": "fuzz",
    "model": {"dtype": "auto", "chat_template": True, "system_prompt": None, "max_model_len": None},
    "input": {"parquet": None, "prompt_column": "prompt", "id_column": "id", "passthrough": [], "limit": 5},
    "sampling": {
        "max_new_tokens": 8,
        "temperature": 0.0,
        "top_p": 1.0,
        "top_k": -1,
        "seed": 0,
        "stop": [],
        "n": 1,
        "ignore_eos": False,
    },
    "engine": {
        "device": "cpu",
        "attention": "auto",
        "page_size": 16,
        "kv_cache_memory": "1GiB",
        "num_pages": None,
        "swap_space": "1GiB",
        "max_num_seqs": 8,
        "max_num_batched_tokens": 512,
        "prefix_sharing": True,
        "preemption": "swap",
    },
    "output": {"path": "out/fuzz", "stats": None},
}

junk = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-5, 10**6),
    st.floats(allow_nan=True),
    st.text(max_size=8),
    st.lists(st.integers(), max_size=3),
    st.dictionaries(st.text(max_size=4), st.integers(), max_size=2),
)


def paths(d, prefix=()):
    for k, v in d.items():
        yield prefix + (k,)
        if isinstance(v, dict):
            yield from paths(v, prefix + (k,))


ALL_PATHS = list(paths(VALID))

mutation = st.one_of(
    st.tuples(st.just("set"), st.sampled_from(ALL_PATHS), junk),
    st.tuples(st.just("delete"), st.sampled_from(ALL_PATHS), st.none()),
    st.tuples(st.just("add"), st.sampled_from(ALL_PATHS), st.text(min_size=1, max_size=6)),
)


def apply(doc, m):
    kind, path, value = m
    node = doc
    for k in path[:-1]:
        if not isinstance(node, dict) or k not in node:
            return
        node = node[k]
    if not isinstance(node, dict):
        return
    if kind == "set":
        node[path[-1]] = value
    elif kind == "delete":
        node.pop(path[-1], None)
    elif isinstance(node.get(path[-1]), dict):
        node[path[-1]][value] = 1


def check(runner, tmp_path, text):
    job = tmp_path / "job.yaml"
    job.write_text(text)
    result = runner.invoke(main, ["validate", str(job)])
    assert result.exit_code in (0, 2), (result.exit_code, result.output, text)
    assert "Traceback" not in result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    if result.exit_code == 2:
        assert str(job) in result.output or "--set" in result.output, result.output


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(mutations=st.lists(mutation, min_size=1, max_size=4))
def test_mutated_job_files_exit_2_without_traceback(tmp_path, mutations):
    data = write_prompts(tmp_path / "in.parquet", ["a", "b"], ids=["x", "y"])
    doc = copy.deepcopy(VALID)
    doc["input"]["parquet"] = str(data)
    for m in mutations:
        apply(doc, m)
    check(CliRunner(), tmp_path, yaml.safe_dump(doc))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(max_size=80))
def test_garbage_yaml_exits_2_without_traceback(tmp_path, text):
    check(CliRunner(), tmp_path, text)
