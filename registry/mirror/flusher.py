"""The flusher: the daemon thread that sends one mirror's queue while it lives.

It holds the write-behind weakly (only its mirror holds it), so it ends once the mirror
is garbage, as python-redis-lock's renewal thread does; ``stop()`` (``close()``) ends it
too, and so does finding the owner fenced. While Redis is away it backs off, doubling
from ``RETRY_MIN`` to ``RETRY_MAX``.
"""

from __future__ import annotations

import logging
import threading
import weakref

from registry.core.errors import RegistryError, StaleEpochError
from registry.mirror.write_behind import RETRY_MAX, RETRY_MIN, WriteBehind

log = logging.getLogger(__name__)


class Flusher:
    """Starts and stops the thread that sends ``behind``'s queue."""

    def __init__(self, behind: WriteBehind, name: str) -> None:
        self.behind = behind
        self.name = name
        self.stop_event = threading.Event()
        self.thread: threading.Thread | None = None

    def start(self) -> None:
        """Start the thread, unless it runs."""
        with self.behind.state.lock:
            if self.thread is not None and self.thread.is_alive():
                return
            self.stop_event = threading.Event()
            self.thread = threading.Thread(
                target=_flush_until_stopped,
                args=(weakref.ref(self.behind), self.stop_event),
                name=self.name,
                daemon=True,
            )
            self.thread.start()

    def stop(self, timeout: float) -> None:
        """Stop the thread and wait ``timeout`` seconds at most for it to end."""
        self.stop_event.set()
        with self.behind.state.lock:
            self.behind.queue.wake.notify_all()
            thread = self.thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)


def _flush_until_stopped(ref: weakref.ReferenceType[WriteBehind], stop: threading.Event) -> None:
    """The thread's body: wait for a batch to be due, send it, back off while Redis is
    away; end when ``stop`` is set, the write-behind is garbage or its owner lost."""
    backoff = RETRY_MIN
    while not stop.is_set():
        behind = ref()
        if behind is None or behind.lost:
            return  # gone, or fenced: every later call raises
        pause = 0.0
        try:
            if behind.wait_for_work(stop) and not stop.is_set():
                behind.send_once()
            backoff = RETRY_MIN
        except StaleEpochError:
            return  # lost: every later call raises
        except RegistryError:
            pause, backoff = backoff, min(backoff * 2, RETRY_MAX)
        except Exception:
            log.exception("mirror flusher failed; retrying")
            pause, backoff = backoff, min(backoff * 2, RETRY_MAX)
        finally:
            del behind
        if pause:
            stop.wait(pause)
