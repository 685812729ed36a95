"""The progress bar's remaining time (progress.py), on a fake clock and the engine's own sequences: issue 43,
item 5 (with every row in flight, the bar sat at 0 rows for 49 s of a 62 s job and showed an ETA of 1 h 37 min)."""

import io
import re

from tqdm import tqdm

from batchrun.engine import SamplingParams, Sequence
from batchrun.progress import BAR_FORMAT, RemainingTime, remaining_seconds, rows_in_flight_done


class FakeClock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def running(
    prompt_tokens: int, generated: int, params: SamplingParams, computed: int | None = None
) -> Sequence:
    seq = Sequence(0, list(range(prompt_tokens)), params)
    seq.output_token_ids = [7] * generated
    seq.num_computed_tokens = prompt_tokens + generated if computed is None else computed
    return seq


def test_every_row_in_flight_shows_the_true_remaining_time_from_the_first_steps():
    """8 rows of 40 new tokens run together, a token each per second (a fake clock): no row finishes before the
    end, yet from the first second on the bar's remaining time is the true one."""
    clock, out = FakeClock(), io.StringIO()
    bar = tqdm(total=8, file=out, bar_format=BAR_FORMAT, mininterval=0)
    remaining = RemainingTime(bar, every_s=0.5, clock=clock)
    params = SamplingParams(max_new_tokens=40, ignore_eos=True)
    for second in range(1, 40):
        clock.now += 1
        seqs = [running(30, second, params) for _ in range(8)]
        remaining.show(lambda seqs=seqs: rows_in_flight_done(seqs), "12.0 tok/s")
        assert bar.n == 0  # no row finished yet
        assert bar.postfix == f"ETA {tqdm.format_interval(40 - second)}, 12.0 tok/s", second
    drawn = out.getvalue()  # redrawn at each (no row finished to redraw it); its elapsed time is tqdm's own
    assert re.search(r"\| 0/8 \[\d\d:\d\d, ETA 00:35, 12.0 tok/s\]", drawn), drawn
    assert re.search(r"\| 0/8 \[\d\d:\d\d, ETA 00:01, 12.0 tok/s\]", drawn), drawn
    assert "<" not in drawn, "tqdm's own remaining time (by finished rows) is not shown"


def test_the_postfix_waits_its_interval_and_the_clock_restarts_after_the_load():
    clock = FakeClock()
    bar = tqdm(total=4, file=io.StringIO(), bar_format=BAR_FORMAT)
    remaining = RemainingTime(bar, every_s=0.5, clock=clock)
    asked = []
    clock.now += 60  # the model's load
    remaining.restart()
    clock.now += 10
    remaining.show(lambda: asked.append(1) or 1.0)
    assert bar.postfix == "ETA 00:30"  # 1 row's work in 10 s, 3 left: the load is not counted
    clock.now += 0.1
    remaining.show(lambda: asked.append(1) or 2.0)
    assert bar.postfix == "ETA 00:30" and len(asked) == 1, "not due: the running rows are not even asked"
    bar.update(4)
    clock.now += 1
    remaining.show(lambda: 0.0)
    assert bar.postfix == "ETA 00:00"


def test_work_counts_samples_scoring_rows_and_caps_at_one():
    greedy = SamplingParams(max_new_tokens=10)
    two = SamplingParams(max_new_tokens=10, n=2)
    scoring = SamplingParams(max_new_tokens=0, prompt_logprobs=True)
    seqs = [
        running(5, 5, greedy),  # half its tokens: half a row
        running(5, 4, two),  # one of two samples, 4 of 10 tokens: 0.2 of a row
        running(5, 4, two),
        running(100, 0, scoring, computed=25),  # a quarter of its prompt computed
        running(5, 12, greedy),  # cannot do more than its whole row
    ]
    assert abs(rows_in_flight_done(seqs) - (0.5 + 0.2 + 0.2 + 0.25 + 1.0)) < 1e-12
    assert remaining_seconds(10.0, 10, 0.0) is None and remaining_seconds(10.0, None, 3.0) is None
    assert remaining_seconds(10.0, 10, 2.5) == 30.0


def test_a_bar_into_a_log_file_is_redrawn_no_more_often_than_its_own_interval():
    clock = FakeClock()
    # the job's bar off a terminal redraws every 10 s at most
    bar = tqdm(total=4, file=io.StringIO(), bar_format=BAR_FORMAT, mininterval=10.0)
    remaining = RemainingTime(bar, every_s=0.5, clock=clock)
    clock.now += 10
    remaining.show(lambda: 1.0)
    clock.now += 5
    remaining.show(lambda: 2.0)
    assert bar.postfix == "ETA 00:30"
    clock.now += 5
    remaining.show(lambda: 2.0)
    assert bar.postfix == "ETA 00:20"


def test_a_disabled_bar_is_left_alone():
    """--quiet and use_tqdm=False: a disabled tqdm has no mininterval (this was an AttributeError) and no
    postfix to set; the running rows are not even asked."""
    bar = tqdm(total=4, disable=True)
    remaining = RemainingTime(bar, clock=FakeClock())
    remaining.show(lambda: 1 / 0)
