"""Structured outputs: a response format compiled into a grammar, one matcher per sequence, and the allowed-token
mask applied to the logits of exactly the rows that ask, before sampling (greedy included).

The grammar engine is xgrammar (measured against llguidance on this machine, bench/RESULTS.md: it
compiled a realistic schema and filled masks faster). Compiled grammars are
cached by their canonical text. A sequence's matcher lives on the sequence, so it follows it through swap and
recompute preemption (the accepted tokens do not change) and each parallel sample gets its own.

Formats (OpenAI's shapes plus three): {type: text} | {type: json_object} | {type: json_schema, json_schema:
{name, schema, strict}} | {type: regex, regex} | {type: choice, choices: [...]} | {type: grammar, grammar: EBNF}.
JSON is compact (no free whitespace, `,` and `:` as separators), so a small model cannot wander off into blank
lines.
"""

from __future__ import annotations

import json
import time
from typing import Any

import numpy as np
import torch

COMPACT = (",", ":")  # JSON's separators, without the spaces xgrammar puts after them by default


class Grammars:
    """The engine's grammar compiler and cache (xgrammar), made on the first structured row."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: set[int]):
        import xgrammar as xgr

        self.xgr = xgr
        info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=sorted(stop_token_ids) or None
        )
        self.compiler = xgr.GrammarCompiler(info, max_threads=1)
        self.vocab_size = vocab_size
        self._cache: dict[str, Any] = {}
        self._bitmask: torch.Tensor | None = None
        self._batch = xgr.BatchGrammarMatcher(max_threads=1)
        self.compile_s = 0.0  # time spent compiling, and filling and applying masks (for the statistics)
        self.mask_s = 0.0

    def compile(self, rf: dict) -> Any:
        """The compiled grammar of a response format; ValueError saying why one does not compile."""
        key = json.dumps(rf, sort_keys=True)
        compiled = self._cache.get(key)
        if compiled is None:
            t0 = time.perf_counter()
            try:
                compiled = self._compile(rf)
            except Exception as e:  # the engine's own exception types vary by format
                reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
                raise ValueError(f"response_format {rf.get('type')!r} does not compile: {reason}") from None
            self.compile_s += time.perf_counter() - t0
            self._cache[key] = compiled
        return compiled

    def _compile(self, rf: dict) -> Any:
        kind = rf["type"]
        c = self.compiler
        if kind == "json_object":
            return c.compile_json_schema('{"type": "object"}', any_whitespace=False, separators=COMPACT)
        if kind == "json_schema":
            spec = rf["json_schema"]
            strict = bool(spec.get("strict", False))
            return c.compile_json_schema(
                json.dumps(spec["schema"]), any_whitespace=False, separators=COMPACT, strict_mode=strict
            )
        if kind == "regex":
            return c.compile_regex(rf["regex"])
        if kind == "choice":
            alternatives = " | ".join(json.dumps(choice, ensure_ascii=False) for choice in rf["choices"])
            return c.compile_grammar(f"root ::= {alternatives}")
        if kind == "grammar":
            return c.compile_grammar(rf["grammar"])
        raise ValueError(f"unknown response_format type {kind!r}")

    def matcher(self, rf: dict, accepted: list[int] = ()) -> Any:
        """A fresh matcher for one sequence, past the tokens it has `accepted` already."""
        m = self.xgr.GrammarMatcher(self.compile(rf))
        for token in accepted:
            m.accept_token(token)
        return m

    def apply(self, logits: torch.Tensor, matchers: list[Any]) -> None:
        """Mask in place the logits rows whose matcher is not None: disallowed tokens get -inf. The rows'
        bitmasks are filled in one batched call, then unpacked and applied at once."""
        t0 = time.perf_counter()
        rows = [i for i, m in enumerate(matchers) if m is not None]
        words = (self.vocab_size + 31) // 32
        if self._bitmask is None or self._bitmask.shape[0] < len(rows):
            self._bitmask = torch.empty(max(len(rows), 64), words, dtype=torch.int32)
        bitmask = self._bitmask[: len(rows)]
        self._batch.batch_fill_next_token_bitmask([matchers[i] for i in rows], bitmask)
        # bit b of word w allows token 32 w + b (little-endian words: byte 4 w + b // 8, bit b % 8)
        bits = np.unpackbits(bitmask.numpy().view(np.uint8), axis=1, bitorder="little")
        allowed = torch.from_numpy(bits[:, : logits.shape[-1]]).to(logits.device, torch.bool)
        index = torch.tensor(rows, device=logits.device)
        logits[index] = logits[index].masked_fill(~allowed, float("-inf"))
        self.mask_s += time.perf_counter() - t0
