"""Tenant names → the planner's int32 tenant ids, in a table of bounded size.

With ``fairness="tenant"`` the planner keeps a count of the tokens it planned for each tenant id
and admits the least-served tenant's request first, preempting running requests of tenants
served more than ``fairness_quantum`` beyond it when it finds no slot or KV room
(cpp/core/planner.h, "Tenant fairness").
Names come from requests, so any client can make new ones: the table holds at most ``capacity``
named tenants, and the planner sees no more ids than that. A name keeps its id while it has a
request in the engine and afterwards, until a new name needs an id and none is unused: then the
idle id with the smallest count goes to the new name. Forgetting that tenant loses the least
(a tenant back from idle starts at no less than the least-served live tenant's count anyway),
and the new name inherits the smallest count the table can give. When every id has a live
request, a new name shares id 0 with the requests that name no tenant.

Everything here runs on the event loop thread.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Mapping

ANONYMOUS = 0  # requests that name no tenant, and the overflow of a full table
DEFAULT_CAPACITY = 4096
MAX_NAME_CHARS = 256  # Anthropic's limit on metadata.user_id


class TenantIds:
    """Ids 1..capacity for names; ``served()`` gives the planner's latest counts by id (read
    only when an idle id must be reused)."""

    def __init__(
        self,
        capacity: int = DEFAULT_CAPACITY,
        served: Callable[[], Mapping[int, int]] = dict,
    ) -> None:
        if not 1 <= capacity < 2**31 - 1:
            raise ValueError(f"capacity must be in [1, 2^31 - 1), got {capacity}")
        self.capacity = capacity
        self._served = served
        self._ids: dict[str, int] = {}
        self._names: dict[int, str] = {}
        self._live: dict[int, int] = {}  # id → requests in the engine; absent: none
        self._idle: OrderedDict[int, None] = OrderedDict()  # named ids without one, oldest first
        self._next = 1  # ids below have been given out

    def __len__(self) -> int:
        """Named tenants in the table (live or idle)."""
        return len(self._ids)

    def acquire(self, name: str | None) -> int:
        """The id of ``name`` for one more live request (None or "": the anonymous tenant)."""
        if not name:
            tenant = ANONYMOUS
        elif (tenant := self._ids.get(name, -1)) < 0:
            tenant = self._new_id()
            if tenant != ANONYMOUS:
                self._ids[name] = tenant
                self._names[tenant] = name
        self._idle.pop(tenant, None)
        self._live[tenant] = self._live.get(tenant, 0) + 1
        return tenant

    def release(self, tenant: int) -> None:
        """One request of ``tenant`` has left the engine."""
        left = self._live.get(tenant, 0) - 1
        if left > 0:
            self._live[tenant] = left
            return
        self._live.pop(tenant, None)
        if tenant in self._names:
            self._idle[tenant] = None

    def name(self, tenant: int) -> str | None:
        """The name that holds ``tenant`` now (None: the anonymous tenant, or an unused id)."""
        return self._names.get(tenant)

    def live_requests(self, tenant: int) -> int:
        return self._live.get(tenant, 0)

    @property
    def active(self) -> int:
        """Tenants with a request in the engine (the anonymous one included)."""
        return len(self._live)

    def _new_id(self) -> int:
        if self._next <= self.capacity:
            self._next += 1
            return self._next - 1
        if not self._idle:
            return ANONYMOUS
        served = self._served()
        tenant = min(self._idle, key=lambda t: served.get(t, 0))  # the oldest among equals
        del self._idle[tenant]
        del self._ids[self._names.pop(tenant)]
        return tenant
