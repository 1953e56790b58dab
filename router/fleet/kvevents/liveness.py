"""Whether a replica's KV events are heard: the verdict that decides how it is routed (docs/design.md §4.8).

A stream is "pending" from its start, "following" once a live batch or a replay answer came, and
"silent" when neither came within ``silent_after_s`` (an endpoint found by convention on a
replica that publishes nothing, or publishes elsewhere).  A silent replica is routed on
predictions, like one without events; the stream keeps listening (ZMQ reconnects with backoff),
so its first batch makes it "following" again.  A lost connection needs fresh evidence: the
publisher may be gone for good.  Each change is reported once and logged once.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Literal

log = logging.getLogger("kvroute.kvevents")

HeardState = Literal["pending", "following", "silent"]


class EventsLiveness:
    def __init__(
        self,
        replica: str,
        endpoint: str,
        silent_after_s: float,
        on_change: Callable[[HeardState], None],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._replica = replica
        self._endpoint = endpoint
        self._silent_after_s = silent_after_s
        self._on_change = on_change
        self._clock = clock
        self._since = clock()  # start of the current wait for evidence
        self._heard = False
        self.state: HeardState = "pending"

    def heard(self) -> None:
        """A live batch or a replay answer: somebody publishes there."""
        self._heard = True
        self._set("following")

    def lost_contact(self) -> None:
        """The connection went away: following again only on fresh evidence."""
        self._heard = False
        self._since = self._clock()

    def check(self) -> None:
        """The silence verdict, once its time has come (called at every turn of the stream's loop)."""
        if not self._heard and self._clock() - self._since >= self._silent_after_s:
            self._set("silent")

    def _set(self, state: HeardState) -> None:
        if state == self.state:
            return
        previous, self.state = self.state, state
        if state == "silent":
            log.warning("replica %s: no KV events from %s (no batch, no replay answer in %g s): routing it on "
                        "predictions until they arrive", self._replica, self._endpoint, self._silent_after_s)
        elif previous == "silent":
            log.info("replica %s: KV events arrive from %s again", self._replica, self._endpoint)
        else:
            log.info("replica %s: following its KV events at %s", self._replica, self._endpoint)
        self._on_change(state)
