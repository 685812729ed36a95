"""What the engine decides each step, with no tensors: the requests, the scheduler's plan, and the cache's
bookkeeping (pages, prefix sharing, state slots, swap) under one coordinator."""
