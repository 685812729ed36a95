"""The Python API: `LLM`, a model on its paged engine, with the shape vLLM's users know.

    from batchrun import LLM, SamplingParams
    llm = LLM(model=None, dtype="auto", device="auto", num_pages=512)    # engine options as in the job file
    outs = llm.generate(["Once upon a time"], SamplingParams(max_new_tokens=32))   # raw text, no chat template
    outs = llm.chat([[{"role": "user", "content": "Hi"}]], SamplingParams(max_new_tokens=32, n=2))
    outs[0].outputs[0].text, .token_ids, .finish_reason

The job runner (`job.py`) loads the same `LLM` from a job file and drives its engine row by row, so a prompt
gives the same completion from either. Sample i of prompt k draws from a generator seeded from
(seed, k, i), as a job's row with index k and no id column does.
"""

from __future__ import annotations

from collections.abc import Sequence as SequenceOf
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

from .config import ModelSpec
from .engine import Engine, EngineConfig, SamplingParams, Sequence
from .engine.quantization import Weights, checkpoint_format
from .engine.sizing import check_memory_budget
from .errors import BadInput
from .host import Placement, place
from .loop import drive
from .rows import check_conversation, row_seed

Conversation = list[dict[str, Any]]


class Prompt(NamedTuple):
    """A prompt ready for the engine: its token ids and, for a vision-language model, its images as the model's
    processor made them (engine.multimodal.ImageInputs; None: text alone)."""

    token_ids: list[int]
    images: Any = None


@dataclass
class CompletionOutput:
    index: int  # the sample, 0 .. n-1
    text: str  # stop string excluded
    token_ids: list[int]  # the eos token included when the sequence ended on it
    finish_reason: str  # stop | eos | length | error (the prompt could not run: RequestOutput.error says why)
    # with SamplingParams(logprobs=K): per generated token {token_id, token, logprob, top: [{token_id, token,
    # logprob}] * K}, from the raw logits
    logprobs: list[dict] | None = None
    num_preemptions: int = 0


@dataclass
class RequestOutput:
    request_id: int  # the prompt's position in the call
    prompt: str | Conversation | list[int]
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    prompt_logprobs: list[float | None] | None = None  # with SamplingParams(prompt_logprobs=True)
    error: str | None = None  # why this prompt could not run (its outputs then finish with "error")


class LLM:
    """A model and its paged engine. Keyword arguments beyond model, dtype, device and max_model_len are the
    job file's `engine:` keys (num_pages, kv_cache_memory, max_num_seqs, prefix_sharing, preemption, ...)."""

    def __init__(
        self,
        model: str | None = None,
        dtype: str = "auto",
        device: str = "auto",
        max_model_len: int | None = None,
        **engine_options: Any,
    ):
        try:
            model_spec = ModelSpec(path=model, dtype=dtype, max_model_len=max_model_len)
            engine_config = EngineConfig(device=device, **engine_options)
        except (TypeError, ValueError) as e:  # an unknown keyword, or a value its field's check refuses
            raise BadInput(f"LLM(...): {e}") from None
        self._load(model_spec, engine_config, "LLM(...)")

    @classmethod
    def from_spec(
        cls, model: ModelSpec, engine: EngineConfig, source: str, placement: Placement | None = None
    ) -> LLM:
        """The model and engine of a job file's `model:` and `engine:` sections; errors name `source`.
        `placement`: the device and dtype, where the caller resolved them already (host.place)."""
        llm = cls.__new__(cls)
        llm._load(model, engine, source, placement)
        return llm

    def _load(
        self, model: ModelSpec, engine: EngineConfig, source: str, placement: Placement | None = None
    ) -> None:
        from . import model_loader
        from .engine import loading

        placement = placement or place(engine.device, model.dtype)
        self.device, self.dtype = placement.device, placement.dtype
        self.model_dir = model_loader.resolve_model_dir(model.path, source)
        self.packed_weights = False  # linear weights packed for oneDNN (engine/cpu_linear.py)
        config = model_loader.load_config(self.model_dir)  # read once: the budget check, then the load
        try:  # before loading: a KV budget the machine cannot hold is a bad job, not a crash minutes later
            check_memory_budget(engine, config, self.dtype, self.device)
        except BadInput as e:
            raise BadInput(f"{source}: {e}") from None
        # a vision-language model's processor (image tokens, pixel values, its tokenizer); None for a text model,
        # and for one whose processor cannot be built here: its text prompts run, its image rows are errors
        self.images_unavailable: str | None = None
        try:
            self.processor = loading.load_processor(self.model_dir, config)
        except loading.ProcessorUnavailable as e:
            self.processor, self.images_unavailable = None, str(e)
        tokenizer = getattr(self.processor, "tokenizer", None)
        self.tokenizer, hf_model = loading.load_model(
            self.model_dir, self.dtype, self.device, config, tokenizer
        )
        # the weights' format and bytes in memory, for the summary (counted before any packing for oneDNN)
        self.weights = Weights.of(hf_model, checkpoint_format(config))
        if self.device.type == "cpu":
            from .engine import cpu_allocator, cpu_linear

            cpu_allocator.keep_freed_blocks()
            # weights packed for oneDNN where this CPU can (the summary's packed_weights says which)
            if engine.pack_weights and cpu_linear.available(self.dtype):
                self.packed_weights = cpu_linear.pack_linear_layers(hf_model) > 0
        self._token_texts: dict[int, str] = {}
        try:
            self.engine = Engine(
                hf_model,
                self.tokenizer,
                engine,
                self.device,
                loading.eos_token_ids(self.tokenizer, hf_model),
                model.max_model_len,
            )
        except BadInput as e:
            raise BadInput(f"{source}: {e}") from None

    # ---- prompts -> token ids ---------------------------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        """Raw text, as the tokenizer encodes it (its special tokens, such as a BOS, included)."""
        return self.tokenizer(text)["input_ids"]

    def encode_chat(self, messages: Conversation, base_dir: Path | None = None) -> Prompt:
        """A conversation rendered with the chat template, ready for the assistant's turn; its images read
        (paths relative to `base_dir`). ValueError when the conversation is malformed, an image cannot be read
        or the template fails."""
        return self.render_chat(check_conversation(messages, images=self.takes_images), base_dir)

    @property
    def takes_images(self) -> bool:
        """A vision-language model: its conversations' image parts are kept (and run, or are the row's error
        where its processor cannot be built here)."""
        return self.processor is not None or self.images_unavailable is not None

    def render_chat(self, turns: Conversation, base_dir: Path | None = None) -> Prompt:
        """Checked turns (check_conversation) through the chat template; ValueError when the template fails.
        Turns with image parts go through the model's processor, which places the image tokens as text before
        tokenizing (as the model's own preprocessing does)."""
        if any(isinstance(t["content"], list) for t in turns):  # check_conversation kept image parts
            return self._render_with_images(turns, base_dir)
        template = self.processor or self.tokenizer  # a vision-language model's template is its processor's
        try:
            text = template.apply_chat_template(turns, add_generation_prompt=True, tokenize=False)
        except Exception as e:
            raise ValueError(f"chat template failed: {e}") from None
        return Prompt(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def _render_with_images(self, turns: Conversation, base_dir: Path | None) -> Prompt:
        from .engine.multimodal import ImageInputs
        from .images import load_image

        if self.engine.images_refusal:
            raise ValueError(f"this model's images cannot run on batchrun: {self.engine.images_refusal}")
        if self.images_unavailable:
            raise ValueError(f"this model's images cannot run on this install: {self.images_unavailable}")

        pictures, rendered = [], []
        for i, turn in enumerate(turns, 1):
            content = turn["content"]
            if isinstance(content, list):
                parts = []
                for j, part in enumerate(content, 1):
                    if part["type"] == "image":
                        try:
                            pictures.append(load_image(part["image"], base_dir))
                        except ValueError as e:
                            raise ValueError(f"conversation turn {i}, content part {j}: {e}") from None
                        parts.append({"type": "image"})
                    else:
                        parts.append(part)
                content = parts
            rendered.append({"role": turn["role"], "content": content})
        processor = self.processor
        try:
            text = processor.apply_chat_template(rendered, add_generation_prompt=True, tokenize=False)
            outputs = processor(text=text, images=pictures, return_tensors="pt")
        except Exception as e:  # noqa: BLE001 - the model's own template and processor
            raise ValueError(f"the model's processor failed on this conversation: {e}") from None
        ids = outputs["input_ids"][0].tolist()
        token_id = self.engine.image_token_id
        return Prompt(ids, ImageInputs.from_processor(outputs, token_id, ids))

    # ---- whole batches ------------------------------------------------------------------------------------------
    def generate(
        self,
        prompts: str | list[str] | list[list[int]],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Complete raw prompts (text, or token ids), no chat template; outputs in input order."""
        if isinstance(prompts, str):
            prompts = [prompts]
        ids = [Prompt(list(p) if not isinstance(p, str) else self.encode(p)) for p in prompts]
        return self._run(list(prompts), ids, sampling_params, use_tqdm)

    def chat(
        self,
        conversations: Conversation | list[Conversation],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Answer conversations (lists of {role, content}) through the chat template; outputs in input order.
        A content may be OpenAI's content parts; with a vision-language model, image parts too ({type: image_url,
        image_url: {url}} with a data: URL, a path or an fsspec URL, or {type: image, image: a PIL image})."""
        if isinstance(conversations, dict):
            raise ValueError(
                "conversations: one turn {role, content} was given; a conversation is a list of turns: "
                "llm.chat([turn, ...]), or a list of conversations"
            )
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]
        ids = [self.encode_chat(c) for c in conversations]
        return self._run(list(conversations), ids, sampling_params, use_tqdm)

    def _run(self, prompts: list, ids: list[Prompt], sampling_params, use_tqdm: bool) -> list[RequestOutput]:
        from tqdm.auto import tqdm

        params = _params_per_prompt(sampling_params, len(prompts))
        engine = self.engine
        if engine.has_unfinished():
            raise RuntimeError("this LLM's engine is busy with another batch")
        if isinstance(sampling_params, SamplingParams) and sampling_params.structured:
            try:  # one format for every prompt: a mistake of the call, not of a prompt
                engine.grammars.compile(sampling_params.response_format)
            except ValueError as e:
                raise ValueError(f"sampling_params.response_format: {e}") from None
        outputs = [RequestOutput(i, prompt, p.token_ids) for i, (prompt, p) in enumerate(zip(prompts, ids))]
        worker = _PromptWorker(self, outputs, params, [p.images for p in ids])
        items = iter(enumerate(params))
        bar = tqdm(total=len(prompts), unit="prompt", disable=not use_tqdm, desc="batchrun")
        try:
            drive(worker, lambda block: next(items, None), lambda output: bar.update(1))
        finally:
            bar.close()
            engine.abort_all()  # nothing is left after a full run; after an exception, frees the pages
        return outputs

    def completion(self, seq: Sequence) -> CompletionOutput:
        """A finished sequence as one sample's output."""
        return CompletionOutput(
            index=seq.sample_index,
            text=self.engine.completion_text(seq),
            token_ids=list(seq.output_token_ids),
            finish_reason=seq.finish_reason,
            logprobs=None if seq.logprobs is None else [self._logprob_entry(e) for e in seq.logprobs],
            num_preemptions=seq.num_preemptions,
        )

    def token_text(self, token_id: int) -> str:
        """One token's text as it decodes alone (cached: a job asks for the same tokens again and again)."""
        text = self._token_texts.get(token_id)
        if text is None:
            text = self._token_texts[token_id] = self.tokenizer.decode([token_id])
        return text

    def _logprob_entry(self, entry: tuple[int, float, list[int], list[float]]) -> dict:
        token, logprob, top_ids, top_logprobs = entry
        return {
            "token_id": token,
            "token": self.token_text(token),
            "logprob": logprob,
            "top": [
                {"token_id": t, "token": self.token_text(t), "logprob": lp}
                for t, lp in zip(top_ids, top_logprobs)
            ],
        }


class _PromptWorker:
    """The Python API's worker for the one loop (loop.drive): a prompt's (index, SamplingParams) in, its finished
    RequestOutput out. Every prompt is queued at once (the engine schedules them); one that can never run is
    answered at once with its error, and its batch-mates run."""

    wants_rows = True

    def __init__(self, llm: LLM, outputs: list[RequestOutput], params: list[SamplingParams], images: list):
        self.llm = llm
        self.engine = llm.engine
        self.outputs = outputs
        self.images = images  # per prompt: its ImageInputs, or None
        self.samples: list[list[CompletionOutput | None]] = [[None] * p.n for p in params]

    @property
    def has_work(self) -> bool:
        return self.engine.has_unfinished()

    def feed(self, item: tuple[int, SamplingParams]) -> RequestOutput | None:
        i, p = item
        output = self.outputs[i]
        reason = self.engine.admission_error(len(output.prompt_token_ids), p, self.images[i])
        if reason:
            output.error = f"prompt {i}: {reason}"
            output.outputs = [CompletionOutput(s, "", [], "error") for s in range(p.n)]
            return output
        seeds = [row_seed(p.seed, i, s) for s in range(p.n)]
        self.engine.add(output.prompt_token_ids, p, request=i, seeds=seeds, images=self.images[i])
        return None

    def step(self) -> list[RequestOutput]:
        done = []
        for seq in self.engine.step().finished:
            row = self.samples[seq.request]
            row[seq.sample_index] = self.llm.completion(seq)
            if all(c is not None for c in row):
                output = self.outputs[seq.request]
                output.outputs = list(row)
                output.prompt_logprobs = seq.prompt_logprobs
                done.append(output)
        return done


def _params_per_prompt(sampling_params, count: int) -> list[SamplingParams]:
    if sampling_params is None:
        return [SamplingParams()] * count
    if isinstance(sampling_params, SamplingParams):
        return [sampling_params] * count
    if not isinstance(sampling_params, SequenceOf) or len(sampling_params) != count:
        raise ValueError(f"sampling_params: one SamplingParams, or a list of {count} (one per prompt)")
    return list(sampling_params)
