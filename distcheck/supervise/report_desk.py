"""The node watcher's desk for reports its ranks hand over: claims each offer and publishes it.

    torchrun --nproc-per-node 2 -m distcheck consistency     # rank 0 offers, this desk (in the watcher) publishes

One thread for the watcher's whole life (every attempt of a ``--max-restarts`` job), in the watchers of commands
whose rank 0 composes its own report (``consistency``; a ``run`` job's watcher composes the report itself and
starts none): it polls the report
directory's mailbox (contract/report_handoff.py), and delivers what it finds through supervise/node_report, the
path every report of a watched job takes, under the lock the watch's own diagnoses take too.
"""
from __future__ import annotations

import logging
import os
import threading
from pathlib import Path

from distcheck.contract import report_handoff

log = logging.getLogger("distcheck")

# Held from claim to publication: the watch's last look (take) then waits for an offer the desk's thread is still
# publishing, instead of finding the mailbox empty and ending the watcher (a daemon thread) half-way through it.
_TAKING = threading.Lock()


def take(report_dir: str | os.PathLike) -> str | None:
    """Publish the offer waiting in ``report_dir``, if any: what became of it (node_report.PUBLISHED, ...), None if
    none. The desk's thread polls this; the watch calls it once more before it decides how the run ended."""
    with _TAKING:
        return _take(report_dir)


def _take(report_dir: str | os.PathLike) -> str | None:
    from distcheck.supervise.node_report import deliver_handed

    handed = report_handoff.claim(report_dir)
    if handed is None:
        return None
    try:
        outcome = deliver_handed(handed, Path(report_dir))
    except Exception:  # the rank waits for "published", then publishes it itself: it is not lost
        log.exception("publishing the report rank pid %d handed over failed", handed.pid)
        return None
    report_handoff.published(report_dir)
    log.info("the report rank pid %d handed over (%s): %s", handed.pid, "final" if handed.final else "so far",
             outcome)
    return outcome


class ReportDesk:
    """``start()`` once; ``stop()`` (tests) ends the thread after the offer it is publishing."""

    def __init__(self, report_dir: str | os.PathLike, poll: float = 0.05) -> None:
        self.report_dir, self.poll = Path(report_dir), poll
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="report-desk", daemon=True)

    def start(self) -> ReportDesk:
        self._thread.start()
        return self

    def stop(self, wait: float = 5.0) -> None:
        """End the thread once the offer it is publishing is out (the watcher's end)."""
        self._stop.set()
        self._thread.join(wait)

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                take(self.report_dir)
            except Exception:  # a vanished report dir: nothing more will be handed over there
                log.exception("the report desk")
            self._stop.wait(self.poll)
