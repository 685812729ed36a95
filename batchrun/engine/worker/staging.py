"""Persistent host buffers a step's per-token inputs are staged in (after vLLM v1's `CpuGpuBuffer`): input ids,
positions, each token's place in its page and, per KV cache group, each token's page.

`prepare` writes a step's values into the first entries of each buffer (numpy assignments, no tensor made from
Python data) and hands on a slice: on the CPU the slice is the step's tensor itself, with no copy; on a GPU the
buffers are pinned and each slice is copied to the device asynchronously. A buffer grows (twice as long) when a
step has more tokens than any before: a step may pass `max_num_batched_tokens` (a prompt computed whole).

A pinned buffer must not be written while its last copy may still be in flight: a step whose tokens are all
mid-prompt samples nothing and reads nothing back, so the next step could be prepared before the device has
taken the copies. `begin` waits for the event recorded after the last step's copies (`end`), which the device
passed long since in every step that sampled.
"""

from __future__ import annotations

import numpy as np
import torch


class StagingBuffer:
    """One persistent 1-D host buffer of `dtype`, pinned where the device is CUDA."""

    def __init__(self, size: int, dtype: torch.dtype, device: torch.device):
        self.dtype, self.device = dtype, device
        self.pin = device.type == "cuda"
        self._make(size)

    def _make(self, size: int) -> None:
        self.host = torch.zeros(size, dtype=self.dtype, pin_memory=self.pin)
        self.array = self.host.numpy()  # the same memory

    def put(self, values: np.ndarray) -> torch.Tensor:
        """`values` in the buffer's first entries; the step's tensor of them on the device."""
        n = len(values)
        if n > len(self.array):
            self._make(max(n, 2 * len(self.array)))
        self.array[:n] = values
        view = self.host[:n]
        return view if self.device.type == "cpu" else view.to(self.device, non_blocking=True)


class StepStaging:
    """The runner's buffers for a step's tokens: `input_ids`, `positions`, `slot_offsets` and `slot_pages[g]`."""

    def __init__(self, num_groups: int, device: torch.device, size: int = 1024):
        self.device = device
        self.input_ids = StagingBuffer(size, torch.long, device)
        self.positions = StagingBuffer(size, torch.long, device)
        self.slot_offsets = StagingBuffer(size, torch.long, device)
        self.slot_pages = [StagingBuffer(size, torch.long, device) for _ in range(num_groups)]
        self._copied: torch.cuda.Event | None = None  # recorded after the last step's copies (CUDA only)

    def begin(self) -> None:
        """Before a step's values are written: the last step's copies have left the pinned buffers."""
        if self._copied is not None:
            self._copied.synchronize()
            self._copied = None

    def end(self) -> None:
        """After a step's copies are issued."""
        if self.device.type == "cuda":
            self._copied = torch.cuda.Event()
            self._copied.record()
