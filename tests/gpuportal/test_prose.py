"""The prose in the code stands on its own. A comment or docstring says why in words: it cites no
issue by number, since a reader of the repository does not have the issue documents. And every
package opens with a docstring naming its room: what lives in it and what it may import."""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("gpuportal", "scheduling", "inference", "bench", "tests")

# Built from pieces so that this file does not cite what it looks for. The word, singular or
# plural, then a number, perhaps after a '#' or across a wrapped comment line ("issue\n    # 16").
_WORD = "[Ii]" + "ssues?"
CITATION = re.compile(r"\b" + _WORD + r"(?:[ \t]*\n[ \t]*#?)?[ \t]*#?\d")
# A bare number after a hash in a comment (GitHub's way of naming an issue); strings are left
# alone, since the portal prints a queue position or a replica's index that way.
BARE_NUMBER = re.compile(r"(?<![\w&#])#" + r"\d+\b")


def python_files() -> list[Path]:
    return sorted(
        path
        for package in PACKAGES
        for path in (ROOT / package).rglob("*.py")
        if not {".venv", "__pycache__"} & set(path.relative_to(ROOT).parts)
    )


def citations(text: str) -> list[str]:
    """Each citation of an issue number in a module's text, with its line number."""
    found = [f"{text.count(chr(10), 0, m.start()) + 1}: {m.group(0)!r}" for m in CITATION.finditer(text)]
    if not BARE_NUMBER.search(text):
        return found  # no '#<number>' anywhere: no comment holds one (tokenizing it all took seconds)
    for token in tokenize.generate_tokens(io.StringIO(text).readline):
        if token.type == tokenize.COMMENT:
            found += [f"{token.start[0]}: {m.group(0)!r}" for m in BARE_NUMBER.finditer(token.string.lstrip("#"))]
    return found


def test_the_citation_check_finds_issue_numbers_and_nothing_else():
    word = "iss" + "ue"
    cited = [
        f"# the host cache ({word} 19)",
        f"# {word}s 4 and 7",
        f'"""{word.capitalize()} 21\'s planner."""',
        f"# the barrier of {word} #5",
        f"# a /v1 call never hangs ({word}\n    # 16).",
        f'"""placed on the fullest GPU ({word}\n    18)."""',
        "# fixed in #12",
    ]
    plain = [
        f"# the {word}'s five colours",
        f"# filled in by the KV-cache {word}; null until then",
        "# tissue 5, issued 3 times",
        'assert line == "loading tiny 40 %, #2 in line"',
        "x = 1  # tiny-a#0 is the first replica of tiny-a",
    ]
    assert [text for text in cited if not citations(text)] == []
    assert [text for text in plain if citations(text)] == []


def test_no_code_cites_an_issue_number():
    files = python_files()
    assert len(files) > 100, "the walk found the project's modules"
    offenders = [f"{path.relative_to(ROOT)}:{hit}" for path in files for hit in citations(path.read_text())]
    assert offenders == [], "\n".join(offenders)


def test_every_package_opens_with_a_docstring_naming_its_room():
    inits = [path for path in python_files() if path.name == "__init__.py" and "migrations" not in path.parts]
    assert len(inits) > 10, "the walk found the project's packages"
    missing = [
        str(path.relative_to(ROOT))
        for path in inits
        if not (ast.get_docstring(ast.parse(path.read_text())) or "").strip()
    ]
    assert missing == []
