"""The connector's audit trace (``agentkv_trace_path``): one JSON object a line.

Records are handed over on vLLM's scheduler thread and serialized and written by the trace's
own thread, so tracing adds a queue append to a scheduler step, not a ``json.dumps`` and a
write. A record must not be changed after it is handed over. Nothing is dropped: the queue is
unbounded (a trace is for audits and differential tests, on runs that finish).
"""

from __future__ import annotations

import json
import logging
import queue
import threading
from typing import Final

log = logging.getLogger("agentkv.connector")

CLOSE_TIMEOUT_S: Final = 30.0
_END: Final = object()


class TraceFile:
    """Appends records to ``path`` from a writer thread; ``close`` writes what is queued."""

    def __init__(self, path: str) -> None:
        self._file = open(path, "a", encoding="utf-8")  # noqa: SIM115 - open until close
        self._queue: queue.SimpleQueue[object] = queue.SimpleQueue()
        self.write_errors = 0
        self._thread = threading.Thread(target=self._write_all, name="agentkv-trace", daemon=True)
        self._thread.start()

    def __call__(self, record: dict[str, object]) -> None:
        self._queue.put(record)

    def _write_all(self) -> None:
        while (record := self._queue.get()) is not _END:
            try:
                self._file.write(json.dumps(record) + "\n")
                if self._queue.empty():
                    self._file.flush()
            except (TypeError, ValueError, OSError) as exc:  # one bad record loses only itself
                self.write_errors += 1
                if self.write_errors == 1:
                    log.warning("agentkv trace: a record was not written (%r)", exc)
        self._file.close()

    def close(self, timeout_s: float = CLOSE_TIMEOUT_S) -> None:
        """Write every record handed over so far, then close the file."""
        if self._thread.is_alive():
            self._queue.put(_END)
            self._thread.join(timeout_s)
