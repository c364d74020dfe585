"""rdkeras.elastic.membership.Membership without a job: the settings it refuses, what counts as a lost worker, and
a collective retried once per loss. (Losses in real jobs: tests/multiproc/test_elastic.py.)"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from rdkeras.elastic.group import ElasticGroup
from rdkeras.elastic.membership import Membership
from rdkeras.errors import peer_error
from rdkeras.parallel.base import Parallelism
from rdkeras.parallel.data_parallel import DataParallel
from rdkeras.parallel.model_parallel import ModelParallel


def _parallel(failure: object = None) -> SimpleNamespace:
    return SimpleNamespace(engine=SimpleNamespace(backend=SimpleNamespace(failure=failure)))


@pytest.mark.parametrize(
    ("mode", "global_batch", "shard", "refusal"),
    [
        ("allreduce", True, "optimizer", r"shard='optimizer' in an elastic job.*use shard='none'"),
        ("ps", True, "none", r"needs mode='allreduce': in parameter-server mode"),
        ("allreduce", False, "none", r"needs global_batch=True: the same global batch"),
    ],
)
def test_settings_a_membership_change_cannot_honour_are_refused(mode, global_batch, shard, refusal):
    with pytest.raises((ValueError, NotImplementedError), match=refusal):
        Membership.check(mode, global_batch, shard)
    Membership.check("allreduce", True, "none")


def test_a_lost_worker_is_the_engines_failure_or_a_peer_error_however_wrapped():
    membership = Membership(ElasticGroup(0, 1))
    assert membership.lost_a_worker(_parallel(failure=(1, 0, "gone")), RuntimeError("anything"))
    assert membership.lost_a_worker(_parallel(), peer_error(1, "rank 1 died"))
    assert membership.lost_a_worker(_parallel(), RuntimeError("InternalError: PeerError: rank 1 died"))
    assert not membership.lost_a_worker(_parallel(), ValueError("a bug of the model's"))


def test_a_collective_runs_again_after_each_loss_and_other_errors_propagate(monkeypatch):
    membership, parallel, model = Membership(ElasticGroup(0, 1)), _parallel(), object()
    recovered: list[object] = []
    monkeypatch.setattr(membership, "recover", lambda p, m: recovered.append(m))
    outcomes = iter([peer_error(2, "rank 2 died"), peer_error(1, "rank 1 died"), "done"])

    def collective() -> str:
        outcome = next(outcomes)
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    assert membership.retry(parallel, model, collective) == "done"
    assert recovered == [model, model]
    with pytest.raises(ValueError, match="not a loss"):
        membership.retry(parallel, model, lambda: (_ for _ in ()).throw(ValueError("not a loss")))
    assert recovered == [model, model]


def test_only_a_parallelism_that_can_change_its_members_rebinds():
    assert DataParallel.rebind is not Parallelism.rebind and ModelParallel.rebind is Parallelism.rebind
    with pytest.raises(NotImplementedError, match="ModelParallel cannot change its members"):
        ModelParallel.rebind(object.__new__(ModelParallel), SimpleNamespace())  # type: ignore[arg-type]
