"""Imports flow one way: every import of the package (those inside functions and under TYPE_CHECKING too) goes to
the importer's own layer or one below it, as docs/ARCHITECTURE.md's "How the code is laid out" table has them, and no
module reaches itself through others (no circles)."""

from __future__ import annotations

import ast
import re

from helpers import ROOT

PACKAGE = ROOT / "batchrun"


def modules() -> dict[str, object]:
    """Dotted module name (without `batchrun.`; the package itself is `batchrun`) -> its file."""
    found = {}
    for f in sorted(PACKAGE.rglob("*.py")):
        parts = f.relative_to(PACKAGE).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts) or "batchrun"] = f
    return found


def imports(name: str, path) -> set[str]:
    """The package's modules that `name` imports (a `from X import y` of a submodule y counts as X.y)."""
    mods = modules()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    package_parts = [] if package in ("", "batchrun") else package.split(".")
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        targets = []
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package_parts[: len(package_parts) - (node.level - 1)]
            elif node.module and node.module.split(".")[0] == "batchrun":
                base = []
            else:
                continue
            module = [*base, *(node.module.split(".") if node.module else [])]
            if module[:1] == ["batchrun"]:
                module = module[1:]
            for alias in node.names:
                full = ".".join([*module, alias.name])
                targets.append(full if full in mods else ".".join(module) or "batchrun")
        elif isinstance(node, ast.Import):
            targets = [a.name[len("batchrun.") :] for a in node.names if a.name.startswith("batchrun.")]
        out.update(t for t in targets if t in mods and t != name)
    return out


def layers() -> dict[str, int]:
    """Module -> its layer's height, from docs/ARCHITECTURE.md's table (`engine.*`: every module of engine/)."""
    page = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    section = page[page.index("## How the code is laid out") :]
    table = [line for line in section.splitlines() if line.startswith("| ")][1:]  # the header row left out
    height = {}
    for level, line in enumerate(table):
        for name in re.findall(r"`([\w.*]+)`", line.split("|")[2]):
            height[name] = level
    return height


def layer_of(name: str, height: dict[str, int]) -> int:
    """The module's own row, or the row of the longest `folder.*` it is in (the folder's package itself too)."""
    if name in height:
        return height[name]
    folders = [f for f in height if f.endswith(".*") and (name + ".").startswith(f[:-1])]
    assert folders, f"module {name} is not in docs/ARCHITECTURE.md's layer table"
    return height[max(folders, key=len)]


def test_every_module_is_in_the_layer_table():
    height = layers()
    for name in modules():
        layer_of(name, height)  # raises for a module the table leaves out


def test_no_import_runs_up_a_layer():
    height = layers()
    upward = []
    for name, path in modules().items():
        for target in imports(name, path):
            if layer_of(target, height) > layer_of(name, height):
                upward.append(f"{name} -> {target}")
    assert not upward, upward


def test_no_import_circles():
    graph = {name: imports(name, path) for name, path in modules().items()}
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    circles = []

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                circles.append(" -> ".join([*path[path.index(nxt) :], nxt]))
            elif nxt not in state:
                visit(nxt, [*path, nxt])
        state[node] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
    assert not circles, circles


def test_the_walk_sees_imports_inside_functions(tmp_path):
    """The checks above can fail: an import inside a function, up a layer, is found."""
    probe = tmp_path / "probe.py"
    probe.write_text("def f():\n    from .job import Job\n    from . import llm\n")
    assert imports("rows", probe) >= {"job", "llm"}


# the packages transformers probes for that a folder at the checkout's root could be mistaken for
PROBED = ["kernels", "optimum", "gptqmodel", "bitsandbytes", "torchao", "compressed_tensors", "accelerate"]

_PROBE = """
import json, sys
from transformers.utils.import_utils import _is_package_available
taken = {}
for name in sys.argv[1:]:
    found, version = _is_package_available(name, return_version=True)
    if found:
        taken[name] = getattr(__import__(name), "__file__", None)
print(json.dumps(taken))
"""


def _taken_for_installed(names: list[str], cwd=ROOT) -> dict[str, str | None]:
    """Run from `cwd` (the checkout's root, as `python -m bench...` and make run): which of `names` transformers'
    own probe takes for an installed package, and the file it would import."""
    import json
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-c", _PROBE, *names], cwd=cwd, capture_output=True, text=True, check=True
    )
    return json.loads(out.stdout.splitlines()[-1])


def test_nothing_at_the_checkout_root_is_taken_for_transformers_optional_packages():
    """From the checkout's root a top-level folder is importable by its name: one named like a package
    transformers probes for (`kernels`, Hugging Face's hub-kernels library, which its MXFP4 and FP8 paths import on
    a GPU) must not be taken for it. kernels/ holds `batchrun_kernels` and has no __init__.py: `import kernels`
    finds an empty namespace package there, which transformers' probe does not count as installed."""
    assert (ROOT / "kernels" / "batchrun_kernels" / "__init__.py").exists()
    taken = _taken_for_installed(PROBED)
    ours = {name: path for name, path in taken.items() if path is None or path.startswith(str(ROOT / name))}
    installed_elsewhere = {name for name in taken if name not in ours}
    assert not ours, (
        f"taken for an installed package from the checkout: {ours} (installed: {installed_elsewhere})"
    )


def test_a_package_folder_where_python_runs_would_be_taken(tmp_path):
    """The probe above can fail: a folder with an __init__.py named like a probed package, where Python runs, is
    taken for it (made in a scratch folder, not the checkout, which other tests read at the same time)."""
    (tmp_path / "optimum").mkdir()
    (tmp_path / "optimum" / "__init__.py").write_text("")
    assert _taken_for_installed(["optimum"], cwd=tmp_path)["optimum"].startswith(str(tmp_path / "optimum"))
