"""`batchrun simulate`: replay a workload's lengths through KV allocators and measure where memory goes.

The model of time is the one that matters for memory: every request is queued at the start (a batch job);
each step admits waiting requests first-come first-served while the allocator can place them, then every
running request stores one more token; a request leaves when it has its output. Compute is not modelled.

Each step's KV budget (in token slots) is split into: slots holding tokens (each distinct token once),
`reserved` (held for tokens a request will still generate), `internal` (held and never used: the unused tail
of a reservation or of a sequence's last page), `external` (free slots in gaps too small for the request at the
head of the queue), `duplication` (extra copies of a prompt prefix that several requests share) and `free`.
Shares are averaged over the steps in which a request was waiting, when memory is what limits the job.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from batchrun.engine.core.page_pool import cdiv

from . import storage
from .errors import BadInput


class Request(NamedTuple):
    prompt: int
    output: int


SHARES = ("tokens", "reserved", "internal", "external", "duplication", "free", "state")  # of the budget


class Result(NamedTuple):
    allocator: str
    tokens: float
    reserved: float
    internal: float
    external: float
    duplication: float
    free: float
    state: (
        float  # a hybrid model's fixed state per running sequence (--state-slots), its pages' padding aside
    )
    peak_concurrency: int
    mean_concurrency: float
    steps: int
    rejected: int
    delayed: int  # requests that had to wait (admitted after step 0) or were preempted
    preemptions: int


def random_workload(n: int, prompt: tuple[int, int], output: tuple[int, int], seed: int = 0) -> list[Request]:
    rng = random.Random(seed)
    return [Request(rng.randint(*prompt), rng.randint(*output)) for _ in range(n)]


def load_workload(path: Path) -> list[Request]:
    """Lengths from a completions directory / part file or a Parquet with prompt_tokens, completion_tokens."""
    path = storage.fresh(path)
    if not path.exists():
        raise BadInput(f"--from {path}: no such file or directory.")
    files = sorted(path.glob("*.parquet")) if path.is_dir() else [path]
    reqs = []
    for f in files:
        try:
            part = storage.parquet_file(f)
            cols = part.schema_arrow.names
        except Exception as e:
            raise BadInput(f"--from {f}: not a readable Parquet file ({e}).") from None
        if "prompt_tokens" not in cols or "completion_tokens" not in cols:
            continue  # e.g. stats.parquet beside the parts
        t = part.read(columns=["prompt_tokens", "completion_tokens"]).to_pydict()
        reqs += [Request(p, max(1, c)) for p, c in zip(t["prompt_tokens"], t["completion_tokens"]) if p]
    if not reqs:
        raise BadInput(f"--from {path}: no rows with prompt_tokens and completion_tokens columns.")
    return reqs


@dataclass
class _Live:
    req: Request
    generated: int = 0
    start: int = 0  # contiguous: first slot of the reservation
    size: int = 0  # contiguous: slots reserved
    pages: int = 0  # paged: private pages held (its state's included)


class _Allocator:
    """One allocator's admission and growth rules; the step loop is shared."""

    name = ""

    def __init__(self, budget: int, state: int = 0):
        self.budget = budget
        self.state = state  # slots of a hybrid's fixed per-sequence state, held while a request runs

    def need(self, r: Request) -> int:  # slots a request needs to be admitted; > budget means never
        raise NotImplementedError

    def admit(self, live: _Live) -> bool:
        raise NotImplementedError

    def grow(self, live: _Live) -> bool:  # room for one more token; False = must preempt
        return True

    def release(self, live: _Live) -> None:
        raise NotImplementedError

    def account(self, running: list[_Live], head: Request | None) -> dict:
        raise NotImplementedError


class _Contiguous(_Allocator):
    """A contiguous reservation per request, placed first-fit in one address range."""

    def __init__(self, budget: int, reserve_output: int | None, shared_prefix: int, state: int = 0):
        super().__init__(budget, state)
        self.reserve_output = reserve_output  # None: the exact output length (an oracle)
        self.shared_prefix = shared_prefix
        self.name = (
            "contiguous max-length" if reserve_output is not None else "contiguous exact-size first-fit"
        )
        self.segments: list[tuple[int, int]] = []  # taken (start, size), sorted

    def need(self, r: Request) -> int:
        return r.prompt + (self.reserve_output if self.reserve_output is not None else r.output) + self.state

    def _gaps(self) -> list[tuple[int, int]]:
        gaps, pos = [], 0
        for start, size in self.segments:
            if start > pos:
                gaps.append((pos, start - pos))
            pos = start + size
        if pos < self.budget:
            gaps.append((pos, self.budget - pos))
        return gaps

    def admit(self, live: _Live) -> bool:
        size = self.need(live.req)
        for start, gap in self._gaps():
            if gap >= size:
                live.start, live.size = start, size
                self.segments.append((start, size))
                self.segments.sort()
                return True
        return False

    def release(self, live: _Live) -> None:
        self.segments.remove((live.start, live.size))

    def account(self, running: list[_Live], head: Request | None) -> dict:
        held = sum(lv.size for lv in running)
        stored = sum(lv.req.prompt + lv.generated for lv in running)
        future = sum(lv.req.output - lv.generated for lv in running)
        dup = max(0, len(running) - 1) * self.shared_prefix
        gaps = self._gaps()
        external = sum(g for _, g in gaps if head is not None and g < self.need(head))
        state = self.state * len(running)
        return {
            "tokens": stored - dup,
            "duplication": dup,
            "reserved": future,
            "internal": held - stored - future - state,
            "external": external,
            "free": self.budget - held - external,
            "state": state,
        }


class _Paged(_Allocator):
    """Fixed pages; a request takes pages as its tokens arrive; with prefix sharing, the full pages of the common
    prefix are stored once for everyone."""

    def __init__(self, budget: int, page_size: int, shared_prefix: int, sharing: bool, state: int = 0):
        super().__init__(budget, state)
        self.P = page_size
        self.state_pages = cdiv(state, page_size)  # pages of the state (a hybrid's slot, in the same budget)
        self.num_pages = budget // page_size
        self.shared_pages = shared_prefix // page_size if sharing else 0
        self.shared_prefix = shared_prefix
        self.sharing = sharing
        self.used = 0
        self.shared_in_use = False
        self.name = f"paged P={page_size}" + (
            f" + prefix sharing ({shared_prefix} tokens)" if sharing else ""
        )

    def _private_tokens(self, lv_tokens: int) -> int:
        return lv_tokens - self.shared_pages * self.P

    def need(self, r: Request) -> int:
        return (cdiv(r.prompt + r.output, self.P) + self.state_pages) * self.P

    def _pages_for(self, tokens: int) -> int:
        return cdiv(self._private_tokens(tokens), self.P) + self.state_pages

    def admit(self, live: _Live) -> bool:
        pages = self._pages_for(live.req.prompt + live.generated)
        extra = self.shared_pages if (self.shared_pages and not self.shared_in_use) else 0
        if self.used + pages + extra > self.num_pages:
            return False
        self.used += pages + extra
        self.shared_in_use = self.shared_in_use or bool(extra)
        live.pages = pages
        return True

    def grow(self, live: _Live) -> bool:
        pages = self._pages_for(live.req.prompt + live.generated + 1)
        if pages > live.pages:
            if self.used + 1 > self.num_pages:
                return False
            self.used += 1
            live.pages = pages
        return True

    def release(self, live: _Live) -> None:
        self.used -= live.pages
        live.pages = 0

    def settle(self, running: list[_Live]) -> None:
        if self.shared_in_use and not running:
            self.used -= self.shared_pages
            self.shared_in_use = False

    def account(self, running: list[_Live], head: Request | None) -> dict:
        P = self.P
        k = len(running)
        stored = sum(lv.req.prompt + lv.generated for lv in running)
        once = self.shared_pages * P  # prefix tokens in shared pages: stored once however many use them
        distinct = stored - max(0, k - 1) * once
        dup = max(0, k - 1) * (self.shared_prefix - once)  # the part of the prefix in unshared pages
        held = self.used * P
        state = self.state * k
        return {
            "tokens": distinct - dup,
            "duplication": dup,
            "reserved": 0,
            "internal": held - distinct - state,
            "external": 0,
            "free": self.budget - held,
            "state": state,
        }


def simulate_one(alloc: _Allocator, workload: list[Request]) -> Result:
    waiting = [r for r in workload if alloc.need(r) <= alloc.budget]
    rejected = len(workload) - len(waiting)
    queue = [_Live(r) for r in waiting]
    running: list[_Live] = []
    shares = {k: 0.0 for k in SHARES}
    saturated = steps = peak = preemptions = 0
    conc_sum = 0
    delayed: set[int] = set()
    while queue or running:
        while queue and alloc.admit(queue[0]):
            running.append(queue.pop(0))
        for lv in queue:
            if steps > 0 or lv.generated:
                delayed.add(id(lv))
        if not running:
            raise RuntimeError(f"{alloc.name}: a request does not fit an empty pool")
        # every running request stores one more token; a paged pool may have to preempt (recompute)
        i = 0
        while i < len(running):
            lv = running[i]
            while not alloc.grow(lv):
                victim = running.pop()
                alloc.release(victim)
                queue.insert(0, victim)
                delayed.add(id(victim))
                preemptions += 1
                if victim is lv:
                    break
            else:
                lv.generated += 1
                i += 1
        peak = max(peak, len(running))
        conc_sum += len(running)
        steps += 1
        head = queue[0].req if queue else None
        if head is not None:
            acc = alloc.account(running, head)
            for k in shares:
                shares[k] += acc[k] / alloc.budget
            saturated += 1
        done = [lv for lv in running if lv.generated >= lv.req.output]
        for lv in done:
            running.remove(lv)
            alloc.release(lv)
        if isinstance(alloc, _Paged):
            alloc.settle(running)
    n = saturated or 1
    return Result(
        alloc.name,
        *(shares[k] / n for k in SHARES),
        peak,
        conc_sum / max(steps, 1),
        steps,
        rejected,
        len(delayed),
        preemptions,
    )


def run_all(
    workload: list[Request],
    budget: int,
    max_new_tokens: int | None,
    page_sizes: list[int],
    shared_prefix: int = 0,
    state: int = 0,
) -> list[Result]:
    """Every allocator over the same workload; `shared_prefix` tokens common to all requests are put before each
    prompt; `state`: slots a hybrid model's fixed state takes per running request (0: attention alone)."""
    reserve = max_new_tokens if max_new_tokens is not None else max(r.output for r in workload)
    workload = [Request(shared_prefix + r.prompt, min(r.output, reserve)) for r in workload]
    allocators: list[_Allocator] = [
        _Contiguous(budget, reserve, shared_prefix, state),
        _Contiguous(budget, None, shared_prefix, state),
    ]
    allocators += [_Paged(budget, p, shared_prefix, sharing=False, state=state) for p in page_sizes]
    if shared_prefix:
        allocators.append(_Paged(budget, 16, shared_prefix, sharing=True, state=state))
    return [simulate_one(a, workload) for a in allocators]


def format_table(
    results: list[Result], workload: list[Request], budget: int, shared_prefix: int = 0, state: int = 0
) -> str:
    workload = [Request(shared_prefix + r.prompt, r.output) for r in workload]
    n = len(workload)
    mean_p = sum(r.prompt for r in workload) / n
    mean_o = sum(r.output for r in workload) / n
    head = (
        f"{n} requests, prompt mean {mean_p:.0f} tokens, output mean {mean_o:.0f} tokens, "
        f"KV budget {budget} token slots"
        + (f", a state of {state} slots per running request (a hybrid model)" if state else "")
        + ". Shares of the budget, averaged over steps with a request waiting.\n"
    )
    cols = [
        "allocator",
        "tokens",
        "reserved",
        "internal",
        "external",
        "dup",
        "free",
        *(["state"] if state else []),
        "peak",
        "mean",
        "steps",
        "rejected",
        "delayed",
    ]
    rows = [
        [
            r.allocator,
            f"{r.tokens:.1%}",
            f"{r.reserved:.1%}",
            f"{r.internal:.1%}",
            f"{r.external:.1%}",
            f"{r.duplication:.1%}",
            f"{r.free:.1%}",
            *([f"{r.state:.1%}"] if state else []),
            str(r.peak_concurrency),
            f"{r.mean_concurrency:.1f}",
            str(r.steps),
            str(r.rejected),
            str(r.delayed),
        ]
        for r in results
    ]
    widths = [max(len(c), *(len(row[i]) for row in rows)) for i, c in enumerate(cols)]
    fmt = lambda row: "  ".join(
        v.ljust(w) if i == 0 else v.rjust(w) for i, (v, w) in enumerate(zip(row, widths))
    )
    return head + "\n".join([fmt(cols), fmt(["-" * w for w in widths])] + [fmt(r) for r in rows])
