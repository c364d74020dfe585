"""Budgets the project holds itself to, as checks (issue 47): file sizes, CHANGELOG lines, the architecture
document's length, and the paths the architecture documents name."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MAX_LINES = 400
# Files in rdkeras/ allowed past MAX_LINES, each with its reason: at most MAX_LONG_FILES, and the list only
# shrinks (a file back under the budget must leave it).
MAX_LONG_FILES = 1
LONG_FILES = {
    "rdkeras/keras_internals.py": "the seam: every private Keras name in one module, by the house rule",
}
CHANGELOG_WIDTH = 160
# Paths docs/architecture.md names that are not in the repository by design: what a build or a run writes (the
# op library's cache folder, a run's files), Keras's own config file, and the configs' copies inside the wheel.
MADE_ELSEWHERE = ("build/", "bench-results/", "one_process/", "ops/", "report.md", "results.json",
                  "resolved_config.yaml", "keras.json", "rdkeras/conf/", "rdkeras/recipes/")  # fmt: skip


def _tracked() -> list[str]:
    # The repository's files, those not yet added too (but not what .gitignore leaves out: builds, caches).
    argv = ["git", "ls-files", "--cached", "--others", "--exclude-standard"]
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, check=True)
    return done.stdout.split()


def test_no_file_in_the_package_is_over_its_budget_unless_listed_with_a_reason():
    lengths = {f: len((ROOT / f).read_text().splitlines()) for f in _tracked()
               if f.startswith("rdkeras/") and f.endswith(".py")}  # fmt: skip
    over = {f for f, n in lengths.items() if n > MAX_LINES}
    unlisted = sorted(f"{f} ({lengths[f]} lines)" for f in over - set(LONG_FILES))
    assert not unlisted, f"over {MAX_LINES} lines: {unlisted}: split them, or list one in LONG_FILES with why"
    stale = sorted(f for f in LONG_FILES if f not in over)
    assert not stale, f"back within {MAX_LINES} lines (or gone): take {stale} off LONG_FILES"
    assert all(reason.strip() for reason in LONG_FILES.values())
    assert len(LONG_FILES) <= MAX_LONG_FILES, (
        f"{len(LONG_FILES)} files allowed past the budget; at most {MAX_LONG_FILES}"
    )


def test_changelog_lines_are_short():
    long = [(i, len(line)) for i, line in enumerate((ROOT / "CHANGELOG.md").read_text().splitlines(), 1)
            if len(line) > CHANGELOG_WIDTH]  # fmt: skip
    assert not long, f"CHANGELOG.md lines over {CHANGELOG_WIDTH} characters (line, length): {long}; wrap them"


def _named_paths(text: str) -> set[str]:
    """The file and folder paths a Markdown text names in backticks: a token ending in a file extension (a
    ``:symbol`` after it allowed) or in "/", or starting with a top folder of the repository. Braces expand
    (``handshake.{h,cc}``)."""
    found = set()
    for token in re.findall(r"`([^`\s]+)`", text):
        token = token.split(":")[0]
        if token.startswith(("/", "~", "<", "$", "-", "http")) or "*" in token:
            continue
        shaped = re.search(r"\.(py|pyi|cc|h|sh|md|yaml|toml|gz|txt|json)$", token) or token.endswith("/")
        if not shaped and not token.startswith(("rdkeras/", "csrc/", "tests/", "docs/", "conf/", "recipes/")):
            continue
        brace = re.search(r"\{([^}]*)\}", token)
        found.update(token.replace(brace.group(0), part) for part in brace.group(1).split(",")) if brace else found.add(
            token
        )
    return found


def _missing(names: set[str]) -> list[str]:
    """The names no file or folder of the repository ends with (by whole path components)."""
    tracked = _tracked()
    folders = {str(p) + "/" for f in tracked for p in Path(f).parents if str(p) != "."}
    everything = ["/" + f for f in tracked] + ["/" + d for d in folders]
    return sorted(
        n for n in names
        if not n.startswith(MADE_ELSEWHERE) and not re.search(r"[A-Z]{2,}", n)  # NAME, RANK: placeholders
        and not any(p.endswith("/" + n) or p.endswith("/" + n.rstrip("/") + "/") for p in everything)
    )  # fmt: skip


# The architecture document and the ones it links for the detail.
ARCHITECTURE = ("architecture.md", "engine.md", "parallelism.md", "operations.md", "development.md")
ARCHITECTURE_LINES = 500


@pytest.mark.parametrize("document", ARCHITECTURE)
def test_every_path_the_architecture_documents_name_exists(document):
    names = _named_paths((ROOT / "docs" / document).read_text())
    assert len(names) > 10  # the extraction sees the document's paths
    missing = _missing(names)
    assert not missing, f"docs/{document} names paths the repository does not have: {missing}"


def test_the_architecture_document_is_a_map_not_a_manual():
    text = (ROOT / "docs" / "architecture.md").read_text()
    lines = len(text.splitlines())
    assert lines <= ARCHITECTURE_LINES, f"docs/architecture.md has {lines} lines: move detail to the documents it links"
    # No measurements: they belong in docs/evaluation.md and docs/reliability.md.
    measured = re.findall(r"\d+(?:\.\d+)?\s?(?:ms|µs|us|GB/s|MB/s|Gbit/s|%|×)(?![\w])", text)
    assert not measured, f"docs/architecture.md quotes measurements {measured}: link docs/evaluation.md instead"


def test_the_path_check_sees_paths_and_what_is_missing():
    text = "`rdkeras/gone.py`, `csrc/engine/handshake.{h,cc}:Handshake`, `elastic/next` (a key), `parallel/`"
    assert _named_paths(text) == {"rdkeras/gone.py", "csrc/engine/handshake.h", "csrc/engine/handshake.cc", "parallel/"}
    assert _missing(_named_paths(text)) == ["rdkeras/gone.py"]
