"""Ways to add four LoRA adapters' products to one layer's output, on the shapes of SmolLM2-135M's seven adapted
linear layers (q, k, v, o, gate, up, down; rank 16), at 15 to 2,048 tokens split evenly over the four adapters,
each adapter's tokens one slice (as the scheduler orders them):

- sliced: per adapter, A on its slice, B, then an add (engine/model/lora/layers.py before the addmm_);
- sliced_addmm: per adapter, A on its slice, then B and the add as one addmm_ (engine/model/lora/layers.py now);
- masked: every adapter's A at once on all tokens, a mask zeroing each token's other adapters, every B at once.

Microseconds per layer (the seven products), mean of 300 calls after 20, in this process; bench/RESULTS.md
(issue 52).

Usage: OMP_NUM_THREADS=1 python -m bench.micro.lora_products
"""

from __future__ import annotations

import time

import torch

F = torch.nn.functional
SHAPES = [(576, 576), (576, 192), (576, 192), (576, 576), (576, 1536), (576, 1536), (1536, 576)]
ADAPTERS, RANK = 4, 16


def mean_us(f, n: int = 300) -> float:
    for _ in range(20):
        f()
    t = time.perf_counter()
    for _ in range(n):
        f()
    return (time.perf_counter() - t) / n * 1e6


def ways(tokens: int, n_in: int, n_out: int) -> dict:
    gen = torch.Generator().manual_seed(0)
    x, out = torch.randn(tokens, n_in, generator=gen), torch.randn(tokens, n_out, generator=gen)
    a = [torch.randn(RANK, n_in, generator=gen) for _ in range(ADAPTERS)]
    b = [torch.randn(n_out, RANK, generator=gen) for _ in range(ADAPTERS)]
    rows = [slice(g * tokens // ADAPTERS, (g + 1) * tokens // ADAPTERS) for g in range(ADAPTERS)]
    a_all, b_all = torch.cat(a), torch.cat(b, 1)
    mask = torch.zeros(tokens, ADAPTERS * RANK)
    for g, r in enumerate(rows):
        mask[r, g * RANK : (g + 1) * RANK] = 1

    def sliced():
        for r, ag, bg in zip(rows, a, b):
            out[r].add_(F.linear(F.linear(x[r], ag), bg))

    def sliced_addmm():
        for r, ag, bg in zip(rows, a, b):
            out[r].addmm_(F.linear(x[r], ag), bg.t())

    def masked():
        out.add_(F.linear(F.linear(x, a_all).mul_(mask), b_all))

    return {"sliced": sliced, "sliced_addmm": sliced_addmm, "masked": masked}


def main() -> None:
    print(f"threads {torch.get_num_threads()}; us per layer of {len(SHAPES)} products, {ADAPTERS} adapters")
    for tokens in (15, 60, 512, 2048):
        total: dict[str, float] = {}
        for n_in, n_out in SHAPES:
            for name, f in ways(tokens, n_in, n_out).items():
                total[name] = total.get(name, 0.0) + mean_us(f)
        print(f"{tokens:5d} tokens: " + ", ".join(f"{k} {v:.0f}" for k, v in total.items()), flush=True)


if __name__ == "__main__":
    main()
