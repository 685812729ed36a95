"""The progress bar's remaining time, from the work done rather than from the rows finished.

Rows that run together finish together: with every row of a job in flight at once, a bar that counts finished
rows sits at 0 for most of the run, and a remaining time from its rate means nothing. The work a row has done is
known long before it finishes: the tokens it generated against its `max_new_tokens` (a scoring row's: its prompt
tokens computed), a decode step costing about the same whatever the prompt. So the bar still counts rows (what
is written), and beside them shows the remaining time as elapsed x (rows left / rows done), where the rows done
count each row in flight by the share of its work done. A row that ends early on its eos counts whole from
then: the estimate errs long, never short, by the tokens such rows did not need.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tqdm import tqdm

    from batchrun.engine import Sequence

# tqdm's default, less its own remaining time (of finished rows): ours is in the postfix
BAR_FORMAT = "{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}{postfix}]"


def rows_in_flight_done(sequences: Iterable[Sequence]) -> float:
    """The rows' worth of work the running sequences have done: each sample its share of its row (1/n) times
    the share of its own work done."""
    done = 0.0
    for seq in sequences:
        limit = seq.params.max_new_tokens
        if limit:
            share = len(seq.output_token_ids) / limit
        else:  # a scoring row generates nothing: its work is the prompt
            share = seq.num_computed_tokens / max(seq.num_prompt_tokens, 1)
        done += min(share, 1.0) / seq.params.n
    return done


def remaining_seconds(elapsed: float, total_rows: int | None, rows_done: float) -> float | None:
    """Seconds left at the pace so far: `rows_done` (finished rows plus rows_in_flight_done) in `elapsed`
    seconds, of `total_rows`; None while nothing is done or the total is unknown."""
    if total_rows is None or rows_done <= 0:
        return None
    return elapsed * max(total_rows - rows_done, 0.0) / rows_done


class RemainingTime:
    """Puts the remaining time (from the work done) in a row bar's postfix and redraws the bar, at most every
    `every_s` seconds and no more often than the bar itself redraws (its mininterval: 10 s into a log file): a
    bar whose rows all finish at the end is otherwise never redrawn before then. Its clock starts with it, and
    again at `restart()` (the job's, once the model has loaded)."""

    def __init__(self, bar: tqdm, every_s: float = 0.5, clock: Callable[[], float] = time.monotonic):
        self.bar, self.clock = bar, clock
        self.every_s = every_s if bar.disable else max(every_s, bar.mininterval)  # a disabled bar has none
        self.start = clock()
        self.shown_at = -float("inf")

    def restart(self) -> None:
        self.start = self.clock()

    def show(self, in_flight: Callable[[], float], detail: str = "") -> None:
        """`in_flight()`: rows_in_flight_done of the running sequences (asked only when the postfix is due);
        `detail`: what follows the remaining time in the postfix."""
        from tqdm import tqdm

        now = self.clock()
        if self.bar.disable or now - self.shown_at < self.every_s:
            return
        self.shown_at = now
        left = remaining_seconds(now - self.start, self.bar.total, self.bar.n + in_flight())
        eta = "ETA ?" if left is None else f"ETA {tqdm.format_interval(round(left))}"
        self.bar.set_postfix_str(f"{eta}, {detail}" if detail else eta)
