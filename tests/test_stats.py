"""Statistics: brute-force recount on a real job, invariants, the simulator on hand-computed cases, the plot."""

import json

import pyarrow.parquet as pq
import pytest
from helpers import ROOT, run_cli

from batchrun.config import load_job
from batchrun.job import Job
from batchrun.simulate import Request, _Contiguous, _Paged, simulate_one
from batchrun.stats import COLUMNS, read_summary

CONTRACT_SUMMARY_KEYS = [
    "wall_s",
    "rows",
    "prompt_tokens",
    "generated_tokens",
    "generated_tokens_per_s",
    "peak_running",
    "mean_running",
    "kv_utilization_mean",
    "kv_utilization_peak",
    "internal_fragmentation_mean",
    "external_fragmentation_max",
    "duplication_saved_peak",
    "prefix_hit_tokens",
    "preemptions",
    "recomputations",
    "swap_out_pages",
    "swap_in_pages",
    "swap_out_bytes",
    "swap_in_bytes",
    "contiguous_utilization_mean",
    "contiguous_max_concurrency",
    "page_size",
    "pages_total",
]


@pytest.fixture(scope="module")
def stats_job(tmp_path_factory, monkeypatch_module):
    d = tmp_path_factory.mktemp("stats")
    monkeypatch_module.setenv("BATCHRUN_DEBUG_STATS", "1")  # every step recounted by brute force
    spec = load_job(
        ROOT / "jobs" / "demo.yaml",
        [
            f"output.path={d / 'out'}",
            f"output.stats={d / 'stats.parquet'}",
            "engine.num_pages=60",
            "engine.prefix_sharing=false",
            "sampling.max_new_tokens=24",
            "engine.max_num_seqs=16",
        ],
    )
    summary = Job(spec, limit=40, progress=False).run()
    return d / "stats.parquet", summary


@pytest.fixture(scope="module")
def monkeypatch_module():
    mp = pytest.MonkeyPatch()
    yield mp
    mp.undo()


def test_stats_file_has_every_column_and_summary_key(stats_job):
    path, summary = stats_job
    table = pq.read_table(path)
    assert set(COLUMNS) <= set(table.column_names)
    stored = read_summary(path)
    for key in CONTRACT_SUMMARY_KEYS:
        assert key in stored, key
    assert stored["rows"] == 40 and stored["generated_tokens"] == summary["generated_tokens"]
    assert stored["preemptions"] > 0, "60 pages should force preemptions for this workload"


def test_invariants_hold_on_every_row(stats_job):
    path, _ = stats_job
    t = pq.read_table(path).to_pylist()
    assert t[0]["step"] == 0
    for r in t:
        assert r["pages_used"] + r["pages_free"] == r["pages_total"]
        assert r["slots_allocated"] == r["pages_used"] * 16
        # nothing is shared (prefix sharing off, n = 1): the tail of each sequence's last page is all the waste
        assert r["shared_pages_saved"] == 0
        assert 0 <= r["internal_waste_slots"] <= 15 * r["num_running"]
        if r["slots_allocated"]:
            assert 0 <= r["tokens_stored"] / r["slots_allocated"] <= 1
        assert r["external_fragmentation"] == 0.0
        assert r["tokens_cached_per_sequence"] <= r["reserved_slots_contiguous"]
    assert sum(r["preemptions"] for r in t) == read_summary(path)["preemptions"], "preemption steps are kept"


def test_stats_command_prints_and_plots(stats_job, tmp_path):
    path, _ = stats_job
    png = tmp_path / "memory.png"
    r = run_cli("stats", str(path), "--plot", str(png))
    assert r.returncode == 0, r.stderr
    for words in (
        "KV utilization",
        "internal fragmentation",
        "duplication saved",
        "contiguous counterfactual",
        "swapped out",
        "preemptions",
    ):
        assert words in r.stdout
    from PIL import Image

    img = Image.open(png).convert("L")
    assert img.size[0] >= 800 and img.size[1] >= 600
    hist = img.histogram()
    assert sum(1 for h in hist if h > 50) > 20, "the plot looks blank"
    j = run_cli("stats", str(path), "--json")
    assert json.loads(j.stdout)["page_size"] == 16


def test_stats_on_a_missing_file_exits_2(tmp_path):
    r = run_cli("stats", str(tmp_path / "nope.parquet"))
    assert r.returncode == 2 and "nope.parquet" in r.stderr


def test_contiguous_simulation_by_hand():
    # 32 slots; each request reserves 4 + 8; two fit, the third waits for a gap of 12 while 8 slots sit free
    res = simulate_one(_Contiguous(32, 8, 0), [Request(4, 2)] * 3)
    assert res.tokens == pytest.approx((10 + 12) / 2 / 32)
    assert res.reserved == pytest.approx((2 + 0) / 2 / 32)
    assert res.internal == pytest.approx(12 / 32)
    assert res.external == pytest.approx(8 / 32)
    assert res.free == 0 and res.peak_concurrency == 2 and res.steps == 4 and res.delayed == 1


def test_paged_simulation_by_hand():
    # 2 pages of 4: both prompts fit, then growth preempts the newer request, which reruns after
    res = simulate_one(_Paged(8, 4, 0, sharing=False), [Request(4, 2)] * 2)
    assert res.preemptions == 1 and res.steps == 4 and res.peak_concurrency == 1
    assert res.tokens == pytest.approx((5 + 6) / 2 / 8)
    assert res.internal == pytest.approx((3 + 2) / 2 / 8)
    assert res.external == 0


def test_paged_simulation_of_a_hybrid_by_hand():
    # 4 pages of 4; a hybrid's state of 4 slots takes a page per running request: two of three fit at first
    # (without the state all three would); at step 0 the two hold 8 token slots and 8 of state, nothing free
    res = simulate_one(_Paged(16, 4, 0, sharing=False, state=4), [Request(3, 1)] * 3)
    assert res.peak_concurrency == 2 and res.preemptions == 0
    assert res.tokens == pytest.approx(8 / 16) and res.state == pytest.approx(8 / 16) and res.free == 0
    plain = simulate_one(_Paged(16, 4, 0, sharing=False), [Request(3, 1)] * 3)
    assert plain.peak_concurrency == 3 and plain.state == 0


@pytest.mark.parametrize("sizes", ["0,16", "3", "16,-8"])
def test_simulate_refuses_page_sizes_that_are_not_powers_of_two(sizes):
    """issue 24, item 13: 0 was a ZeroDivisionError (exit 1) and 3 was accepted."""
    r = run_cli("simulate", "--page-sizes", sizes, "--requests", "5")
    assert r.returncode == 2 and "--page-sizes" in r.stderr and "power of two" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr


def test_simulate_readme_example():
    r = run_cli(
        "simulate",
        "--prompt-len",
        "300-600",
        "--output-len",
        "1-64",
        "--max-new-tokens",
        "1024",
        "--requests",
        "300",
        "--budget",
        "32768",
        "--json",
    )
    assert r.returncode == 0, r.stderr
    rows = {x["allocator"]: x for x in json.loads(r.stdout)}
    assert rows["contiguous max-length"]["tokens"] < 0.40
    assert rows["paged P=16"]["tokens"] >= 0.96
    assert rows["contiguous exact-size first-fit"]["external"] > 0


def test_demo_job_file_validates():
    r = run_cli("validate", str(ROOT / "jobs" / "demo.yaml"))
    assert r.returncode == 0, r.stderr


def test_step_time_breakdown_agrees_with_independent_clocks(tok_model, chat_prompts):
    """The engine's phase times against clocks of our own around the model's forward and the attention
    layers (hooks), and the whole step loop."""
    import time

    from helpers import make_engine, run_engine

    from batchrun.engine import SamplingParams
    from batchrun.engine.timing import PHASES

    engine = make_engine(tok_model, max_num_batched_tokens=256)
    model = engine.runner.model
    clocks = {"forward": 0.0, "attention": 0.0}
    started: dict = {}

    def timer(name):
        def enter(*_):
            started[name] = time.perf_counter()

        def leave(*_):
            clocks[name] += time.perf_counter() - started.pop(name)

        return enter, leave

    hooks = []
    f_enter, f_leave = timer("forward")
    hooks += [model.register_forward_pre_hook(f_enter), model.register_forward_hook(f_leave)]
    a_enter, a_leave = timer("attention")
    for layer in model.get_decoder().layers:
        hooks += [
            layer.self_attn.register_forward_pre_hook(a_enter),
            layer.self_attn.register_forward_hook(a_leave),
        ]
    t0 = time.perf_counter()
    try:
        run_engine(engine, chat_prompts[:6], SamplingParams(max_new_tokens=8))
    finally:
        for h in hooks:
            h.remove()
    wall = time.perf_counter() - t0
    times = engine.times.seconds
    assert set(times) == set(PHASES)
    # the model call sits inside the forward phase, with next to nothing around it
    assert clocks["forward"] <= times["forward"] <= clocks["forward"] * 1.05 + 0.01
    # attention: inside each attention module's forward (which adds its q/k/v/o projections and RoPE)
    assert 0 < times["attention"] < clocks["attention"] <= times["forward"]
    engine_phases = sum(times[p] for p in ("schedule", "prepare", "forward", "sample", "finish"))
    assert 0.9 * wall < engine_phases <= wall


def test_the_printed_summary_names_window_pages_and_structured_rows_when_there_are_some():
    from batchrun.report import format_summary
    from batchrun.stats import SUMMARY_KEYS

    s = dict.fromkeys(SUMMARY_KEYS, 0)
    s.update(page_size=16, wall_s=1.0)
    plain = format_summary(s)
    assert "window" not in plain and "structured" not in plain
    s.update(window_freed_peak=40, window_freed_mean=12.5, structured_rows=3, structured_complete=2)
    text = format_summary(s)
    assert "given back: peak 40, mean 12.5" in text and "2 of 3 rows completed their grammar" in text


def test_stats_over_two_shards_names_both_and_a_pooling_job_counts_no_adapter_rows_as_generation_does(
    tmp_path,
):
    """`stats --json` over shards 0/2 and 1/2 says which shards it combined (not the first one's label), as the
    text says "(2 shards)"; a pooling job's adapter counts are {} (no adapter's rows), as a generation job's."""
    from batchrun.stats import SUMMARY_KEYS, PoolingStats, write_stats

    pooling = PoolingStats().summary()
    assert all(pooling[k] == {} for k, rules in SUMMARY_KEYS.items() if rules[0] == "counts")  # it said 0
    for i in range(2):
        write_stats(tmp_path / f"stats-{i:05d}of00002.parquet", [], pooling | {"shard": f"{i}/2", "rows": 3})
    r = run_cli("stats", str(tmp_path), "--json")
    assert r.returncode == 0, r.stderr
    combined = json.loads(r.stdout)
    assert combined["shard"] == ["0/2", "1/2"] and combined["shards"] == 2 and combined["rows"] == 6
    assert combined["adapter_rows"] == {}
    assert "(2 shards)" in run_cli("stats", str(tmp_path)).stdout


def test_the_printed_summary_counts_one_adapter_row_load_and_eviction_in_the_singular():
    from batchrun.report import format_summary
    from batchrun.stats import SUMMARY_KEYS

    s = dict.fromkeys(SUMMARY_KEYS, 0)
    s.update(page_size=16, wall_s=1.0, adapter_bytes=1024, adapter_loads=1, adapter_evictions=1)
    s.update(adapter_rows={"a": 1, "b": 2}, adapter_prompt_tokens={"a": 5}, adapter_generated_tokens={"a": 3})
    text = format_summary(s)
    assert "a 1 row, 5 + 3 tokens; b 2 rows" in text and "; 1 load, 1 eviction;" in text, text
