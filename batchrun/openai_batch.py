"""OpenAI Batch API files: the request JSONL batchrun reads, and the output JSONL it writes.

A request line is `{"custom_id", "method": "POST", "url": "/v1/chat/completions" | "/v1/completions",
"body": {...}}` in a generation job, `"url": "/v1/embeddings"` with `body.input` one text in a task embed job. The
body's sampling fields map onto the job's `sampling:` keys (`max_tokens` -> `max_new_tokens`, `logprobs` +
`top_logprobs` -> `logprobs`, ...); `model` names the base model or an adapter (config.ModelSpec.adapter_named)
and the reply names what answered. A line that cannot be served (not JSON, no custom_id, an unknown url, a body
without messages or prompt, a `model` that is neither the base model nor an adapter, a field batchrun cannot
honour) becomes an error line in the output; the job goes on.

An output line is `{"id", "custom_id", "response": {"status_code": 200, "request_id", "body": <chat.completion,
text_completion, or an embeddings list>}, "error": null}`, or `"response": null, "error": {"code", "message"}` for a failed request.
"""

from __future__ import annotations

import json
import time
from typing import Any

CHAT_URL = "/v1/chat/completions"
COMPLETIONS_URL = "/v1/completions"
EMBEDDINGS_URL = "/v1/embeddings"
# the urls a job of each task serves (config.py allows an OpenAI batch input to these tasks alone)
SERVED_URLS = {"generate": (CHAT_URL, COMPLETIONS_URL), "embed": (EMBEDDINGS_URL,)}

# body field -> sampling key, for the fields that map one to one
_SAME = ("temperature", "top_p", "n", "seed", "top_k", "ignore_eos", "response_format")
# fields whose presence with anything but their neutral value batchrun cannot honour
_UNSUPPORTED = {
    "frequency_penalty": 0,
    "presence_penalty": 0,
    "logit_bias": None,
    "tools": None,
    "functions": None,
    "tool_choice": None,
    "stream": False,
    "best_of": None,
    "echo": False,
    "suffix": None,
}


class BadRequest(ValueError):
    """A request line that cannot be served: it becomes an error line."""


def line_key(index: int) -> str:
    """The row id of a line without a usable custom_id (its 1-based line number)."""
    return f"line {index + 1}"


def parse_line(text: str, index: int, task: str = "generate") -> tuple[Any, dict]:
    """(custom_id or the line's key, request) from one input line of a `task` job; the request is {} and
    custom_id the line key when the line is not even an object with a custom_id. Never raises: errors go into
    request["error"] (the caller says which file and line)."""
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        return line_key(index), {"error": f"not JSON ({e.msg} at column {e.colno})"}
    if not isinstance(obj, dict):
        return line_key(index), {"error": "not a JSON object"}
    custom_id = obj.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        return line_key(index), {"error": "no custom_id (a non-empty string)"}
    try:
        return custom_id, parse_request(obj, task)
    except BadRequest as e:
        return custom_id, {"custom_id": custom_id, "error": str(e)}


def parse_request(obj: dict, task: str = "generate") -> dict:
    """{custom_id, endpoint: chat|completion|embeddings, prompt, model, sampling: {key: value}} from a request
    object of a `task` job."""
    url = obj.get("url")
    served = SERVED_URLS[task]
    if url not in served:
        raise BadRequest(f"url {url!r} is not served by a task {task} job; expected {' or '.join(served)}")
    if obj.get("method", "POST") != "POST":
        raise BadRequest(f"method {obj.get('method')!r}: only POST is served")
    body = obj.get("body")
    if not isinstance(body, dict):
        raise BadRequest("body is missing or not a JSON object")
    if url == EMBEDDINGS_URL:
        return _embeddings_request(obj, body)
    chat = url == CHAT_URL
    if chat:
        prompt = body.get("messages")
        if not isinstance(prompt, list) or not prompt:
            raise BadRequest("body.messages is missing or empty (a chat completion needs messages)")
    else:
        prompt = body.get("prompt")
        if not isinstance(prompt, str):
            raise BadRequest(
                "body.prompt is missing or not a string (batchrun serves one prompt per request)"
            )
    for key, neutral in _UNSUPPORTED.items():
        if key in body and body[key] not in (neutral, None, [], {}):
            raise BadRequest(f"body.{key} is not supported by batchrun")
    sampling: dict[str, Any] = {k: body[k] for k in _SAME if body.get(k) is not None}
    fields = {k: k for k in sampling}  # sampling key -> the body field it came from (for error messages)
    limit_field = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    if body.get(limit_field) is not None:
        sampling["max_new_tokens"], fields["max_new_tokens"] = body[limit_field], limit_field
    stop = body.get("stop")
    if stop is not None:
        sampling["stop"], fields["stop"] = ([stop] if isinstance(stop, str) else stop), "stop"
    logprobs = body.get("logprobs")
    if chat:
        if logprobs:
            sampling["logprobs"] = body.get("top_logprobs") or 0
            fields["logprobs"] = "top_logprobs"
        elif body.get("top_logprobs"):
            raise BadRequest("body.top_logprobs needs body.logprobs: true")
    elif logprobs is not None and logprobs is not False:
        sampling["logprobs"], fields["logprobs"] = logprobs, "logprobs"
    return {
        "custom_id": obj["custom_id"],
        "endpoint": "chat" if chat else "completion",
        "prompt": prompt,
        "model": body.get("model"),
        "sampling": sampling,
        "fields": fields,
    }


def _embeddings_request(obj: dict, body: dict) -> dict:
    """An embeddings request: one text (`input`: a string, or a list of one), as the job's pooler embeds it."""
    text = body.get("input")
    if isinstance(text, list) and len(text) == 1:
        text = text[0]
    if not isinstance(text, str):
        raise BadRequest(
            "body.input is missing or not a string (batchrun serves one text per request, as a string or a list "
            "of one)"
        )
    if not text:
        raise BadRequest("body.input is an empty string (OpenAI's embeddings endpoint refuses one)")
    if body.get("encoding_format", "float") != "float":
        raise BadRequest(f"body.encoding_format {body['encoding_format']!r}: only float is served")
    if body.get("dimensions") is not None:
        raise BadRequest("body.dimensions is not served per request: the job's pooler.dimensions sets it")
    return {
        "custom_id": obj["custom_id"],
        "endpoint": "embeddings",
        "prompt": text,
        "model": body.get("model"),
        "sampling": {},
        "fields": {},
    }


# ---- output --------------------------------------------------------------------------------------------------
def request_id(fingerprint: str, index: int, input_hash: str | None, weights: str | None = None) -> str:
    """An output line's id: the job, the input line's content hash (how a rerun tells that the line changed), the
    tag of the weights that answered it (weights.py: how a rerun tells that they changed) and its index."""
    return f"batch_req_{fingerprint[:12]}_{input_hash or 'x'}_{weights or 'x'}_{index}"


def parse_request_id(value: str) -> tuple[str | None, str | None, int | None]:
    """(input hash, weights tag, index) of an output line's id; a hash or tag is None in lines written before it
    was kept."""
    parts = value.split("_") if isinstance(value, str) else []
    try:
        index = int(parts[-1])
    except (IndexError, ValueError):
        return None, None, None
    known = [None if p == "x" else p for p in parts[3:-1]]  # [hash] before tags were kept, [hash, tag] since
    return (known[0] if known else None), (known[1] if len(known) == 2 else None), index


def error_line(req_id: str, custom_id: str | None, message: str) -> dict:
    return {
        "id": req_id,
        "custom_id": custom_id,
        "response": None,
        "error": {"code": "invalid_request", "message": message},
    }


def _finish_reason(reason: str) -> str:
    return "length" if reason == "length" else "stop"  # eos and stop strings are both "stop" to OpenAI


def _token_bytes(token: str) -> list[int]:
    return list(token.encode("utf-8"))


def chat_logprobs(entries: list[dict]) -> dict:
    return {
        "content": [
            {
                "token": e["token"],
                "logprob": e["logprob"],
                "bytes": _token_bytes(e["token"]),
                "top_logprobs": [
                    {"token": t["token"], "logprob": t["logprob"], "bytes": _token_bytes(t["token"])}
                    for t in e["top"]
                ],
            }
            for e in entries
        ]
    }


def completion_logprobs(entries: list[dict]) -> dict:
    offsets, at = [], 0
    for e in entries:
        offsets.append(at)
        at += len(e["token"])
    return {
        "tokens": [e["token"] for e in entries],
        "token_logprobs": [e["logprob"] for e in entries],
        "top_logprobs": [{t["token"]: t["logprob"] for t in e["top"]} for e in entries],
        "text_offset": offsets,
    }


def response_line(req_id: str, request: dict, samples: list, prompt_tokens: int, model: str) -> dict:
    """The output line of a served request; `samples` are the row's OutputRows, sample 0 first; `model`: the
    name of what answered (the base model's or the adapter's)."""
    if request["endpoint"] == "embeddings":
        body = {
            "object": "list",
            "data": [{"object": "embedding", "index": 0, "embedding": samples[0].embedding}],
            "model": model,
            "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens},
        }
        return _served(req_id, request, body)
    chat = request["endpoint"] == "chat"
    choices = []
    for s in samples:
        choice: dict[str, Any] = {"index": s.sample, "finish_reason": _finish_reason(s.finish_reason)}
        if chat:
            choice["message"] = {"role": "assistant", "content": s.completion}
        else:
            choice["text"] = s.completion
        choice["logprobs"] = (
            None
            if s.logprobs is None
            else (chat_logprobs(s.logprobs) if chat else completion_logprobs(s.logprobs))
        )
        choices.append(choice)
    completion_tokens = sum(s.completion_tokens for s in samples)
    body = {
        "id": f"{'chatcmpl' if chat else 'cmpl'}-{req_id}",
        "object": "chat.completion" if chat else "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        },
    }
    return _served(req_id, request, body)


def _served(req_id: str, request: dict, body: dict) -> dict:
    return {
        "id": req_id,
        "custom_id": request["custom_id"],
        "response": {"status_code": 200, "request_id": req_id, "body": body},
        "error": None,
    }
