"""The host operations a step does at 256 running sequences, timed one by one: the greedy argmax over the
logits (torch's, torch's plain max for comparison, batchrun's C++ one) and integer tensors from Python lists
(`torch.tensor` against `attention.int_tensor`). The figures bench/RESULTS.md quotes.

    python -m bench.micro.host_ops
"""

from __future__ import annotations

import torch

from ..common import best_seconds, cpu_name


def best_us(fn, number: int = 50) -> float:
    return best_seconds(fn, repeat=5, number=number) * 1e6


def main() -> None:
    from batchrun.engine.attention import int_tensor, padded_int_tensor
    from batchrun.engine.cpu_kernels import load

    torch.set_num_threads(min(2, torch.get_num_threads()))
    kernel = load()
    assert kernel is not None, "the CPU kernels could not be built here"
    print(f"{cpu_name()}, {torch.get_num_threads()} threads; 256 rows x 49,152 logits")
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(256, 49152).to(dtype)
        assert torch.equal(kernel.argmax_rows(x), x.float().argmax(-1))
        print(
            f"{str(dtype):15} torch argmax (after .float()) {best_us(lambda x=x: x.float().argmax(-1)):8.0f} us, "
            f"torch amax {best_us(lambda x=x: x.amax(-1)):6.0f} us, "
            f"batchrun argmax_rows {best_us(lambda x=x: kernel.argmax_rows(x)):6.0f} us"
        )
    ints = list(range(1000, 1256))
    table = [list(range(i, i + 6)) for i in range(256)]
    print(
        f"256 ints: torch.tensor {best_us(lambda: torch.tensor(ints, dtype=torch.long), number=500):.1f} us, "
        f"int_tensor {best_us(lambda: int_tensor(ints), number=500):.1f} us"
    )
    print(
        f"256 x 6 block table: torch.tensor {best_us(lambda: torch.tensor(table, dtype=torch.int32), number=500):.1f}"
        f" us, padded_int_tensor {best_us(lambda: padded_int_tensor(table, 6, torch.int32), number=500):.1f} us"
    )


if __name__ == "__main__":
    main()
