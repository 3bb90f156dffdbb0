"""HostGate: the serving state of every hafiza engine on this host, so no instance's encodes run during another's
requests.

A serving engine holds a shared `flock` on one file in the gate directory; a writer asks whether anyone holds it
by trying an exclusive lock without blocking, through its own open file. flock is used, not a pid file, because
the kernel drops a lock when its process dies (even under SIGKILL), so a crashed instance never leaves the others'
encodes waiting. Each serving start also touches the file, so its mtime is a host-wide serving epoch.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Mapping
from pathlib import Path

from hafiza import settings
from hafiza.errors import ConfigError

try:
    import fcntl
except ImportError:  # no flock on this platform: each process keeps its own gate
    fcntl = None  # type: ignore[assignment]

OFF = ("off", "0", "no", "false")


def _usable(directory: Path) -> bool:
    """Create `directory` (0700) if needed; whether it is ours and writable."""
    try:
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        st = directory.stat()
    except OSError:
        return False
    return st.st_uid == os.getuid() and os.access(directory, os.W_OK | os.X_OK)


def gate_dir(env: Mapping[str, str] | None = None) -> Path | None:
    """The host gate's directory from settings.GATE_DIR (None: off, or no flock here). Unset: the first usable of
    /dev/shm, $XDG_RUNTIME_DIR and the temp directory; a directory that was named but is unusable is an error."""
    raw = settings.GATE_DIR.read(env).strip()
    if fcntl is None or raw.lower() in OFF:
        return None
    if raw:
        named = Path(raw)
        if not _usable(named):
            raise ConfigError(f"{settings.GATE_DIR.name}={raw!r} is not a directory this user owns and can write",
                              setting=settings.GATE_DIR.name)
        return named
    uid = os.getuid()
    runtime = (os.environ if env is None else env).get("XDG_RUNTIME_DIR")
    candidates = [Path("/dev/shm") / f"hafiza-gate-{uid}"]
    if runtime:
        candidates.append(Path(runtime) / "hafiza-gate")
    candidates.append(Path(tempfile.gettempdir()) / f"hafiza-gate-{uid}")
    return next((c for c in candidates if c.parent.is_dir() and _usable(c)), None)


class HostGate:
    """One process's view of the host's serving lock. `hold()`/`release()` are the serving side (idempotent);
    `busy()` and `epoch()` are the writer's questions. Not thread-safe: ServingGate calls it under its lock."""

    def __init__(self, directory: Path) -> None:
        self.path = directory / "serving"
        self._probe = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        self._held: int | None = None

    def hold(self) -> None:
        """Serving starts: take the shared lock (waits only while a probe holds it for an instant)."""
        if self._held is not None or self._probe < 0:
            return
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        fcntl.flock(fd, fcntl.LOCK_SH)
        self._held = fd
        os.utime(self._probe)

    def release(self) -> None:
        """Serving stopped: drop the shared lock."""
        if self._held is not None:
            fd, self._held = self._held, None
            os.close(fd)

    def busy(self) -> bool:
        """Whether any engine on the host, this process's included, holds the serving lock now."""
        if self._probe < 0:
            return False
        try:
            fcntl.flock(self._probe, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(self._probe, fcntl.LOCK_UN)
        return False

    def epoch(self) -> int:
        """The host-wide serving epoch: changes whenever any engine starts serving."""
        if self._probe < 0:
            return 0
        return os.fstat(self._probe).st_mtime_ns

    def close(self) -> None:
        """Release the lock and the probe's file."""
        self.release()
        if self._probe >= 0:
            os.close(self._probe)
            self._probe = -1


def host_gate(env: Mapping[str, str] | None = None) -> HostGate | None:
    """The host gate settings.GATE_DIR asks for (None: off, or no usable directory)."""
    directory = gate_dir(env)
    return None if directory is None else HostGate(directory)
