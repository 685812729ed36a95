"""The rewrites that make a model's layers fast on the CPU (fused element-wise work, packed linears, rotary,
the residual adds, the decoder stack) and per-sequence RoPE; their C++ is in engine/csrc/."""
