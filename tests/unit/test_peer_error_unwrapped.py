"""A PeerError raised inside a traced step comes back from TensorFlow as its own error class; rdkeras finds the
PeerError in it again, with its message and rank (rdkeras.errors.unwrapped)."""

from __future__ import annotations

import pytest

from rdkeras import errors

MESSAGE = "rank 1 failed: killed by signal 9 (seen by rank 2)"


def _wrapped_by_tensorflow(error: BaseException) -> Exception:
    tf = pytest.importorskip("tensorflow")

    def raise_it(x):
        raise error

    @tf.function
    def step(x):
        return tf.numpy_function(raise_it, [x], tf.float32, stateful=True)

    with pytest.raises(tf.errors.OpError) as caught:
        step(tf.constant(1.0))
    return caught.value


def test_a_numpy_function_s_peer_error_is_found_with_its_message_and_rank():
    wrapped = _wrapped_by_tensorflow(errors.peer_error(1, MESSAGE))
    assert not isinstance(wrapped, errors.PeerError)
    found = errors.unwrapped(wrapped)
    assert isinstance(found, errors.PeerError)
    assert (str(found), found.rank) == (MESSAGE, 1)
    # The engine's failure record names the rank when the message does not say it first.
    found = errors.unwrapped(_wrapped_by_tensorflow(errors.peer_error(2, "timed out waiting")), (2, 0, "?"), 0)
    assert (str(found), found.rank) == ("timed out waiting", 2)


def test_a_native_op_s_abort_is_a_peer_error_only_with_a_failure_of_another_rank():
    class AbortedError(Exception):
        pass

    aborted = AbortedError(f"rdkeras recv (pipeline/recv_3): {MESSAGE}\n\t [[{{{{node recv_3}}}}]]")
    assert errors.unwrapped(aborted) is None
    assert errors.unwrapped(aborted, (0, 0, "its own"), 0) is None  # this rank's own failure
    found = errors.unwrapped(aborted, (1, 2, "killed by signal 9"), 0)
    assert (str(found), found.rank) == (MESSAGE, 1)


def test_other_errors_and_peer_errors_themselves_are_left_alone():
    assert errors.unwrapped(ValueError("rank 1 is not a PeerError")) is None
    assert errors.unwrapped(errors.peer_error(1, MESSAGE)) is None
