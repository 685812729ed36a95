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
import re
import time
from typing import Any

import torch

COMPACT = (",", ":")  # JSON's separators, without the spaces xgrammar puts after them by default

# JSON-schema keywords xgrammar 0.2 compiles without enforcing (a grammar that accepts an instance they
# forbid; tests/test_structured.py asks xgrammar itself). A schema using one is refused, never served unchecked.
UNENFORCED = {
    "uniqueItems": "uniqueItems: true (items are not checked for duplicates)",
    "contains": "contains (no item is required to match)",
    "minContains": "minContains",
    "maxContains": "maxContains",
    "not": "not",
    "if": "if/then/else",
    "then": "if/then/else",
    "else": "if/then/else",
    "dependentRequired": "dependentRequired",
    "dependentSchemas": "dependentSchemas",
    "dependencies": "dependencies",
    "$dynamicRef": "$dynamicRef",
    "$recursiveRef": "$recursiveRef",
}
# the string formats xgrammar turns into a grammar; any other format would be an unchecked string
FORMATS = {
    "email", "date", "time", "date-time", "duration", "uri", "uri-reference", "uuid", "ipv4", "ipv6",
    "hostname", "json-pointer",
}  # fmt: skip
# keywords that need the node's `type` to be enforced (without it xgrammar takes any JSON value); the ones that
# make a node an object or an array by themselves (properties, items, ...) are not among them
NEEDS_TYPE = {
    "minLength", "maxLength", "pattern", "format", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum",
    "multipleOf", "minItems", "maxItems", "minProperties", "maxProperties",
}  # fmt: skip
_SHAPE = ("properties", "additionalProperties", "patternProperties", "items", "prefixItems")
_LOG_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")  # "[11:20:45] /project/cpp/x.cc:5082: " of a C++ log line


def unenforced_feature(schema: Any, path: str = "#") -> str | None:
    """Where (a JSON pointer) and what the first feature of a JSON schema is that the grammar engine would
    compile without enforcing, or None when every keyword it uses is enforced."""
    if not isinstance(schema, dict):
        if isinstance(schema, list):
            for i, sub in enumerate(schema):
                found = unenforced_feature(sub, f"{path}/{i}")
                if found:
                    return found
        return None
    for key, value in schema.items():
        if key in UNENFORCED and not (key == "uniqueItems" and value is False):
            return f"{path}: {UNENFORCED[key]}"
    ref = schema.get("$ref")
    if isinstance(ref, str) and not ref.startswith("#"):
        return f"{path}: $ref {ref!r} (only references inside the schema, '#/...', are resolved)"
    fmt = schema.get("format")
    if isinstance(fmt, str) and fmt not in FORMATS:
        return f"{path}: format {fmt!r} (enforced formats: {', '.join(sorted(FORMATS))})"
    types = schema.get("type")
    types = [types] if isinstance(types, str) else types or []
    if not types and not any(k in schema for k in _SHAPE):
        loose = sorted(k for k in NEEDS_TYPE if k in schema)
        if loose:
            return f"{path}: {loose[0]} without a `type` (say which type it constrains)"
    if "multipleOf" in schema and "number" in types:
        return f"{path}: multipleOf on a number (enforced on integers only)"
    all_of = schema.get("allOf")
    if isinstance(all_of, list) and len(all_of) > 1:
        return f"{path}: allOf with {len(all_of)} schemas (only one is enforced)"
    one_of = schema.get("oneOf")
    if isinstance(one_of, list) and len(one_of) > 1 and not _disjoint(one_of):
        return (
            f"{path}: oneOf whose schemas may overlap (it is enforced as anyOf: give each a different type "
            "or a const/enum discriminator property)"
        )
    for key, value in schema.items():
        if key in ("const", "enum", "default", "examples"):
            continue  # values, not schemas
        if key in ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas"):
            subs = value.items() if isinstance(value, dict) else []
            for name, sub in subs:
                found = unenforced_feature(sub, f"{path}/{key}/{name}")
                if found:
                    return found
        elif isinstance(value, dict | list):
            found = unenforced_feature(value, f"{path}/{key}")
            if found:
                return found
    return None


def _disjoint(branches: list) -> bool:
    """Whether no JSON value can match two of these schemas: each of another single type, or objects that all
    require one property whose allowed values (const / enum) do not overlap."""
    types = [b.get("type") if isinstance(b, dict) else None for b in branches]
    if all(isinstance(t, str) for t in types) and len(set(types)) == len(types):
        return len({"number" if t == "integer" else t for t in types}) == len(types)
    if not all(isinstance(b, dict) and isinstance(b.get("properties"), dict) for b in branches):
        return False
    common = set.intersection(*(set(b.get("required", [])) for b in branches))
    for name in common:
        allowed = [_values(b["properties"].get(name)) for b in branches]
        if all(v is not None for v in allowed):
            seen: list = []
            if all(not any(x in seen for x in v) and not seen.extend(v) for v in allowed):
                return True
    return False


def _values(schema: Any) -> list | None:
    if not isinstance(schema, dict):
        return None
    if "const" in schema:
        return [schema["const"]]
    return schema["enum"] if isinstance(schema.get("enum"), list) else None


def check_format(rf: dict) -> None:
    """Compile a response format without a tokenizer (the grammar alone), before any model loads; ValueError
    saying why one would not compile or would compile without enforcing all of it."""
    import xgrammar as xgr

    _check_enforced(rf)
    try:
        g = xgr.Grammar
        _build(rf, g.from_json_schema, g.from_regex, g.from_ebnf)
    except Exception as e:
        raise ValueError(f"response_format {rf.get('type')!r} does not compile: {_reason(e)}") from None


def _check_enforced(rf: dict) -> None:
    if rf.get("type") == "json_schema":
        found = unenforced_feature(rf["json_schema"]["schema"])
        if found:
            raise ValueError(
                f"response_format json_schema uses a feature the grammar engine does not enforce: {found}"
            )


def _reason(e: Exception) -> str:
    """The first line of a grammar engine's error, without the C++ log prefix."""
    text = str(e).strip()
    return _LOG_PREFIX.sub("", text.splitlines()[0]) if text else type(e).__name__


def _build(rf: dict, json_schema, regex, ebnf) -> Any:
    """A response format through the grammar engine's three ways in: xgrammar's GrammarCompiler's (compiled
    for a tokenizer) or its Grammar class's (the grammar alone, checked before any model loads)."""
    kind = rf["type"]
    if kind == "json_object":
        return json_schema('{"type": "object"}', any_whitespace=False, separators=COMPACT)
    if kind == "json_schema":
        spec = rf["json_schema"]
        strict = bool(spec.get("strict", False))
        return json_schema(
            json.dumps(spec["schema"]), any_whitespace=False, separators=COMPACT, strict_mode=strict
        )
    if kind == "regex":
        return regex(rf["regex"])
    if kind == "choice":
        return ebnf(
            "root ::= " + " | ".join(json.dumps(choice, ensure_ascii=False) for choice in rf["choices"])
        )
    if kind == "grammar":
        return ebnf(rf["grammar"])
    raise ValueError(f"unknown response_format type {kind!r}")


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
            _check_enforced(rf)
            c = self.compiler
            try:
                compiled = _build(rf, c.compile_json_schema, c.compile_regex, c.compile_grammar)
            except Exception as e:  # the engine's own exception types vary by format
                raise ValueError(
                    f"response_format {rf.get('type')!r} does not compile: {_reason(e)}"
                ) from None
            self.compile_s += time.perf_counter() - t0
            self._cache[key] = compiled
        return compiled

    def matcher(self, rf: dict, accepted: list[int] = ()) -> Any:
        """A fresh matcher for one sequence, past the tokens it has `accepted` already."""
        m = self.xgr.GrammarMatcher(self.compile(rf))
        for token in accepted:
            m.accept_token(token)
        return m

    def apply(self, logits: torch.Tensor, matchers: list[Any]) -> None:
        """Mask in place the logits rows whose matcher is not None: disallowed tokens get -inf. The rows'
        bitmasks (a bit a token, 32 tokens an int32 word) are filled in one batched call on the host, and only
        they go to the logits' device, where xgrammar's own kernel applies them: no [rows, vocab] mask is
        unpacked on the host or copied over."""
        t0 = time.perf_counter()
        rows = [i for i, m in enumerate(matchers) if m is not None]
        words = (self.vocab_size + 31) // 32
        if self._bitmask is None or self._bitmask.shape[0] < len(matchers):
            self._bitmask = torch.empty(max(len(matchers), 64), words, dtype=torch.int32)
        bitmask = self._bitmask[: len(matchers)]
        self._batch.batch_fill_next_token_bitmask([matchers[i] for i in rows], bitmask, indices=rows)
        self.xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device), indices=rows)
        self.mask_s += time.perf_counter() - t0
