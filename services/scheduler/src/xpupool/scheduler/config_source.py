"""The queue configuration file, reloaded when the operator edits it."""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from xpupool.obs import get_logger
from xpupool.scheduler.domain import ConfigError, SchedulerConfig, default_config, load_config
from xpupool.scheduler.domain.config import BUILTIN_POLICIES

#: Seconds between two looks at the file's modification time: an edit takes effect within
#: about this long. ``current()`` is asked several times per request (admission, decision,
#: commit), and a ``stat`` each time was a system call per ask on the way of every grant.
RECHECK_S = 1.0


@dataclass
class ConfigSource:
    """Holds the current config; ``current()`` re-reads the file when its mtime changed (looked
    at most every ``recheck_s``).

    A file that no longer parses is logged and ignored: the scheduler keeps the last good
    configuration rather than stopping or falling back to defaults mid-flight.
    """

    path: Path | None
    # Policy names a queue may select (the built-ins plus any registered trace policies).
    known_policies: tuple[str, ...] = BUILTIN_POLICIES
    recheck_s: float = RECHECK_S
    clock: Callable[[], float] = time.monotonic
    _config: SchedulerConfig = field(default_factory=default_config)
    _mtime_ns: int = -1
    _checked_at: float = -math.inf

    def __post_init__(self) -> None:
        if self.path is not None:
            # A bad file at start-up is fatal.
            self._config = load_config(self.path, known_policies=self.known_policies)
            self._mtime_ns = self.path.stat().st_mtime_ns

    def current(self) -> SchedulerConfig:
        """The configuration to decide with now."""
        if self.path is None:
            return self._config
        now = self.clock()
        if now - self._checked_at < self.recheck_s:
            return self._config
        self._checked_at = now
        try:
            mtime = os.stat(self.path).st_mtime_ns
            if mtime != self._mtime_ns:
                self._config = load_config(self.path, known_policies=self.known_policies)
                self._mtime_ns = mtime
                get_logger().info("queue_config_reloaded", path=str(self.path))
        except (OSError, ConfigError) as error:
            get_logger().error("queue_config_invalid", path=str(self.path), error=str(error))
            self._mtime_ns = -2  # retry on the next cycle
        return self._config
