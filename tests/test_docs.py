"""The README and the guides say what the code does: every YAML example validates as the config or
cluster file it shows, and every `hetforge` command line parses with the flags it uses."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
import yaml

from hetforge.cli import _parser
from hetforge.config import build_config
from hetforge.cluster.spec import read_cluster_file

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def blocks(page: Path, lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", page.read_text(encoding="utf-8"), flags=re.S)


def commands(page: Path) -> list[str]:
    """`hetforge ...` lines of the page's shell blocks, continuation lines joined, comments dropped."""
    out = []
    plain = ["\n".join(ln for ln in b.splitlines() if ln.startswith(("hetforge ", "$ hetforge ")))
             for b in blocks(page, "")]  # untagged blocks: their command lines, not their output
    for block in blocks(page, "bash") + plain:
        text = re.sub(r"\\\n\s*", " ", block)
        for line in text.splitlines():
            line = line.split(" #")[0].strip()
            if "[" in line or "|" in line or "..." in line:  # a synopsis, not a command to run
                continue
            line = line.removeprefix("$ ")
            m = re.search(r"(?:^|\s|/)hetforge (.*)$", line) or re.search(r"-m hetforge (.*)$", line)
            if m and not line.startswith("#"):
                out.append(m.group(1))
    return out


@pytest.mark.parametrize("page", PAGES, ids=[p.name for p in PAGES])
def test_yaml_examples_validate(page, tmp_path):
    for text in blocks(page, "yaml"):
        raw = yaml.safe_load(text)
        if not isinstance(raw, dict):
            continue
        if set(raw) == {"nodes"}:
            path = tmp_path / "cluster.yaml"
            path.write_text(text)
            assert read_cluster_file(path)
        else:
            build_config(raw)  # raises ConfigError, naming the field, where the page is wrong


@pytest.mark.parametrize("page", PAGES, ids=[p.name for p in PAGES])
def test_command_lines_parse(page):
    parser = _parser()
    for line in commands(page):
        args = shlex.split(line)
        if not args or args[0] in ("--help", "-h") or "--help" in args:
            continue
        parser.parse_args([a if not a.isupper() else "X" for a in args])


def test_the_readme_is_short_and_links_every_guide():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 250
    for page in (ROOT / "docs").glob("*.md"):
        assert f"docs/{page.name}" in readme, page.name
