"""Two grammar engines side by side on the embedded model's tokenizer: xgrammar and llguidance.

For a realistic extraction schema: the compile time (cold: no cache), and the time to fill the allowed-token
bitmask of 64 rows at every step of a valid JSON answer, per token per row (each engine's own batched fill).
batchrun keeps the faster (bench/RESULTS.md says which and why). Needs both installed:
`pip install xgrammar llguidance`.

Usage: python bench/grammar_engines.py [--rows 64] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import time

SCHEMA = {
    "type": "object",
    "properties": {
        "product": {"type": "string", "maxLength": 80},
        "brand": {"type": ["string", "null"]},
        "price": {"type": "number", "minimum": 0},
        "currency": {"enum": ["EUR", "USD", "GBP", "JPY"]},
        "in_stock": {"type": "boolean"},
        "categories": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
        "dimensions": {
            "type": "object",
            "properties": {
                "width_cm": {"type": "number"},
                "height_cm": {"type": "number"},
                "depth_cm": {"type": "number"},
            },
            "required": ["width_cm", "height_cm"],
            "additionalProperties": False,
        },
        "reviews": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "stars": {"type": "integer", "minimum": 1, "maximum": 5},
                    "text": {"type": "string"},
                },
                "required": ["stars", "text"],
                "additionalProperties": False,
            },
        },
    },
    "required": ["product", "price", "currency", "in_stock", "categories", "dimensions"],
    "additionalProperties": False,
}
ANSWER = {
    "product": "Oak writing desk",
    "brand": "Nordwood",
    "price": 349.5,
    "currency": "EUR",
    "in_stock": True,
    "categories": ["furniture", "office"],
    "dimensions": {"width_cm": 120, "height_cm": 75, "depth_cm": 60},
    "reviews": [{"stars": 5, "text": "Sturdy and handsome."}, {"stars": 4, "text": "Easy to assemble."}],
}


def bench_xgrammar(tok, vocab_size: int, token_ids: list[int], rows: int) -> dict:
    import torch
    import xgrammar as xgr

    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab_size)
    t0 = time.perf_counter()
    compiled = xgr.GrammarCompiler(info, cache_enabled=False).compile_json_schema(json.dumps(SCHEMA))
    compile_s = time.perf_counter() - t0
    matchers = [xgr.GrammarMatcher(compiled) for _ in range(rows)]
    batch = xgr.BatchGrammarMatcher()
    bitmask = xgr.allocate_token_bitmask(rows, vocab_size)
    logits = torch.zeros(rows, vocab_size)
    fill = apply = 0.0
    for token in token_ids:
        t = time.perf_counter()
        batch.batch_fill_next_token_bitmask(matchers, bitmask)
        fill += time.perf_counter() - t
        t = time.perf_counter()
        xgr.apply_token_bitmask_inplace(logits, bitmask)
        apply += time.perf_counter() - t
        for m in matchers:
            assert m.accept_token(token)
    return {"compile_s": compile_s, "fill_s": fill, "apply_s": apply}


def bench_llguidance(tok, vocab_size: int, token_ids: list[int], rows: int) -> dict:
    import llguidance
    import llguidance.hf
    import llguidance.torch
    import torch

    lltok = llguidance.hf.from_tokenizer(tok, n_vocab=vocab_size)
    t0 = time.perf_counter()
    grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(SCHEMA))
    matchers = [llguidance.LLMatcher(lltok, grammar) for _ in range(rows)]
    compile_s = (
        time.perf_counter() - t0
    )  # llguidance builds lazily: its "compile" is this plus the first masks
    executor = llguidance.LLExecutor()
    bitmask = llguidance.torch.allocate_token_bitmask(rows, vocab_size)
    logits = torch.zeros(rows, vocab_size)
    fill = apply = 0.0
    for token in token_ids:
        t = time.perf_counter()
        llguidance.torch.fill_next_token_bitmask_par(executor, list(zip(matchers, range(rows))), bitmask)
        fill += time.perf_counter() - t
        t = time.perf_counter()
        llguidance.torch.apply_token_bitmask_inplace(logits, bitmask)
        apply += time.perf_counter() - t
        for m in matchers:
            assert m.consume_token(token), m.get_error()
    return {"compile_s": compile_s, "fill_s": fill, "apply_s": apply}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    from transformers import AutoConfig, AutoTokenizer

    from batchrun.model_loader import resolve_model_dir

    model_dir = resolve_model_dir(None)
    tok = AutoTokenizer.from_pretrained(model_dir)
    vocab_size = AutoConfig.from_pretrained(model_dir).vocab_size
    token_ids = tok(json.dumps(ANSWER), add_special_tokens=False)["input_ids"]
    print(f"schema: {len(json.dumps(SCHEMA))} characters; answer: {len(token_ids)} tokens; {args.rows} rows")
    print("| engine | compile ms | mask fill µs per token per row | apply µs per step |")
    print("|---|---|---|---|")
    for name, fn in (("xgrammar", bench_xgrammar), ("llguidance", bench_llguidance)):
        runs = [fn(tok, vocab_size, token_ids, args.rows) for _ in range(args.repeats)]
        best = {k: min(r[k] for r in runs) for k in runs[0]}
        steps = len(token_ids)
        print(
            f"| {name} | {best['compile_s'] * 1e3:.1f} | {best['fill_s'] / steps / args.rows * 1e6:.1f} | "
            f"{best['apply_s'] / steps * 1e6:.0f} |"
        )


if __name__ == "__main__":
    main()
