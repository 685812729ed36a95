"""The Python API: `LLM`, a model on its paged engine, with the shape vLLM's users know.

    from batchrun import LLM, SamplingParams
    llm = LLM(model=None, dtype="auto", device="auto", num_pages=512)    # engine options as in the job file
    outs = llm.generate(["Once upon a time"], SamplingParams(max_new_tokens=32))   # raw text, no chat template
    outs = llm.chat([[{"role": "user", "content": "Hi"}]], SamplingParams(max_new_tokens=32, n=2))
    outs[0].outputs[0].text, .token_ids, .finish_reason
    llm.generate([{"prompt": "Hi"}, {"prompt_token_ids": [1, 2, 3]}])   # vLLM's TextPrompt and TokensPrompt

The job runner (`job.py`) loads the same `LLM` from a job file and drives its engine row by row, so a prompt
gives the same completion from either. Sample i of prompt k draws from a generator seeded from
(seed, k, i), as a job's row with index k and no id column does.
"""

from __future__ import annotations

from collections.abc import Sequence as SequenceOf
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

from batchrun.engine import Engine, EngineConfig, SamplingParams, Sequence
from batchrun.engine.model.quantization import Weights, checkpoint_format
from batchrun.engine.model.sizing import check_max_model_len, check_memory_budget
from batchrun.engine.pooling.pooler import PoolerConfig

from .config import ModelSpec
from .errors import BadInput
from .host import Placement, place, warn_slow_dtype
from .loop import drive
from .progress import BAR_FORMAT, RemainingTime, rows_in_flight_done
from .rows import InputRow, OutputRow, check_conversation, is_token_ids, row_seed

Conversation = list[dict[str, Any]]


class Prompt(NamedTuple):
    """A prompt ready for the engine: its token ids and, for a vision-language model, its images as the model's
    processor made them (engine.multimodal.ImageInputs; None: text alone). Whether it can run (an id past the
    embedding, too long) is the engine's to say, for every prompt alike (Engine.prompt_error)."""

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
    prompt: str | Conversation | list[int]  # a dict prompt of generate: its text, or its token ids
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    prompt_logprobs: list[float | None] | None = None  # with SamplingParams(prompt_logprobs=True)
    error: str | None = None  # why this prompt could not run (its outputs then finish with "error")


@dataclass
class EmbeddingOutput:
    embedding: list[float]


@dataclass
class ClassificationOutput:
    probs: list[float]
    label: str  # id2label of the most likely class


@dataclass
class ScoringOutput:
    score: float  # the cross-encoder's score of the pair (its logit through its activation)


@dataclass
class PoolingOutput:
    data: list[float]  # a reward model's reward, its one logit (vLLM's `outputs.data`)


@dataclass
class PoolingRequestOutput:
    """One input's result, in vLLM's shape (`LLM.embed`, `LLM.classify`, `LLM.score`: vLLM's
    ScoringRequestOutput, `LLM.reward`)."""

    request_id: int  # the input's position in the call
    prompt: str | tuple[str, str] | Conversation  # a text; a pair (LLM.score); a conversation (LLM.reward)
    prompt_token_ids: list[int]
    outputs: (
        EmbeddingOutput | ClassificationOutput | ScoringOutput | PoolingOutput | None
    )  # None when the input could not run (error says why)
    error: str | None = None


def check_before_load(
    model: ModelSpec, engine: EngineConfig, config, adapters: dict, placement: Placement, source: str
) -> None:
    """What a model's config decides, checked before its weights load (by the load, and by `batchrun validate`
    without one): the KV budget and swap space against this machine's memory, model.max_model_len against the
    model's positions, and each adapter ({name: (folder, config)}: read_adapters') against the model's layers.
    `config` None (not at hand before the load): the budget's byte sizes alone. BadInput naming `source`: a bad
    job, not a crash or a silent difference minutes later."""
    from .adapters import check_adapters

    try:
        check_memory_budget(engine, config, placement.dtype, placement.device)
        if config is not None:
            check_max_model_len(model.max_model_len, config)
            check_adapters(adapters, config)
    except BadInput as e:
        raise BadInput(f"{source}: {e}") from None


class LLM:
    """A model and its paged engine. Keyword arguments beyond model, dtype, device and max_model_len are the
    job file's `engine:` keys (num_pages, kv_cache_memory, max_num_seqs, prefix_sharing, preemption, ...)."""

    def __init__(
        self,
        model: str | None = None,
        dtype: str = "auto",
        device: str = "auto",
        max_model_len: int | None = None,
        runner: str = "generate",
        pooler: dict | None = None,
        adapters: dict[str, str] | None = None,
        **engine_options: Any,
    ):
        """`runner="pooling"`: the model for `embed` (its base model on batchrun's packed attention, pooled as
        its sentence-transformers files say), with `pooler` the job file's `pooler:` keys; no paged engine.
        `adapters`: LoRA adapters over the model, {name: PEFT adapter folder, URL or hub id}, each prompt naming
        its own in `generate(..., adapter=...)` (engine keys max_loras and max_lora_rank size them)."""
        if adapters and runner != "generate":
            raise BadInput("LLM(...): adapters= applies to runner='generate'")
        try:
            model_spec = ModelSpec(
                path=model, dtype=dtype, max_model_len=max_model_len, adapters=adapters or {}
            )
            engine_config = EngineConfig(device=device, **engine_options)
            pooler_config = PoolerConfig(**(pooler or {}))
        except (TypeError, ValueError) as e:  # an unknown keyword, or a value its field's check refuses
            raise BadInput(f"LLM(...): {e}") from None
        if runner not in ("generate", "pooling"):
            raise BadInput(f"LLM(...): runner={runner!r}; expected generate or pooling")
        if pooler is not None and runner != "pooling":
            raise BadInput("LLM(...): pooler= applies to runner='pooling'")
        self.pooling = (
            None  # runner="pooling": the pooling runner (engine/pooling/runner.py), in place of an engine
        )
        if runner == "pooling":
            from .pooling_worker import load_runner

            self.pooling = load_runner(model_spec, engine_config, pooler_config, "LLM(...)")
            self.prompt_name = pooler_config.prompt_name  # a pair's prompt on a classifier: LLM.score's alone
            self.tokenizer, self.engine = self.pooling.tokenizer, None
            return
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
        from batchrun.engine.model import loading
        from batchrun.engine.model.prepare import Preparation, prepare_model

        from . import model_loader

        placement = placement or place(engine.device, model.dtype)
        self.device, self.dtype = placement.device, placement.dtype
        self.slow_dtype = warn_slow_dtype(placement)  # said now, and in a job's summary
        folder = model_loader.open_model(model.path, source)  # read once: the budget check, then the load
        self.model_dir, config = folder.path, folder.config
        adapters = {}
        if model.adapters:  # each adapter's folder and config, then against the model before it loads
            from .adapters import read_adapters

            adapters = read_adapters(model.adapters, engine.max_lora_rank, source)
        check_before_load(model, engine, config, adapters, placement, source)
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
        # LoRA's layers wrapped, then the CPU rewrites (engine/model/prepare.py): how many modules each rewrote
        self.rewrites = prepare_model(
            hf_model,
            Preparation(self.device, self.dtype, engine.pack_weights, adapters, engine.max_loras),
        )
        self._token_texts: dict[int, str] = {}
        try:
            loaded = loading.LoadedModel.with_tokenizer(hf_model, self.tokenizer, model.max_model_len)
            self.engine = Engine(loaded, engine, self.device)
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
        from .images import load_image

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
        self._check_images_run()
        try:
            text = self.processor.apply_chat_template(rendered, add_generation_prompt=True, tokenize=False)
        except Exception as e:  # noqa: BLE001 - the model's own template
            raise ValueError(f"the model's processor failed on this conversation: {e}") from None
        return self._process(text, pictures, "this conversation")

    def _check_images_run(self) -> None:
        """ValueError saying why this model's images cannot run here (batchrun's reason, or this install's)."""
        if not self.takes_images:
            raise ValueError("an image, and this model takes no images (a text model)")
        if self.engine.plan.images_refusal:
            raise ValueError(f"this model's images cannot run on batchrun: {self.engine.plan.images_refusal}")
        if self.images_unavailable:
            raise ValueError(f"this model's images cannot run on this install: {self.images_unavailable}")

    def _process(self, text: str, pictures: list, what: str) -> Prompt:
        """Text holding the model's image placeholders, and its PIL images, through the model's processor (which
        expands each placeholder into the image's tokens) into a prompt with its image inputs."""
        from batchrun.engine.model.multimodal import ImageInputs

        try:
            outputs = self.processor(text=text, images=pictures, return_tensors="pt")
        except Exception as e:  # noqa: BLE001 - the model's own processor
            raise ValueError(f"the model's processor failed on {what}: {e}") from None
        ids = outputs["input_ids"][0].tolist()
        return Prompt(ids, ImageInputs.from_processor(outputs, self.engine.plan.image_token_id, ids))

    # ---- whole batches ------------------------------------------------------------------------------------------
    def generate(
        self,
        prompts: str | dict | list[str | list[int] | dict],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = True,
        adapter: str | list[str | None] | None = None,
    ) -> list[RequestOutput]:
        """Complete raw prompts, no chat template; outputs in input order. `adapter`: the LoRA adapter (a name
        given to `LLM(adapters=...)`) of every prompt, or a list of one per prompt (None: the base model). A prompt is text, a list of token ids,
        or vLLM's {"prompt": text} or {"prompt_token_ids": [...]}; a text prompt may carry
        "multi_modal_data": {"image": a PIL image or a list of them} for a vision-language model, its text holding
        the model's image placeholder for each (as vLLM's does). A prompt of another shape is a ValueError naming
        its index; a token id outside the model's embedding, given or made by its tokenizer, is that prompt's
        error (its batch-mates run)."""
        if isinstance(prompts, str | dict):
            prompts = [prompts]
        given = [self._raw_prompt(p, i) for i, p in enumerate(prompts)]
        return self._run(
            [shown for shown, _ in given], [p for _, p in given], sampling_params, use_tqdm, adapter
        )

    def _raw_prompt(self, prompt: Any, index: int) -> tuple[str | list[int], Prompt]:
        """One of generate's prompts: (what RequestOutput.prompt shows, the prompt for the engine)."""
        if isinstance(prompt, dict) and set(prompt) in ({"prompt"}, {"prompt", "multi_modal_data"}):
            text, media = prompt["prompt"], prompt.get("multi_modal_data")
            if isinstance(text, str) and media is None:
                return text, Prompt(self.encode(text))
            if isinstance(text, str):
                return text, self._text_with_images(text, media, index)
        elif isinstance(prompt, dict) and set(prompt) == {"prompt_token_ids"}:
            prompt = prompt["prompt_token_ids"]
        if isinstance(prompt, str):
            return prompt, Prompt(self.encode(prompt))
        no_ids = isinstance(prompt, list | tuple) and not prompt  # its error: the prompt has no tokens
        if is_token_ids(prompt) or no_ids:
            return list(prompt), Prompt(list(prompt))
        raise ValueError(
            f"prompts[{index}]: {_shape(prompt)} is not a prompt; expected text, a list of token ids (integers), "
            '{"prompt": text} (with "multi_modal_data": {"image": ...} for a vision-language model) or '
            '{"prompt_token_ids": [token ids]}'
        )

    def _text_with_images(self, text: str, media: Any, index: int) -> Prompt:
        """vLLM's {"prompt": text, "multi_modal_data": {"image": one or a list}}: the text holds the model's
        image placeholders; the processor expands them, as for a conversation's image parts."""
        from .images import load_image

        where = f'prompts[{index}]["multi_modal_data"]'
        if not isinstance(media, dict) or set(media) != {"image"}:
            raise ValueError(f'{where}: expected {{"image": a PIL image or a list of them}} (images only)')
        images = media["image"] if isinstance(media["image"], list | tuple) else [media["image"]]
        try:
            self._check_images_run()
            pictures = [load_image(image) for image in images]
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None
        return self._process(text, pictures, f"prompts[{index}]")

    def chat(
        self,
        conversations: Conversation | list[Conversation],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = True,
        adapter: str | list[str | None] | None = None,
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
        return self._run(list(conversations), ids, sampling_params, use_tqdm, adapter)

    def _run(
        self, prompts: list, ids: list[Prompt], sampling_params, use_tqdm: bool, adapter=None
    ) -> list[RequestOutput]:
        from tqdm.auto import tqdm

        params = _params_per_prompt(sampling_params, len(prompts))
        adapters = _adapter_per_prompt(adapter, len(prompts))
        engine = self.engine
        if engine.has_unfinished():
            raise RuntimeError("this LLM's engine is busy with another batch")
        if isinstance(sampling_params, SamplingParams) and sampling_params.structured:
            try:  # one format for every prompt: a mistake of the call, not of a prompt
                engine.grammars.compile(sampling_params.response_format)
            except ValueError as e:
                raise ValueError(f"sampling_params.response_format: {e}") from None
        outputs = [RequestOutput(i, prompt, p.token_ids) for i, (prompt, p) in enumerate(zip(prompts, ids))]
        worker = _PromptWorker(self, outputs, params, ids, adapters)
        items = iter(enumerate(params))
        bar = tqdm(
            total=len(prompts), unit="prompt", disable=not use_tqdm, desc="batchrun", bar_format=BAR_FORMAT
        )
        remaining = RemainingTime(bar)
        try:
            drive(
                worker,
                lambda block: next(items, None),
                lambda output: bar.update(1),
                lambda: remaining.show(lambda: rows_in_flight_done(engine.live_sequences())),
            )
        finally:
            bar.close()
            engine.abort_all()  # nothing is left after a full run; after an exception, frees the pages
        return outputs

    def embed(self, prompts: str | list[str], use_tqdm: bool = True) -> list[PoolingRequestOutput]:
        """One vector per text (an LLM made with runner="pooling" on an embedding checkpoint), in input order,
        equal to the checkpoint's sentence-transformers `encode`; the texts are packed with no padding. A text
        that cannot be embedded (empty, too long for the model) is that output's error, and the others run."""
        return self._pool("embed", prompts, use_tqdm, lambda row: EmbeddingOutput(row.embedding))

    def classify(self, prompts: str | list[str], use_tqdm: bool = True) -> list[PoolingRequestOutput]:
        """Class probabilities and the most likely label per text (runner="pooling" on a sequence-classification
        checkpoint), as its `AutoModelForSequenceClassification` gives them for the text alone."""
        return self._pool(
            "classify", prompts, use_tqdm, lambda row: ClassificationOutput(row.probs, row.label)
        )

    def score(
        self, text_1: str | list[str], text_2: str | list[str], use_tqdm: bool = True
    ) -> list[PoolingRequestOutput]:
        """A cross-encoder's (reranker's) score per pair, in vLLM's shape: `text_1` one text scored against each
        of `text_2`, or as many texts as `text_2`, paired in order. Each equals the checkpoint's
        `AutoModelForSequenceClassification` on the pair alone through its activation (a sigmoid unless its config
        names another), as sentence-transformers' CrossEncoder.predict gives it. An empty text is that pair's
        error."""
        firsts = [text_1] if isinstance(text_1, str) else list(text_1)
        seconds = [text_2] if isinstance(text_2, str) else list(text_2)
        if len(firsts) == 1:
            firsts = firsts * len(seconds)
        if len(firsts) != len(seconds):
            raise BadInput(
                f"LLM.score: text_1 has {len(firsts)} texts and text_2 {len(seconds)}; give one text_1, or as many "
                "as text_2"
            )
        rows = [InputRow(i, i, a, pair=b) for i, (a, b) in enumerate(zip(firsts, seconds))]
        return self._pool("score", rows, use_tqdm, lambda row: ScoringOutput(row.score))

    def reward(self, prompts: str | Conversation | list, use_tqdm: bool = True) -> list[PoolingRequestOutput]:
        """A reward model's reward per text or conversation (its last reply included, through the chat
        template), in vLLM's shape (`.outputs.data`: the head's one logit), equal to its
        `AutoModelForSequenceClassification` on the input alone."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], dict)):
            prompts = [prompts]
        return self._pool("reward", prompts, use_tqdm, lambda row: PoolingOutput([row.score]))

    def _pool(self, task: str, prompts: list, use_tqdm: bool, output) -> list[PoolingRequestOutput]:
        """The inputs (texts, or InputRows) through the pooling runner (pooling_worker.PoolingWorker, the job's
        own), in input order."""
        from tqdm.auto import tqdm

        from .pooling_worker import PoolingWorker, check_head
        from .stats import PoolingStats

        if self.pooling is None or task not in self.pooling.tasks:
            made = "generates text" if self.pooling is None else f"runs {' / '.join(self.pooling.tasks)}"
            raise BadInput(
                f"LLM.{task}: this LLM {made}; {task} needs LLM(model, runner='pooling') on such a model"
            )
        if task != "embed":
            check_head(self.pooling.model_dir, self.pooling.classifier.config, task, f"LLM.{task}", api=True)
        if task in ("classify", "reward") and self.prompt_name is not None:
            raise BadInput(
                f"LLM.{task}: pooler.prompt_name is a cross-encoder's prompt, put before a pair's first text "
                "(LLM.score); a text is taken as it is"
            )
        if isinstance(prompts, str):
            prompts = [prompts]
        made_rows = [p if isinstance(p, InputRow) else InputRow(i, i, p) for i, p in enumerate(prompts)]
        rows = iter(made_rows)
        outputs: list[PoolingRequestOutput | None] = [None] * len(made_rows)
        bar = tqdm(total=len(made_rows), unit="text", disable=not use_tqdm, desc="batchrun")

        def finished(result: list[OutputRow]) -> None:
            (row,) = result
            ids = row.prompt_token_ids or []
            made = None if row.error else output(row)
            given = row.row.prompt if row.row.pair is None else (row.row.prompt, row.row.pair)
            outputs[row.id] = PoolingRequestOutput(row.id, given, ids, made, row.error)
            bar.update(1)

        window = max(self.pooling.max_num_seqs, 16)
        worker = PoolingWorker(self.pooling, PoolingStats(), window, task)
        try:
            drive(worker, lambda block: next(rows, None), finished)
        finally:
            bar.close()
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

    def __init__(
        self,
        llm: LLM,
        outputs: list[RequestOutput],
        params: list[SamplingParams],
        prompts: list[Prompt],
        adapters: list[str | None],
    ):
        self.llm = llm
        self.adapters = adapters
        self.engine = llm.engine
        self.outputs = outputs
        self.prompts = prompts
        self.samples: list[list[CompletionOutput | None]] = [[None] * p.n for p in params]

    @property
    def has_work(self) -> bool:
        return self.engine.has_unfinished()

    def feed(self, item: tuple[int, SamplingParams]) -> RequestOutput | None:
        i, p = item
        output = self.outputs[i]
        prompt = self.prompts[i]
        reason = self.engine.prompt_error(prompt.token_ids, p, prompt.images)
        try:
            self.engine.adapter_id(self.adapters[i])
        except ValueError as e:
            reason = reason or str(e)
        if reason:
            output.error = f"prompt {i}: {reason}"
            output.outputs = [CompletionOutput(s, "", [], "error") for s in range(p.n)]
            return output
        seeds = [row_seed(p.seed, i, s) for s in range(p.n)]
        self.engine.add(
            prompt.token_ids, p, request=i, seeds=seeds, images=prompt.images, adapter=self.adapters[i]
        )
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


def _adapter_per_prompt(adapter, count: int) -> list[str | None]:
    """generate's `adapter`: one name (or None) for every prompt, or a list of one per prompt."""
    if adapter is None or isinstance(adapter, str):
        return [adapter] * count
    if not isinstance(adapter, SequenceOf) or len(adapter) != count:
        raise ValueError(f"adapter: one adapter name (or None), or a list of {count} (one per prompt)")
    return list(adapter)


def _shape(value: Any) -> str:
    """How a value that is not a prompt reads in the error: a dict by its keys, anything else by its type."""
    if isinstance(value, dict):
        return "a dict with keys " + ", ".join(repr(k) for k in value)
    return f"a value of type {type(value).__name__}"
