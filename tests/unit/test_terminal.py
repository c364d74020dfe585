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


def test_a_machine_without_a_gpu_is_not_told_so_as_an_error():
    terminal, out = _terminal()
    cuinit = (
        b"E0000 00:00:1796210187.797678   28305 cuda_platform.cc:52] failed call to cuInit: INTERNAL: CUDA error: "
        b"Failed call to cuInit: UNKNOWN ERROR (303)\n"
    )
    terminal.write(0, cuinit + b"Epoch 1/3\n")
    assert out.getvalue() == b"[0] Epoch 1/3\n"
