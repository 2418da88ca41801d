"""`python -m barreld.supervise [barreld options]`: barreld under a watcher that outlives it.

barrelctl starts the daemons it autostarts this way. A daemon's own log can tell of a crash (faulthandler
writes the signal and every thread's stack) but never of SIGKILL, which the OOM killer sends; and the
client that started it has long exited, so nobody else hears its exit status. The watcher is that
somebody: it waits for barreld, writes `barreld[PID] died of SIGNAL (meaning)` to the same log when a
signal ended it, and exits with barreld's status. It forwards SIGTERM, SIGINT and SIGHUP, so stopping
either process stops both. It imports nothing heavy: it costs a few MB while the daemon runs.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from barreld.deaths import WATCHER_ENV, describe, signal_name


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    env = {**os.environ, WATCHER_ENV: str(os.getpid())}
    child = subprocess.Popen([sys.executable, "-m", "barreld", *args], env=env)
    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, lambda s, _frame: child.send_signal(s))
    status = child.wait()
    if status >= 0:
        return status
    name = signal_name(-status)
    stamp = time.strftime("%Y-%m-%d %H:%M:%S")
    print(f"{stamp} barreld.supervise: barreld[{child.pid}] died of {describe(name)}", file=sys.stderr, flush=True)
    return 128 - status


if __name__ == "__main__":
    sys.exit(main())
