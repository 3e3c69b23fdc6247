"""serve's open-file limit: raised to the hard limit at start, and shared between the listeners.

Every connection costs a file descriptor. With the common soft limit of 1,024, a few
hundred slow clients on one port would leave none for the others, for the state
store or for the exporters; each listener therefore keeps at most its share.
"""

from __future__ import annotations

import contextlib
import resource
from typing import Final

# Descriptors kept for everything that is not a client connection: the state store and its
# journal, the exporters' and forwarder's connections, gRPC's and Python's own.
RESERVED: Final = 256
# The receivers (gRPC, HTTP), the operator view and the metrics endpoint.
LISTENERS: Final = 4
# A listener always keeps at least this many, whatever the limit.
FLOOR: Final = 16
# What "unlimited" becomes: the kernel refuses more than its nr_open (1,048,576 by default).
_UNLIMITED_AS: Final = 1 << 20


def soft_limit() -> int:
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return _UNLIMITED_AS if soft == resource.RLIM_INFINITY else int(soft)


def raise_to_hard_limit() -> tuple[int, int]:
    """Raise the soft limit to the hard one; (before, after). A refusal leaves it as it was."""
    before, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = _UNLIMITED_AS if hard == resource.RLIM_INFINITY else hard
    if before != resource.RLIM_INFINITY and before < target:
        with contextlib.suppress(ValueError, OSError):  # not allowed here: serve keeps the limit it has
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    return (_UNLIMITED_AS if before == resource.RLIM_INFINITY else int(before)), soft_limit()


def listener_share(configured: int) -> int:
    """The most connections one listener keeps open: its setting, or its share of the open-file limit."""
    return min(configured, max(FLOOR, (soft_limit() - RESERVED) // LISTENERS))
