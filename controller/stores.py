"""The controller's membership store, by configuration: embedded SQLite (the default) or etcd (several controllers).

Both have one interface (controller/store.py ``MembershipStore``, controller/etcd_store.py ``EtcdMembershipStore``;
tests/test_store.py runs the same checks against each).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from controller.store import MembershipStore, StoreError
from skylb.config import ControllerConfig

if TYPE_CHECKING:  # etcd3gw and requests load only with ``store: etcd`` (0.2 s of every controller's start else)
    from controller.etcd_store import EtcdMembershipStore

__all__ = ["Store", "open_store", "follow_revisions", "FOLLOW_INTERVAL_S"]

#: Either store; they share every public method. At run time the name is the SQLite store's class only, so that
#: importing this module does not load the etcd client (annotations see the union).
if TYPE_CHECKING:
    Store = MembershipStore | EtcdMembershipStore
else:
    Store = MembershipStore

#: How often a controller on a shared store reads the revision to notice other controllers' writes (s).
FOLLOW_INTERVAL_S = 0.2


def open_store(config: ControllerConfig) -> Store:
    """The store ``config`` names: ``store: sqlite`` opens the file ``db``; ``store: etcd`` connects to
    ``etcd.endpoints`` under ``etcd.prefix``. Raises StoreUnavailable when etcd does not answer, sqlite3.Error
    when the file cannot be opened."""
    if config.store == "etcd":
        from controller.etcd_store import EtcdMembershipStore
        return EtcdMembershipStore(config.etcd.endpoints, prefix=config.etcd.prefix)
    return MembershipStore(config.db)


async def follow_revisions(store: Store, publish: Callable[[int], Awaitable[None]], *,
                           interval_s: float = FOLLOW_INTERVAL_S) -> None:
    """Call ``publish(revision)`` whenever the store's revision moves, also by another controller's write; until
    cancelled. A shared store's writes reach this controller's long polls within ``interval_s``.

    A poll rather than an etcd watch: etcd3gw runs a watch's stream in a thread whose end it does not report, so a
    watch cut by an etcd restart would go quiet without a word; one read of the document each ``interval_s``
    (about 2 ms) cannot go quiet that way, and a failed one is simply tried again.
    """
    last = None
    while True:
        try:
            revision = store.revision
        except StoreError:
            revision = last  # etcd is away: the API answers 503 meanwhile; keep polling
        if revision is not None and revision != last:
            await publish(revision)
            last = revision
        await asyncio.sleep(interval_s)
