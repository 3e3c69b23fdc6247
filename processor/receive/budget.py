"""A bound on the request bytes the receivers hold at once, across every request and both protocols.

Each request is bounded on its own (``max_request_body_size``, ``max_recv_msg_size``),
but many at once are not: sixty-four 16 MiB bodies read in parallel, decompressed and
queued would hold gigabytes. A request takes its bytes from this budget as it reads
and decodes them and gives them back once it has its answer; when the budget is
spent, the sender is told to retry later (HTTP 503, gRPC UNAVAILABLE), as for a
full queue. All takers run on the receivers' one event loop, so no lock is needed.
"""

from __future__ import annotations


class BudgetSpent(Exception):
    def __init__(self, limit: int) -> None:
        super().__init__(
            f"the receivers hold {limit} bytes of requests already (receivers.otlp.max_bytes_in_flight); retry later"
        )


class ByteBudget:
    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.in_use = 0

    def claim(self) -> Claim:
        """A claim that takes bytes as a request grows and gives them all back when released."""
        return Claim(self)


class Claim:
    def __init__(self, budget: ByteBudget) -> None:
        self._budget = budget
        self.held = 0

    def take(self, size: int) -> None:
        """Take ``size`` more bytes; BudgetSpent (nothing taken) if they do not fit."""
        budget = self._budget
        others = budget.in_use - self.held
        # A request alone may pass the budget: one maximal request must always be possible.
        if others and budget.in_use + size > budget.limit:
            raise BudgetSpent(budget.limit)
        budget.in_use += size
        self.held += size

    def give_back(self, size: int) -> None:
        """Return ``size`` of the bytes taken (a transient cost, such as decoding, is over)."""
        size = min(size, self.held)
        self._budget.in_use -= size
        self.held -= size

    def release(self) -> None:
        self._budget.in_use -= self.held
        self.held = 0
