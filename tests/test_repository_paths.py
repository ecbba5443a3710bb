"""The repository is self-contained: no tracked file names a path outside it (the sibling `shared` folder of the
machine it was developed on, or an absolute path under that machine's work folder), so a fresh clone runs alone."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# A relative path up into the sibling `shared` folder, or an absolute path under the work folder (not the tail of a
# URL or of a longer path such as /home/x/work/).
OUTSIDE_PATH = re.compile(r"\.\.[/\\]shared\b|(?<![\w.:/~-])/(?:work)/")


def tracked_text_files() -> list[Path]:
    """The files git tracks (as committed or staged), binary ones (a NUL byte) left out."""
    names = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, check=True, capture_output=True).stdout
    files = []
    for name in names.decode().split("\0"):
        path = REPO / name
        if name and path.is_file() and b"\0" not in path.read_bytes():
            files.append(path)
    return files


def test_the_pattern_finds_outside_paths_and_only_them() -> None:
    up, work = "..", "work"  # spelled in pieces, so that this file passes its own scan
    for outside in (f"{up}/shared/data/eval/mt_bench.jsonl", f"see `{up}/shared/DESIGN.md`", f"{up}\\shared\\x",
                    f"/{work}/main/.venv/bin/python", f"cd /{work}/wt-x && make"):
        assert OUTSIDE_PATH.search(outside), outside
    for inside in ("mtp_train/evaluate/prompt_sets/mt_bench.jsonl", "shared/ experts", "a shared machine",
                   f"https://example.org/{work}/x", f"/home/me/{work}/x", f"runs/{work}/x", f"~/{work}/x"):
        assert not OUTSIDE_PATH.search(inside), inside


def test_no_tracked_file_names_a_path_outside_the_repository() -> None:
    files = tracked_text_files()
    assert any(path.name == "pyproject.toml" for path in files) and len(files) > 50
    hits = [f"{path.relative_to(REPO)}:{number}: {line.strip()[:100]}"
            for path in files
            for number, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), start=1)
            if OUTSIDE_PATH.search(line)]
    assert not hits, "paths outside the repository (a fresh clone has none of them):\n" + "\n".join(hits)
