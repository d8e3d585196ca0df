"""The docs must not drift from the code: env table, hook signatures, Quick start vs CI, links.

Where each piece lives: the env table in docs/configuration.md, the hook reference in docs/plugins.md, the
Quick start in README.md.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from deepinfer import envs
from deepinfer.plugins.manager import pm

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
CONFIGURATION = (ROOT / "docs" / "configuration.md").read_text()
PLUGINS = (ROOT / "docs" / "plugins.md").read_text()
ENV_TABLE = re.compile(r"<!-- env-table:start -->\n(.*?)\n<!-- env-table:end -->", re.DOTALL)
HEADINGS = [line[4:].strip() for line in PLUGINS.splitlines() if line.startswith("### ")]
LINKED_PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
CODE = re.compile(r"^```.*?^```|`[^`\n]*`", re.DOTALL | re.MULTILINE)


def _hook_signatures() -> list[str]:
    callers = [caller for name, caller in vars(pm.hook).items() if not name.startswith("_") and caller.has_spec()]
    return sorted(f"{caller.name}({', '.join(caller.spec.argnames)})" for caller in callers)


def _quick_start_commands() -> list[str]:
    section = re.search(r"^## Quick start\n(.*?)(?=^## )", README, re.DOTALL | re.MULTILINE)
    assert section, "README has no '## Quick start' section followed by another '## ' section"
    return [block.strip() for block in re.findall(r"^```bash\n(.*?)^```", section.group(1), re.DOTALL | re.MULTILINE)]


def _anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped (but - and _), spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower().replace("`", ""))
    return text.replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    text = CODE.sub("", page.read_text())
    return {_anchor(line.lstrip("#")) for line in text.splitlines() if re.match(r"#{1,6} ", line)}


def _relative_links() -> list[tuple[str, str]]:
    links = []
    for page in LINKED_PAGES:
        for target in LINK.findall(CODE.sub("", page.read_text())):
            if not re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto: are not checked
                links.append((str(page.relative_to(ROOT)), target))
    return links


def test_env_table_matches_registry():
    tables = ENV_TABLE.findall(CONFIGURATION)
    assert len(tables) == 1, "docs/configuration.md needs exactly one env table between the env-table markers"
    assert tables[0] == envs.markdown_table(), (
        "docs/configuration.md's env table is stale: paste `python -m deepinfer.envs`")


def test_env_table_lives_in_one_place():
    for page in LINKED_PAGES:
        if page.name != "configuration.md":
            assert "<!-- env-table:start -->" not in page.read_text(), f"{page.name} keeps a second env table"


def test_hookspecs_found():
    assert len(_hook_signatures()) >= 1


@pytest.mark.parametrize("signature", _hook_signatures())
def test_plugin_hooks_are_documented(signature):
    assert any(signature in heading for heading in HEADINGS), f"docs/plugins.md needs a '### {signature}' heading"


def test_quick_start_has_two_one_line_commands():
    commands = _quick_start_commands()
    assert len(commands) == 2, f"Quick start must have exactly two bash blocks, found {len(commands)}"
    for command in commands:
        assert "\n" not in command, f"Quick start commands are one line each, got {command!r}"


def test_ci_runs_the_readme_test_command():
    test_command = _quick_start_commands()[1]
    ci_lines = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert test_command in ci_lines, f".ci/run must run the README's test command verbatim: {test_command}"


@pytest.mark.parametrize("script", ["build.sh", ".ci/run"])
def test_scripts_are_executable(script):
    # The Quick start runs ./build.sh directly; a clean clone gets the mode git recorded.
    assert os.access(ROOT / script, os.X_OK), f"chmod +x {script} (and commit the mode)"


def test_docs_have_relative_links():
    assert len(_relative_links()) > 10


@pytest.mark.parametrize("page, target", _relative_links())
def test_relative_links_resolve(page, target):
    path, _, fragment = target.partition("#")
    file = (ROOT / page).parent / path if path else ROOT / page
    assert file.exists(), f"{page} links to {target}, but {file.relative_to(ROOT)} does not exist"
    if fragment and file.suffix == ".md":
        assert fragment in _anchors(file), f"{page} links to {target}, but {path or page} has no such heading"
