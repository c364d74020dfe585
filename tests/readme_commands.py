"""The commands of the README's "Running on a cluster" section, for the tests that run them."""

from __future__ import annotations

import re
import shlex
import sys
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"


def cluster_commands() -> list[list[str]]:
    """Every command line in the section's bash blocks, split as a shell would."""
    text = README.read_text()
    section = text.split("\n## Running on a cluster\n", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```bash\n(.*?)```", section, re.S)
    return [shlex.split(line) for block in blocks for line in block.splitlines() if line.strip()]


def command(starts: str, contains: str = "", *, overrides: list[str] = ()) -> list[str]:
    """The README command whose first word is `starts` (and that contains `contains`), runnable here:
    ``python`` is this interpreter, and README overrides of keys in `overrides` give way to those."""
    found = [c for c in cluster_commands() if c[0] == starts and contains in " ".join(c)]
    assert len(found) == 1, f"README's 'Running on a cluster' should have one {starts!r} command with {contains!r}"
    keys = {o.split("=", 1)[0] for o in overrides}
    argv = [sys.executable if word == "python" else word for word in found[0]]
    return [w for w in argv if w.split("=", 1)[0] not in keys or "=" not in w] + list(overrides)
