"""``rdkeras postmortem``: the ranks' flight-recorder dumps lined up, and the rank that diverged first named."""

from __future__ import annotations

import json

from rdkeras import cli, flight, postmortem


def _dump(rank: int, ops: list[tuple[str, int]], *, unfinished: bool = False, world: int = 3) -> dict:
    collectives = [
        {"number": n, "op": op, "bytes": size, "members": world, "start_ns": n * 10**9, "end_ns": n * 10**9 + 1000,
         "failed": False}
        for n, (op, size) in enumerate(ops, 1)
    ]  # fmt: skip
    if unfinished and collectives:
        collectives[-1]["end_ns"] = 0
    return {"rank": rank, "world_size": world, "time": 0.0, "failure": {}, "collectives": collectives}


GRADS = ("allreduce ring grads", 64)


def test_the_rank_that_never_entered_the_next_collective_diverged_first():
    dumps = {
        0: _dump(0, [GRADS] * 4, unfinished=True),
        1: _dump(1, [GRADS] * 3),
        2: _dump(2, [GRADS] * 4, unfinished=True),
    }
    found = postmortem.diverged(dumps)
    assert found is not None and (found.rank, found.number) == (1, 4)
    assert "rank 1 never entered allreduce ring grads #4, which ranks [0, 2] entered" in found.why
    assert "its last, #3 (allreduce ring grads), finished" in found.why


def test_the_furthest_behind_is_named_ties_to_the_lower_rank():
    dumps = {r: _dump(r, [GRADS] * n) for r, n in [(0, 5), (1, 3), (2, 3)]}
    found = postmortem.diverged(dumps)
    assert found is not None and (found.rank, found.number) == (1, 4)


def test_a_collective_called_otherwise_by_one_rank_is_where_it_diverged():
    other = ("allreduce ring grads", 128)
    dumps = {0: _dump(0, [GRADS, GRADS, GRADS]), 1: _dump(1, [GRADS, GRADS, GRADS]), 2: _dump(2, [GRADS, other, GRADS])}
    found = postmortem.diverged(dumps)
    assert found is not None and (found.rank, found.number) == (2, 2)
    assert "with 128 bytes where ranks [0, 1] called allreduce ring grads with 64 bytes" in found.why


def test_records_that_agree_name_nobody():
    assert postmortem.diverged({r: _dump(r, [GRADS] * 3) for r in range(3)}) is None
    assert postmortem.diverged({0: _dump(0, [GRADS])}) is None


def test_the_command_reads_a_folder_of_dumps(tmp_path, capsys):
    for r, n in [(0, 4), (2, 3)]:
        (tmp_path / f"flight-{r}.json").write_text(json.dumps(_dump(r, [GRADS] * n)))
    (tmp_path / "flight-9.json").write_text("not json")
    assert cli.main(["postmortem", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "rank 0: dumped at" in out and "no dump from rank(s) [1]" in out
    assert "diverged first: rank 2 never entered allreduce ring grads #4" in out
    assert cli.main(["postmortem", str(tmp_path / "none")]) == 2


def test_a_dump_is_written_once_per_rank(tmp_path):
    class Backend:
        world_size = 2
        flight_record = ((1, "allreduce ring x", 64, 2, 10, 20, False),)

    flight._dumped.discard(7)
    path = flight.dump(Backend(), 7, (1, 0, "why"), tmp_path)
    assert path is not None and json.loads(path.read_text())["collectives"][0]["op"] == "allreduce ring x"
    assert flight.dump(Backend(), 7, None, tmp_path) is None
    flight._dumped.discard(7)
