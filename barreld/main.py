"""barreld: the Barrel daemon. Runs in the foreground; `barreld --help` lists its options."""

from __future__ import annotations

import argparse
import dataclasses
import faulthandler
import logging
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import barreld
from barreld.address import ListenAddress, parse_listen
from barreld.lifecycle import StartupError
from barreld.paths import SOCKET_ENV, default_socket, private_dir

if TYPE_CHECKING:
    from barreld.config import Config

log = logging.getLogger("barreld")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="barreld",
        description="Barrel daemon: owns the models and the KV cache, serves gRPC on a Unix socket. "
        "Runs in the foreground; SIGTERM or SIGINT stops it cleanly.",
    )
    p.add_argument(
        "--socket",
        type=Path,
        default=None,
        help=f"Unix socket path (default: ${SOCKET_ENV}, else $XDG_RUNTIME_DIR/barrel/barreld.sock, "
        "else /tmp/barrel-$UID/barreld.sock)",
    )
    p.add_argument(
        "--data-dir", type=Path, default=None, help="LMDB index and disk tier (default: $XDG_DATA_HOME/barrel)"
    )
    p.add_argument(
        "--config",
        type=Path,
        default=None,
        help="TOML config file (default: $XDG_CONFIG_HOME/barrel/barreld.toml, then /etc/barrel/barreld.toml)",
    )
    p.add_argument(
        "--http",
        type=_listen_address,
        default=None,
        metavar="ADDR",
        help="serve the OpenAI-compatible HTTP API on ADDR: HOST:PORT (loopback unless [http] api_keys_file "
        "is set), [IPv6]:PORT or unix:PATH (default: the config's [http] listen, else off)",
    )
    p.add_argument(
        "--log-level",
        default=os.environ.get("BARREL_LOG_LEVEL", "info"),
        choices=["debug", "info", "warning", "error"],
        help="log verbosity on stderr (default: info)",
    )
    p.add_argument("--version", action="version", version=f"barreld {barreld.__version__}")
    return p.parse_args(argv)


def _listen_address(text: str) -> ListenAddress:
    try:
        return parse_listen(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def main(argv: list[str] | None = None) -> int:
    # A crash in llama.cpp (SIGILL from a CPU it was not built for, SIGSEGV, SIGABRT) leaves the signal and
    # every thread's Python stack in the log, where barrelctl and the next start find them (barreld.deaths).
    faulthandler.enable(all_threads=True)
    args = parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(),
        stream=sys.stderr,
        format="%(asctime)s barreld[%(process)d] %(levelname)s %(name)s: %(message)s",
    )
    from barreld.engine.openmp import set_wait_defaults

    if added := set_wait_defaults(os.environ):
        log.debug("llama.cpp's OpenMP threads wait with %s", ", ".join(f"{k}={v}" for k, v in added.items()))
    from barreld.config import ConfigError, default_config_path, load_config

    config_path = args.config or default_config_path()
    try:
        config = load_config(config_path, args.data_dir)
    except ConfigError as exc:
        print(f"barreld: {exc}", file=sys.stderr)
        return 1
    if args.http is not None:
        config = dataclasses.replace(config, http=dataclasses.replace(config.http, listen=args.http))
    # The server (gRPC, numpy, llama.cpp) is imported once the config is known to be good: a bad one
    # is reported without that cost.
    try:
        return run(args, config, config_path)
    except StartupError as exc:
        print(f"barreld: {exc}", file=sys.stderr)
        return 1


def run(args: argparse.Namespace, config: Config, config_path: Path) -> int:
    from barreld.daemon import Daemon

    data_dir = config.data_dir
    socket = args.socket or (config.socket if config.socket and not os.environ.get(SOCKET_ENV) else default_socket())
    try:
        private_dir(data_dir)
    except OSError as exc:
        raise StartupError(f"cannot create data dir {data_dir}: {exc.strerror}") from None
    t0 = time.monotonic()
    daemon = Daemon(config, data_dir=data_dir, socket=socket, config_path=config_path)
    daemon.start()
    log.info(
        "barreld %s ready on %s (data dir %s) in %.2fs", barreld.__version__, socket, data_dir, time.monotonic() - t0
    )
    daemon.wait()
    daemon.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
