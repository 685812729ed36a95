"""The README states the contract; these facts have one source in the code, and the README must agree."""

import re
import subprocess

from helpers import BATCHRUN, ROOT

from batchrun.rows import OUTPUT_COLUMNS
from batchrun.stats import COLUMNS, SUMMARY_KEYS

README = (ROOT / "README.md").read_text()


def _section(title: str) -> str:
    start = README.index(f"\n## {title}")
    end = README.find("\n## ", start + 1)
    return README[start : end if end >= 0 else None]


def test_readme_lists_exactly_the_summary_keys():
    m = re.search(r"Summary keys: `([^`]*)`", README)
    assert m, "the README's 'Summary keys:' list"
    listed = [k.strip() for k in m.group(1).replace("\n", " ").split(",") if k.strip()]
    assert listed == list(SUMMARY_KEYS), "README summary keys differ from stats.SUMMARY_KEYS (order included)"


def test_readme_output_table_has_exactly_the_output_columns():
    lines = _section("Outputs").splitlines()
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


def test_readme_names_every_statistics_column():
    section = _section("Outputs")
    missing = [c for c in COLUMNS if not re.search(rf"[`, ]{c}[`,]", section)]
    assert not missing, f"statistics columns the README does not name: {missing}"


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


def test_the_readme_command_table_and_help_agree():
    """Issue 24, item 15: every option of every command is in the README's row for it and the other way round,
    and the top-level --help cuts no description short."""
    import click

    from batchrun.cli import main

    rows = {}
    for line in _section("Commands").splitlines():
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
