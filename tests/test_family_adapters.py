"""Family rules live in engine/model/families/ alone: no other module of the package checks a family's name (a
`model_type` string, a family's class name, a comparison with a model's `model_type` or a class's `__name__`),
and every module there registers one adapter that says why it exists. What each adapter computes is tested
where its family is (the family matrix, tests/test_image_families.py, tests/test_hybrid.py)."""

from __future__ import annotations

import ast
from pathlib import Path
from types import SimpleNamespace

import pytest
from helpers import ROOT

PACKAGE = ROOT / "batchrun"
FAMILIES = PACKAGE / "engine" / "model" / "families"


def family_names() -> tuple[set[str], set[str]]:
    """Every `model_type` transformers knows, and the class-name prefixes of their configs (Qwen2VL,
    RecurrentGemma, Mamba, ...; those of 4 letters or more)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    prefixes = {name.removesuffix("Config") for name in CONFIG_MAPPING_NAMES.values()}
    return set(CONFIG_MAPPING_NAMES), {p for p in prefixes if len(p) >= 4}


def family_checks(path: Path, model_types: set[str], prefixes: set[str]) -> list[str]:
    """Where the file names a family in code (not in a docstring or a message): a string that is a `model_type`
    or holds a family's class-name prefix, or a comparison with a `model_type` or a `__name__`."""
    tree = ast.parse(path.read_text())
    prose = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    prose |= {id(part) for node in ast.walk(tree) if isinstance(node, ast.JoinedStr) for part in node.values}
    name = path.relative_to(ROOT) if ROOT in path.parents else path.name
    found = []
    for node in ast.walk(tree):
        where = f"{name}:{getattr(node, 'lineno', '?')}"
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in prose:
            named = [p for p in prefixes if p in node.value] + [node.value] * (node.value in model_types)
            if named:
                found.append(f"{where}: {node.value!r} names {', '.join(sorted(named))}")
        elif isinstance(node, ast.Compare):
            text = ast.unparse(node)
            if ("model_type" in text or "__name__" in text) and "'__main__'" not in text:
                found.append(f"{where}: {text}")
    return found


def test_no_family_name_is_checked_outside_the_families_package():
    model_types, prefixes = family_names()
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if FAMILIES not in path.parents:
            found += family_checks(path, model_types, prefixes)
    assert not found, (
        "family rules outside engine/model/families/ (move them into an adapter):\n" + "\n".join(found)
    )


def test_the_scan_sees_a_family_check(tmp_path):
    """The check above can fail: a model_type compared, a family list, a class-name regex are all found, a
    docstring and a message are not."""
    probe = tmp_path / "probe.py"
    probe.write_text(
        '"""Gemma 3 and qwen2_vl in prose."""\n'
        "import re\n"
        "VL = frozenset({'qwen2_vl'})\n"
        "STATEFUL = re.compile(r'Mamba|DeltaNet')\n"
        "def f(model):\n"
        "    '''gemma3 in a docstring'''\n"
        "    if model.config.model_type == 'gemma3':\n"
        "        raise ValueError(f'gemma3 {model}')\n"
        "    return type(model).__name__ in VL\n"
    )
    found = family_checks(probe, *family_names())
    text = "\n".join(found)
    assert "'qwen2_vl' names qwen2_vl" in text and "names Mamba" in text, text
    assert "model.config.model_type == 'gemma3'" in text and "type(model).__name__ in VL" in text, text
    assert len(found) == 5, text  # the comparison's 'gemma3', not the docstring's nor the message's


def test_every_family_module_registers_one_adapter_saying_why():
    from batchrun.engine.model import families
    from batchrun.engine.model.families.adapter import FamilyAdapter

    modules = sorted(p.stem for p in FAMILIES.glob("*.py") if p.stem not in ("__init__", "adapter"))
    registered = {type(a).__module__.rsplit(".", 1)[1] for a in families.ADAPTERS}
    assert registered == set(modules)
    for adapter in families.ADAPTERS:
        module = __import__(type(adapter).__module__, fromlist=["_"])
        assert isinstance(adapter, FamilyAdapter) and adapter.name, type(adapter)
        assert "Why" in module.__doc__ and "Provides" in module.__doc__, module.__name__


@pytest.mark.parametrize(
    ("model_type", "expected"),
    [("gemma3", "GemmaImageBlocks"), ("qwen3_vl", "QwenMRope"), ("smolvlm", "SmolVLMVideoDefaults")],
)
def test_an_adapter_of_named_families_applies_to_them_alone(model_type, expected):
    from batchrun.engine.model import families

    names = lambda t: {type(a).__name__ for a in families.adapters_for(SimpleNamespace(model_type=t))}
    assert expected in names(model_type)
    assert expected not in names("llama")


def test_the_video_stand_in_answers_only_what_the_family_reads():
    """SmolVLM's processor reads the video processor's frame-sampling defaults; another family's stand-in
    answers nothing, so a read of it is an error rather than a silent None."""
    from batchrun.engine.model import families
    from batchrun.engine.model.loading import NoVideo

    smolvlm = NoVideo(**families.video_stand_in(SimpleNamespace(model_type="smolvlm")))
    assert smolvlm.num_frames is None and smolvlm.fps is None
    with pytest.raises(AttributeError, match="without a video processor"):
        _ = NoVideo(**families.video_stand_in(SimpleNamespace(model_type="qwen2_vl"))).num_frames
