"""Loading a model with batchrun's paged attention from a model directory (what model_loader.py found or
converted). A model class that will not take a custom attention function is refused here, naming its
architecture (`refused_attention`; architecture.py refuses the rest)."""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from batchrun.engine.attention import ATTENTION_NAME, refusal, register
from batchrun.engine.model import families
from batchrun.engine.model.architecture import not_the_models_fault
from batchrun.engine.model.multimodal import is_vision_language
from batchrun.engine.model.quantization import call_per_sequence, finish_loading, missing_package
from batchrun.errors import BadInput


@dataclass(frozen=True)
class LoadedModel:
    """A loaded model and what the engine reads beside its weights, as one value: the tokenizer (decoding,
    stop strings, grammars), the ids that end a sequence, and the context limit the job set. The engine takes
    this instead of four loose arguments, so that a new load-time fact is a field here, not a parameter more on
    every constructor between the loader and the output processor."""

    model: torch.nn.Module
    tokenizer: Any = None  # None: the tests' random-weight models, whose ids are never decoded to text
    eos_token_ids: frozenset[int] = field(default_factory=frozenset)  # none: only max_new_tokens ends a row
    max_model_len: int | None = None  # None: the model config's own limit (model_plan.ModelPlan.of)

    @classmethod
    def with_tokenizer(
        cls, model: torch.nn.Module, tokenizer, max_model_len: int | None = None
    ) -> LoadedModel:
        """`model` with `tokenizer` and the end-of-sequence ids its generation config and tokenizer name."""
        return cls(model, tokenizer, frozenset(eos_token_ids(tokenizer, model)), max_model_len)


def load_model(
    model_dir: Path,
    dtype: torch.dtype,
    device: torch.device,
    config=None,
    tokenizer=None,
    auto_class: str | None = None,
):
    """Tokenizer and model from a local directory, with batchrun's paged attention as attention function.
    `config`: the model's config, when the caller has read it already; `tokenizer`: the tokenizer, when the
    caller has it already (a vision-language model's processor holds one); `auto_class`: a pooling model's
    transformers class (`model_class`)."""
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # batchrun shows its own progress
    try:
        tokenizer = tokenizer or AutoTokenizer.from_pretrained(model_dir)
        model = load_paged_model(model_dir, dtype, config, auto_class)
    except BadInput:
        raise
    except Exception as e:
        if not_the_models_fault(e):
            raise  # out of memory, I/O: the run failed (exit 1), the model path is not the reason
        needs = missing_package(config, e)  # a quantized checkpoint whose package is not installed
        if needs:
            raise needs from None
        raise BadInput(f"model.path: cannot load the model in {model_dir}: {e}") from None
    finish_loading(model)
    call_per_sequence(model)  # batch-dependent quantized layers: each sequence apart, as HF generate
    model.to(device).eval()
    return tokenizer, model


def load_processor(model_dir: Path, config):
    """A vision-language model's processor (`AutoProcessor`: its image processor and the placement of image
    tokens), or None for a text model. Where the processor needs torchvision for a part batchrun never uses
    (Qwen-VL's and Qwen 3.5's video processor), it is built from its parts (`_processor_without_torchvision`);
    where it needs it for more (Pixtral's image processor), ProcessorUnavailable."""
    if not is_vision_language(config):
        return None
    from transformers import AutoProcessor

    where = f"model.path: cannot load the processor of the model in {model_dir}"
    try:
        return AutoProcessor.from_pretrained(model_dir)
    except Exception as e:  # noqa: BLE001 - the model's own processor files
        _unless_for_torchvision(e, where)
    try:
        return _processor_without_torchvision(model_dir, config)
    except Exception as e:  # noqa: BLE001 - its own module or a part needs torchvision (Pixtral's, Inkling 2's)
        _unless_for_torchvision(e, where)
        first = " ".join(str(e).split()).split(". ")[0]  # transformers' first sentence
        raise ProcessorUnavailable(
            f"the model's processor cannot be built here: {first} (torchvision does not install beside the CPU "
            "torch wheel; docs/images.md says how to install one)"
        ) from None


def _unless_for_torchvision(e: Exception, where: str) -> None:
    """Returns where loading the processor failed for want of torchvision; raises otherwise (a bad model path,
    or the machine's own failure)."""
    if not_the_models_fault(e):
        raise e
    if "torchvision" not in str(e).lower():
        raise BadInput(f"{where}: {e}") from None


class ProcessorUnavailable(BadInput):
    """A vision-language model's processor cannot be built on this install (a part of it needs torchvision, which
    does not install beside the CPU torch wheel): its text prompts still run on its tokenizer, and a row with an
    image is that row's error, naming this (llm.LLM)."""


def _processor_without_torchvision(model_dir: Path, config):
    """The model's own processor class, given its image processor's PIL path, its tokenizer and no video
    processor (a NoVideo in its place). The CPU torch wheel has no torchvision on the registry that imports
    beside it (PyPI's is built for CUDA torch), and transformers' video processors need it even where no video
    is ever given; image processors have a PIL path that needs none. A processor whose other parts need
    torchvision raises, naming the part (load_processor makes it ProcessorUnavailable)."""
    import json

    import transformers
    from transformers import AutoImageProcessor, AutoTokenizer
    from transformers.models.auto.processing_auto import PROCESSOR_MAPPING_NAMES

    name = PROCESSOR_MAPPING_NAMES.get(config.model_type)
    cls = getattr(transformers, name, None) if isinstance(name, str) else None
    if cls is None:
        raise ProcessorUnavailable("its processor class needs torchvision, which is not installed")
    parts = {}
    for attribute in cls.get_attributes():
        if attribute == "image_processor":
            parts[attribute] = AutoImageProcessor.from_pretrained(model_dir, backend="pil")
        elif attribute == "tokenizer":
            parts[attribute] = AutoTokenizer.from_pretrained(model_dir)
        elif attribute == "video_processor":
            parts[attribute] = NoVideo(**families.video_stand_in(config))  # batchrun gives no video
        elif attribute == "feature_extractor":
            parts[attribute] = None  # nor audio
        else:
            raise ProcessorUnavailable(f"its {attribute} needs torchvision, which is not installed")
    options = {}
    config_file = model_dir / "processor_config.json"
    if config_file.exists():
        saved = json.loads(config_file.read_text())
        options = {k: v for k, v in saved.items() if k not in parts and k != "processor_class"}
    template_file = model_dir / "chat_template.jinja"
    template = template_file.read_text() if template_file.exists() else parts["tokenizer"].chat_template

    def check_argument_for_proper_class(self, argument_name, argument):
        # the stock check looks a missing part's class up in transformers' torchvision-only registries
        if argument is None or isinstance(argument, NoVideo):
            return None
        return cls.check_argument_for_proper_class(self, argument_name, argument)

    without_video = type(
        cls.__name__, (cls,), {"check_argument_for_proper_class": check_argument_for_proper_class}
    )
    return without_video(**parts, chat_template=template, **options)


class NoVideo:
    """The video processor a processor is built without: batchrun gives no video. It answers only what a family
    adapter says its processor reads of it even with no video (families.video_stand_in: SmolVLM's
    frame-sampling defaults); anything else asked of it is an error, never a silent default."""

    def __init__(self, **attributes):
        self.__dict__.update(attributes)

    def __getattr__(self, name: str):
        raise AttributeError(f"batchrun built this processor without a video processor (asked for {name!r})")

    def __call__(self, *args, **kwargs):
        raise BadInput("batchrun takes images, not videos")


def eos_token_ids(tokenizer, model) -> set[int]:
    ids: set[int] = set()
    gen = getattr(model, "generation_config", None)
    for source in (getattr(gen, "eos_token_id", None), tokenizer.eos_token_id):
        if isinstance(source, int):
            ids.add(source)
        elif source:
            ids.update(source)
    return ids


@contextmanager
def refused_attention(config):
    """Loading a model of `config` with batchrun's attention: a model class that refuses a custom attention
    function (transformers names the function in its error) is UnsupportedModel naming the architecture; any
    other error is raised as it is."""
    try:
        yield
    except Exception as e:  # noqa: BLE001
        if ATTENTION_NAME not in str(e):
            raise
        text = str(e).splitlines()[0]
        raise refusal(
            config.model_type,
            f"its attention does not go through transformers' attention interface (loading it with "
            f"attn_implementation={ATTENTION_NAME!r} failed: {text})",
        ) from None


def model_class(config, auto_class: str | None = None):
    """The `transformers` auto class of a config: `auto_class` where the caller names one (a pooling model's:
    AutoModel, its base model alone, or AutoModelForSequenceClassification); else a vision-language model (a
    `vision_config`) is an image-text model (its language model, its image encoder and its own merge of the
    two); any other, a causal LM."""
    import transformers
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    if auto_class is not None:
        return getattr(transformers, auto_class)
    return AutoModelForImageTextToText if is_vision_language(config) else AutoModelForCausalLM


def attention_implementation(config):
    """batchrun's attention for the language model; a vision-language model's image encoder keeps SDPA (it runs
    whole images on their own, no pages), and its wrapper SDPA too, or eager where its class takes no SDPA
    (Inkling 2's: its per-token sinks)."""
    if not is_vision_language(config):
        return ATTENTION_NAME
    chosen = {name: "sdpa" for name in getattr(config, "sub_configs", {})}
    wrapper = "sdpa" if getattr(model_class(config), "_supports_sdpa", False) else "eager"
    chosen.update({"": wrapper, "text_config": ATTENTION_NAME})
    return chosen


def load_paged_model(model_dir, dtype: torch.dtype, config=None, auto_class: str | None = None):
    """A model (of `model_class`) from a local directory with batchrun's attention; a model class that refuses a
    custom attention function is UnsupportedModel naming the architecture."""
    from transformers import AutoConfig

    register()
    config = config if config is not None else AutoConfig.from_pretrained(model_dir)
    with refused_attention(config):
        return model_class(config, auto_class).from_pretrained(
            model_dir, dtype=dtype, attn_implementation=attention_implementation(config), config=config
        )


def meta_paged_model(config) -> torch.nn.Module:
    """The model of `config` with batchrun's attention on the meta device: every module and shape, no weights,
    no memory (sizing.kv_page_bytes probes it before the load). In bfloat16, which the meta kernel of the
    experts' grouped products insists on (the page bytes are reckoned in the job's dtype, not this one); the
    padding warning, which reads token values a meta tensor has not, left out."""
    import copy

    register()
    config = copy.deepcopy(config)  # from_config writes its attention choice into the config it is given
    with torch.device("meta"), refused_attention(config):
        model = model_class(config).from_config(
            config, attn_implementation=attention_implementation(config), dtype=torch.bfloat16
        )
    for module in model.modules():  # the outer model's and its inner ones' (GPT-2's `transformer`)
        if hasattr(module, "warn_if_padding_and_no_attention_mask"):
            module.warn_if_padding_and_no_attention_mask = lambda *args, **kwargs: None
    return model.eval()
