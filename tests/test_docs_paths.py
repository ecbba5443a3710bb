"""The repository paths a document names exist: every `mtp_train/...`, `scripts/...`, `recipes/...`, `docs/...` and
`tests/...` path written in it (relative to the repository root), and every relative Markdown link (relative to the
document's folder). A doc that names a file which was renamed or removed misleads the reader who follows it.

The test checks every page under docs/ and the README. A file the user writes themselves is named without a
repository folder in front (`my-70b.yaml`, not `recipes/my-70b.yaml`).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
DOCS_DIR = REPO / "docs"

# The documents whose paths must all exist: every page under docs/ and the README (relative to docs/).
CHECKED = tuple(sorted(path.name for path in DOCS_DIR.glob("*.md"))) + ("../README.md",)

# A repository path: one of the checked top-level folders, not preceded by a character that would make it the tail of
# another path (`../other/docs/x`, `vllm/tests/x`, a URL) or of a word.
_REPO_PATH = re.compile(r"(?<![\w./\-~])((?:mtp_train|scripts|recipes|docs|tests)/[\w./\-]*)")
# Characters that, right after a path, make it a pattern rather than a file (`recipes/<name>.yaml`, `{split}/...`,
# `mtp_train/export/*.py`, `$OUT/...`).
_PLACEHOLDER_NEXT = set("<>{}*$[")
# A Markdown inline link or image: [text](target) / ![alt](target).
_MD_LINK = re.compile(r"\]\(([^()\s]+)(?:\s+\"[^\"]*\")?\)")


def named_paths(text: str) -> list[str]:
    """The repository paths `text` names (trailing sentence dots removed), patterns left out, in order."""
    found = []
    for match in _REPO_PATH.finditer(text):
        following = text[match.end() : match.end() + 1]
        if following and following in _PLACEHOLDER_NEXT:
            continue
        path = match.group(1).rstrip(".")
        if path:
            found.append(path)
    return found


def link_targets(text: str) -> list[str]:
    """The relative targets of the Markdown links in `text`, without their #fragment (URLs and in-page anchors left
    out)."""
    targets = []
    for target in _MD_LINK.findall(text):
        if re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", target) or target.startswith("#"):
            continue  # a URL (https:, mailto:, ...) or an anchor in the same document
        path = target.split("#", 1)[0]
        if path:
            targets.append(path)
    return targets


def missing_paths(doc: Path, repo: Path = REPO) -> list[str]:
    """'line N: path' for every path or relative link in `doc` that does not exist."""
    missing = []
    for number, line in enumerate(doc.read_text(encoding="utf-8").splitlines(), start=1):
        for path in named_paths(line):
            if not (repo / path).exists():
                missing.append(f"line {number}: {path}")
        for target in link_targets(line):
            if not (doc.parent / target).exists():
                missing.append(f"line {number}: link {target}")
    return missing


@pytest.mark.parametrize("name", CHECKED)
def test_every_path_a_doc_names_exists(name):
    doc = DOCS_DIR / name
    assert doc.is_file(), f"{doc} is listed in CHECKED but does not exist"
    missing = missing_paths(doc)
    assert missing == [], f"{doc.relative_to(REPO)} names paths that do not exist:\n" + "\n".join(missing)


def test_the_path_finder_reads_paths_and_skips_patterns_and_foreign_paths():
    text = ("See `mtp_train/runtime/model.py`, scripts/check_serving.py. and recipes/<name>.yaml or "
            "mtp_train/export/*.py; not vllm/tests/x.py, ../other/docs/a.md, https://x.org/docs/b.md, "
            "nor mtp_train.runtime.model. Also docs/export.md#formats and tests/.")
    assert named_paths(text) == ["mtp_train/runtime/model.py", "scripts/check_serving.py", "docs/export.md",
                                 "tests/"]


def test_the_link_finder_keeps_relative_links_only():
    text = ("[a](export.md) [b](export.md#formats) [c](#design) [d](https://github.com/x/y) "
            "![e](../docs/img.png \"title\") [f](mailto:a@b.c)")
    assert link_targets(text) == ["export.md", "export.md", "../docs/img.png"]


def test_a_missing_path_and_a_broken_link_are_reported(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "mtp_train").mkdir()
    (tmp_path / "mtp_train" / "recipe.py").write_text("")
    (tmp_path / "docs" / "other.md").write_text("")
    doc = tmp_path / "docs" / "page.md"
    doc.write_text("mtp_train/recipe.py exists, mtp_train/gone.py does not.\n"
                   "[ok](other.md) [broken](missing.md#part)\n", encoding="utf-8")
    assert missing_paths(doc, repo=tmp_path) == ["line 1: mtp_train/gone.py", "line 2: link missing.md"]
