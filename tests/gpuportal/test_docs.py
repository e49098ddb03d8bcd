"""The documentation a newcomer reads: a short README whose quickstart (the two commands, a first
deploy and a first request) comes at once, docs whose links lead to files of this repository, and
an architecture page that describes every replica state. No stack: test_readme.py runs the
quickstart itself."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
PAGES = [README, *DOCS, ROOT / "docker" / "README.md"]

README_MAX_LINES = 150
QUICKSTART_WITHIN = 40

# [text](target) and ![alt](target); a target with a scheme (https:, mailto:) is not a file.
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
SCHEME = re.compile(r"^[a-z][a-z0-9+.-]*:", re.I)
FENCE = re.compile(r"^```.*?^```", re.S | re.M)


def prose(text: str) -> str:
    """The page without its fenced code blocks (what a link in a shell comment says is not a link)."""
    return FENCE.sub("", text)


def anchors(page: Path) -> set[str]:
    """The anchors GitHub gives the page's headings: lower case, punctuation dropped, spaces to -."""
    headings = re.findall(r"^#+ (.+)$", prose(page.read_text()), flags=re.M)
    return {re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-") for heading in headings}


def test_the_docs_are_there():
    assert {page.name for page in DOCS} >= {"operating.md", "api.md", "architecture.md"}


def test_the_readme_is_short():
    lines = README.read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines; move the details to docs/"


def test_the_quickstart_comes_within_the_first_lines_of_the_readme():
    top = "\n".join(README.read_text().splitlines()[:QUICKSTART_WITHIN]) + "\n"
    blocks = re.findall(r"^```sh\n(.*?)^```", top, flags=re.S | re.M)
    commands = [line.split("#")[0].strip() for block in blocks for line in block.splitlines()]
    assert "make run" in commands and "make test" in commands, blocks
    shell = "\n".join(blocks)
    # The address from where `up` wrote it, so that the commands work on any port as typed.
    assert re.search(r"^PORTAL=.*var/stack\.env", shell, flags=re.M), "no address step"
    assert re.search(r"curl .*\$PORTAL/api/auth/token/", shell), "no token step"
    assert re.search(r"curl .*\$PORTAL/api/deployments/ -d", shell), "no first deploy"
    assert re.search(r"\$PORTAL/api/deployments/[\w-]+/infer/", shell), "no first request"


@pytest.mark.parametrize("page", PAGES, ids=lambda page: str(page.relative_to(ROOT)))
def test_every_relative_link_leads_to_a_file_of_the_repository(page):
    broken = []
    for target in LINK.findall(prose(page.read_text())):
        if SCHEME.match(target):
            continue
        path, _, anchor = target.partition("#")
        resolved = (page.parent / path).resolve() if path else page
        if not resolved.is_relative_to(ROOT) or not resolved.exists():
            broken.append(f"{target}: no such file in the repository")
        elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
            broken.append(f"{target}: {resolved.name} has no heading #{anchor}")
    assert broken == []


@pytest.mark.parametrize("page", PAGES, ids=lambda page: str(page.relative_to(ROOT)))
def test_no_path_named_in_the_docs_leads_out_of_the_repository(page):
    outside = [
        path
        for path in re.findall(r"(?<![\w.])(?:\.\./)+[\w./-]*", page.read_text())
        if not (page.parent / path).resolve().is_relative_to(ROOT)
    ]
    assert outside == []


def test_the_architecture_describes_every_replica_state():
    from scheduling.models import Replica

    text = (ROOT / "docs" / "architecture.md").read_text()
    section = text[text.index("\n## Replica states\n") :]
    section = section[: section.index("\n## ", 1)]
    # The state diagram is generated between these two lines; each is on a line of its own, once.
    lines = section.splitlines()
    assert lines.count("<!-- state-diagram:begin -->") == 1
    assert lines.count("<!-- state-diagram:end -->") == 1
    assert lines.index("<!-- state-diagram:begin -->") < lines.index("<!-- state-diagram:end -->")
    missing = [state for state in Replica.State.values if f"**{state}**" not in section]
    assert missing == []
