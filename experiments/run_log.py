"""run.log's handler (Hydra's job logging, conf/hydra/job_logging/schedlab.yaml): a failure to
write the log is the run's to report, in one line, not a traceback per line lost."""

from __future__ import annotations

import logging
import os
import sys


class RunLogHandler(logging.FileHandler):
    """run.log's handler: an OS error writing it (a full disk) is kept, the first one, for the
    run to report in one line and fail on (``check``), instead of a "--- Logging error ---"
    traceback printed for each line lost while the run ends as if it had a log (logging's
    handleError). Any other error (a bad format) is still logging's to report."""

    error: OSError | None = None

    def handleError(self, record: logging.LogRecord) -> None:  # noqa: N802 (logging's name)
        err = sys.exc_info()[1]
        if not isinstance(err, OSError):
            super().handleError(record)
        elif self.error is None:
            self.error = err

    def check(self) -> None:
        """Raise the first OS error writing the log, naming it, once its lines are flushed and
        fsynced (as the result files are)."""
        if self.error is None:
            try:
                self.flush()
                if self.stream is not None:
                    os.fsync(self.stream.fileno())
            except OSError as err:
                self.error = err
        if self.error is not None:
            raise OSError(self.error.errno, self.error.strerror, self.baseFilename) \
                from self.error
