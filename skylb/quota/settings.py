"""The ``balancer.quota`` settings (issue 11).

Created by the ``admission`` branch with only what model groups need (``wait_s``); the ``quota`` branch owns this
module and adds the rest (Redis backend, ...): on merge its version is kept, with ``wait_s`` in it.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["QuotaSettings"]


class QuotaSettings(BaseModel):
    """How requests over a limit are treated.

    Attributes:
        wait_s: the longest a request over a limit (for a model group: while no model of the group admits it) waits
            in the balancer before it gets 429 with Retry-After, s.
    """

    model_config = ConfigDict(extra="forbid")

    wait_s: float = Field(30.0, ge=0)
