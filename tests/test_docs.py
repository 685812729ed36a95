"""The README and the pages of docs/ state the contract; these facts have one source in the code, and the page
that holds each must agree. The README is the front door: short, and every page it points at is there."""

import dataclasses
import re
import subprocess

from helpers import BATCHRUN, ROOT

from batchrun.rows import OUTPUT_COLUMNS
from batchrun.stats import COLUMNS, SUMMARY_KEYS

README = ROOT / "README.md"
DOCS = ROOT / "docs"


def _page(name: str) -> str:
    return (DOCS / name).read_text()


def _section(text: str, title: str) -> str:
    start = text.index(f"\n## {title}")
    end = text.find("\n## ", start + 1)
    return text[start : end if end >= 0 else None]


def _links(path) -> list[str]:
    """The relative targets of the markdown links in `path`, without their #anchors."""
    targets = re.findall(r"\]\(([^)\s]+)\)", path.read_text())
    return [t.partition("#")[0] for t in targets if not re.match(r"[a-z]+:", t) and not t.startswith("#")]


def test_the_readme_is_a_front_door():
    """Issue 66, item 7: at most 200 lines; the rest is in docs/, and every page it points at exists."""
    assert len(README.read_text().splitlines()) <= 200
    pages = [t for t in _links(README) if t.startswith("docs/")]
    assert pages, "the README points at no docs/ page"
    missing = [t for t in _links(README) if not (ROOT / t).exists()]
    assert not missing, missing


def test_every_relative_link_in_docs_resolves():
    broken = [
        (p.name, t) for p in sorted(DOCS.glob("*.md")) for t in _links(p) if not (p.parent / t).exists()
    ]
    assert not broken, broken


def test_statistics_page_lists_exactly_the_summary_keys():
    m = re.search(r"Summary keys: `([^`]*)`", _page("statistics.md"))
    assert m, "docs/statistics.md's 'Summary keys:' list"
    listed = [k.strip() for k in m.group(1).replace("\n", " ").split(",") if k.strip()]
    assert listed == list(SUMMARY_KEYS), (
        "docs/statistics.md's keys differ from stats.SUMMARY_KEYS (order included)"
    )


def test_output_table_has_exactly_the_output_columns():
    lines = _section(_page("inputs-outputs.md"), "Outputs").splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith("| column"))
    table = []
    for line in lines[first:]:
        if not line.startswith("|"):
            break
        table.append(line)
    names = []
    for line in table:
        cell = line.split("|")[1].strip() if line.startswith("|") else ""
        if cell and cell not in ("column", "passthrough columns") and not set(cell) <= set("- "):
            names += [c.strip() for c in cell.split(",")]
    assert names == OUTPUT_COLUMNS


def test_statistics_page_names_every_statistics_column():
    section = _section(_page("statistics.md"), "The statistics file")
    missing = [c for c in COLUMNS if not re.search(rf"[`, ]{c}[`,]", section)]
    assert not missing, f"statistics columns docs/statistics.md does not name: {missing}"


def test_no_file_cites_a_document_outside_the_repository():
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True).stdout.split()
    outside = ("DESIGN.md", "../shared/", "VLLM_CPU.md")
    citing = [
        f
        for f in files
        if f != "tests/test_docs.py" and any(d in (ROOT / f).read_text(errors="ignore") for d in outside)
    ]
    assert not citing, citing


def test_commands_that_need_no_model_do_not_import_torch(tmp_path):
    """`batchrun validate` and `batchrun stats` start in a fraction of a second: no torch, no transformers."""
    import sys

    code = (
        "import sys, batchrun.cli, batchrun.report, batchrun.status, batchrun.sources, batchrun.model_loader, "
        "batchrun.config; bad = [m for m in ('torch', 'transformers') if m in sys.modules]; print(bad)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", out


def test_the_command_table_and_help_agree():
    """Issue 24, item 15: every option of every command is in docs/cli.md's row for it and the other way round,
    and the top-level --help cuts no description short."""
    import click

    from batchrun.cli import main

    rows = {}
    for line in _section(_page("cli.md"), "Commands").splitlines():
        m = re.match(r"\| `batchrun (\w+)([^|]*(?:\\\|[^|]*)*)` \|", line)
        if m:
            rows[m.group(1)] = set(re.findall(r"--[a-z][a-z-]*", m.group(2)))
    assert set(rows) == set(main.commands), (set(rows), set(main.commands))
    for name, command in main.commands.items():
        options = {
            o for p in command.params if isinstance(p, click.Option) for o in p.opts + p.secondary_opts
        }
        options = {o for o in options if o.startswith("--") and o != "--help"}
        assert rows[name] == options, (name, rows[name] ^ options)
        assert all(p.help for p in command.params if isinstance(p, click.Option)), name
    top = subprocess.run([BATCHRUN, "--help"], capture_output=True, text=True, env={"COLUMNS": "80"}).stdout
    listing = top.split("Commands:")[1]
    assert "..." not in listing and len(listing.strip().splitlines()) == len(main.commands), top


def _definitions() -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """Each class of the package -> the names it defines (methods, fields, attributes it sets on self), and
    each module (its file's stem; a package's folder name) -> its top-level names."""
    import ast

    classes: dict[str, set[str]] = {}
    modules: dict[str, set[str]] = {}
    for path in sorted((ROOT / "batchrun").rglob("*.py")):
        tree = ast.parse(path.read_text())
        top = modules.setdefault(path.parent.name if path.name == "__init__.py" else path.stem, set())
        package = path.parent.parent if path.name == "__init__.py" else path.parent
        modules.setdefault(package.name, set()).add(
            path.parent.name if path.name == "__init__.py" else path.stem
        )
        for node in tree.body:
            if isinstance(node, ast.ImportFrom):
                top.update(a.asname or a.name for a in node.names)
            targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
            top.update(t.id for t in targets if isinstance(t, ast.Name))
            if isinstance(node, ast.FunctionDef | ast.ClassDef):
                top.add(node.name)
            if isinstance(node, ast.ClassDef):
                names = classes.setdefault(node.name, set())
                for n in ast.walk(node):
                    if isinstance(n, ast.FunctionDef):
                        names.add(n.name)
                    elif isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store):
                        names.add(n.id)
                    elif isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store):
                        names.add(n.attr)
    return classes, modules


def test_the_architecture_page_names_only_what_exists():
    """docs/ARCHITECTURE.md is a map of the code: every file it names is in the tree, every `Class.name` is
    defined in that class and every `module.name` in that module (a job file's `engine.key` is an
    EngineConfig field), and every class it names is one of the package's."""
    from batchrun.config import ModelSpec
    from batchrun.engine.config import EngineConfig

    doc = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    classes, modules = _definitions()
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True).stdout.split()
    stems = {f.rpartition("/")[2] for f in tracked}
    wrong = [f for f in re.findall(r"\b([\w/]+\.(?:py|cpp|h))\b", doc) if f.rpartition("/")[2] not in stems]
    folders = (ROOT, ROOT / "batchrun", ROOT / "batchrun" / "engine")
    for folder in re.findall(r"\b([\w/]+/)(?=[\s`)])", doc):
        wrong += [] if any((base / folder).is_dir() for base in folders) else [folder]
    for owner, name in set(re.findall(r"\b([A-Za-z_]\w*)\.([A-Za-z_]\w*)\b", doc)):
        if name in ("py", "cpp", "h", "md"):
            continue
        if owner in classes:
            wrong += [] if name in classes[owner] else [f"{owner}.{name}"]
        elif owner == "engine" and name in {f.name for f in dataclasses.fields(EngineConfig)}:
            continue
        elif owner == "model" and name in {f.name for f in dataclasses.fields(ModelSpec)}:
            continue  # a job file's `model.key`
        elif owner in modules:
            wrong += [] if name in modules[owner] else [f"{owner}.{name}"]
        elif owner[0].isupper():
            wrong.append(f"{owner}.{name}")
    camel = set(re.findall(r"`([A-Z][a-z]+[A-Z]\w*)`", doc))
    wrong += sorted(c for c in camel if c not in classes)
    assert not wrong, wrong
