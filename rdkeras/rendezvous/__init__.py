"""Rendezvous: a small key-value store hosted by rank 0 (or by a launcher), and its clients.

Every connection starts with a mutual HMAC-SHA256 challenge over the job token,
so a process that does not know the token learns nothing and can set nothing.
The store carries only setup-time data (endpoint descriptors, channel keys);
tensors never pass through it. Every wait has a deadline and, on timeout, the
error names the ranks that never answered.

Failures name their root cause: the first authenticated rank whose connection
drops without saying goodbye (or a failure a rank or the launcher reports) is
recorded, and every wait on the store, now or later, fails naming that rank.

The server (:mod:`rdkeras.rendezvous.server`) is one thread and one selector;
clients (:mod:`rdkeras.rendezvous.client`) and the server speak the frames of
:mod:`rdkeras.rendezvous.wire`.
"""

from rdkeras.rendezvous.client import Store
from rdkeras.rendezvous.server import StoreServer
from rdkeras.rendezvous.wire import CLOSING_BARRIER, LAUNCHER, transport_key

__all__ = ["CLOSING_BARRIER", "LAUNCHER", "Store", "StoreServer", "transport_key"]
