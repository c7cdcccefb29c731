"""When one engine was last heard, and when its lease is renewed and a quiet engine
probed next (:class:`Liveness`): the schedule of a follower's lease, without I/O."""

from __future__ import annotations

from collections.abc import Callable

from registry.bridge.source import checked_seconds

RETRY_DELAY = 0.5
"""Seconds before a failed renewal is tried again."""


class Liveness:
    """The lease and probe schedule of one engine's follower.

    The lease is renewed every third of ``lease_ttl`` while the engine is heard (a
    message, or an answer to a probe). A quiet engine is probed every
    ``probe_interval`` (a third of the lease or of ``silence_timeout``, whichever is
    shorter); an engine that does not answer is probed at doubling intervals, up to
    once per ``silence_timeout``. Once silent for ``silence_timeout`` the lease is left
    to run out.
    """

    def __init__(
        self, lease_ttl: float, silence_timeout: float, clock: Callable[[], float]
    ) -> None:
        self.lease_ttl = checked_seconds(lease_ttl, "lease_ttl")
        self.silence_timeout = checked_seconds(silence_timeout, "silence_timeout")
        # Probes come often enough to hear an idle engine before it counts as silent.
        self.probe_interval = min(self.lease_ttl, self.silence_timeout) / 3
        self.clock = clock
        self.probe_failures = 0  # probes unanswered in a row: they back off
        now = clock()
        self.last_heard = now
        self.next_renewal = now
        self.next_probe = now + self.probe_interval

    def heard(self) -> None:
        """The engine said something (a message, a replay's answer)."""
        self.last_heard = self.clock()

    def quiet(self, now: float) -> float:
        """Seconds since the engine was last heard."""
        return now - self.last_heard

    def silent(self, quiet: float) -> bool:
        """Whether an engine quiet this long is left to let its lease run out."""
        return quiet >= self.silence_timeout

    def probe_due(self, now: float) -> bool:
        """Whether a quiet engine is to be probed now."""
        return self.quiet(now) >= self.probe_interval and now >= self.next_probe

    def probed(self, answered: bool) -> None:
        """Schedule the next probe: unanswered ones back off (up to once per
        ``silence_timeout``), so dead engines cannot stall the loop serving the others."""
        self.probe_failures = 0 if answered else self.probe_failures + 1
        backoff = min(2 ** min(self.probe_failures, 16), self.silence_timeout / self.probe_interval)
        self.next_probe = self.clock() + self.probe_interval * max(1.0, backoff)
        if answered:
            self.heard()

    def renewal_due(self, now: float) -> bool:
        """Whether the lease is to be renewed now."""
        return now >= self.next_renewal

    def renewed(self, now: float) -> None:
        """The lease was renewed (or taken) at ``now``: the next renewal in a third of it."""
        self.next_renewal = now + self.lease_ttl / 3

    def renewal_failed(self, now: float) -> None:
        """A renewal did not reach Redis: try again shortly."""
        self.next_renewal = now + RETRY_DELAY
