"""The launcher's terminal: rank prefixes, progress bars, banners split over reads."""

from __future__ import annotations

import io

from rdkeras._workers import _Terminal

BANNER = b"WARNING: All log messages before absl::InitializeLog() is called\n"


def _terminal(verbose: bool = False) -> tuple[_Terminal, io.BytesIO]:
    out = io.BytesIO()
    return _Terminal(out, verbose), out


def test_a_banner_split_over_two_reads_is_left_out():
    terminal, out = _terminal()
    terminal.write(1, BANNER[:30])
    terminal.write(0, b"real output\n")
    terminal.write(1, BANNER[30:] + b"real output\n")
    assert out.getvalue() == b"[0] real output\n[1] real output\n"


def test_verbose_keeps_banners():
    terminal, out = _terminal(verbose=True)
    terminal.write(0, BANNER[:10])
    terminal.write(0, BANNER[10:])
    assert out.getvalue() == b"[0] " + BANNER


def test_a_held_line_start_is_written_when_released():
    terminal, out = _terminal()
    terminal.write(0, b"\r 1/10 [==>")
    assert out.getvalue() == b"\r"
    assert terminal.holding(0)
    terminal.release(0)
    assert out.getvalue() == b"\r[0]  1/10 [==>"
    terminal.write(0, b"\r 2/10 [====>\n")
    assert out.getvalue() == b"\r[0]  1/10 [==>\r[0]  2/10 [====>\n"


def test_another_ranks_line_starts_on_a_new_line():
    terminal, out = _terminal()
    terminal.write(0, b"epoch 1")
    terminal.release(0)
    terminal.write(1, b"done\n")
    assert out.getvalue() == b"[0] epoch 1\n[1] done\n"
