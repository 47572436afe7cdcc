"""Server processes started, waited on until their health says SERVING, and stopped: one launcher
for the tests, the benchmarks and `make serve-prefill serve-decode stop`.

    python -m serving.launch start NAME MODULE --address HOST:PORT [--run-dir DIR] -- FLAGS...
    python -m serving.launch stop NAME... [--run-dir DIR]

`start` runs `python -m MODULE FLAGS...` in the background (its log and pid in --run-dir as NAME.log
and NAME.pid) and returns once it serves, or fails with the log's last lines if it exits first.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Self

from client.wait_ready import is_serving

ROOT = Path(__file__).resolve().parent.parent  # where `python -m decode_server` resolves


class ServerFailed(RuntimeError):
    """The server exited, or did not serve in time; the message carries its log's last lines."""


class ServerProcess:
    """`python -m <module> <args>`, its output in `log_path`, its gRPC health checked at `address`."""

    def __init__(self, module: str, args: list[str], address: str, log_path: Path,
                 env: dict[str, str] | None = None) -> None:
        self.module, self.args, self.address, self.log_path = module, args, address, log_path
        self.env = env or {}  # on top of this process's environment
        self.proc: subprocess.Popen[bytes] | None = None

    def spawn(self, detach: bool = False) -> None:
        """Start it without waiting; `detach` lets it outlive this process (its own session)."""
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **self.env}
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", self.module, *self.args], cwd=ROOT, env=env,
                                         stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                         start_new_session=detach)

    def wait_serving(self, timeout: float) -> Self:
        assert self.proc is not None, "spawn() first"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ServerFailed(f"{self.module} on {self.address} exited with {self.proc.returncode} before "
                                   f"it was ready:\n{self.log_tail()}")
            if self.ready():
                return self
            time.sleep(0.1)
        raise ServerFailed(f"{self.module} on {self.address} not SERVING after {timeout:.0f}s (log: "
                           f"{self.log_path}):\n{self.log_tail()}")

    def start(self, timeout: float = 600.0) -> Self:
        self.spawn()
        return self.wait_serving(timeout)

    def ready(self) -> bool:
        return is_serving(self.address, timeout=0.5)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def log_tail(self, lines: int = 30) -> str:
        return "\n".join(self.log().splitlines()[-lines:])

    def signal(self, sig: int) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)

    def wait(self, timeout: float = 30.0) -> int:
        assert self.proc is not None
        return self.proc.wait(timeout)

    def stop(self, timeout: float = 30.0) -> None:
        """SIGTERM (the server drains), and SIGKILL if it has not exited after `timeout`."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


def start_all(servers: Sequence[ServerProcess], timeout: float = 600.0) -> None:
    """Start them together (start-up is mostly imports and model loading), then wait for each; if
    one fails, every one is killed."""
    try:
        for server in servers:
            server.spawn()
        for server in servers:
            server.wait_serving(timeout)
    except BaseException:
        for server in servers:
            server.kill()
        raise


def stop_all(servers: Sequence[ServerProcess], timeout: float = 30.0) -> None:
    """SIGTERM them all first, so they drain at the same time, then wait for each."""
    for server in servers:
        if server.proc is not None and server.proc.poll() is None:
            server.signal(signal.SIGTERM)
    for server in servers:
        server.stop(timeout)


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _running_pid(pid_file: Path) -> int | None:
    if not pid_file.exists():
        return None
    pid = int(pid_file.read_text())
    return pid if pid_alive(pid) else None


def start_command(args: argparse.Namespace) -> int:
    pid_file = args.run_dir / f"{args.name}.pid"
    pid = _running_pid(pid_file)
    if pid is not None:
        print(f"{args.name} server already running (pid {pid})")
        return 0
    server = ServerProcess(args.module, args.flags, args.address, args.run_dir / f"{args.name}.log")
    server.spawn(detach=True)
    assert server.proc is not None
    pid_file.write_text(str(server.proc.pid))
    try:
        server.wait_serving(args.timeout)
    except ServerFailed as e:
        print(e, file=sys.stderr)
        return 1
    print(f"{args.address} is SERVING")
    return 0


def stop_command(args: argparse.Namespace) -> int:
    for name in args.names:
        pid_file = args.run_dir / f"{name}.pid"
        pid = _running_pid(pid_file)
        if pid is not None:
            os.kill(pid, signal.SIGTERM)
            while pid_alive(pid):
                time.sleep(0.2)
            print(f"{name} server stopped")
        pid_file.unlink(missing_ok=True)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m serving.launch", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    start = commands.add_parser("start", help="start a server in the background and wait until it serves")
    start.add_argument("name", help="its pid and log files are NAME.pid and NAME.log in --run-dir")
    start.add_argument("module", choices=["prefill_server", "decode_server"])
    start.add_argument("--address", required=True, help="HOST:PORT whose gRPC health is checked")
    start.add_argument("--run-dir", type=Path, default=Path("run"))
    start.add_argument("--timeout", type=float, default=600.0, help="seconds to wait (model load included)")
    stop = commands.add_parser("stop", help="SIGTERM servers started with `start` and wait until they exit")
    stop.add_argument("names", nargs="+")
    stop.add_argument("--run-dir", type=Path, default=Path("run"))
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    split = argv.index("--") if "--" in argv else len(argv)  # the server's own flags come after --
    args = build_parser().parse_args(argv[:split])
    if args.command == "start":
        args.flags = argv[split + 1:]
        args.run_dir.mkdir(parents=True, exist_ok=True)
        return start_command(args)
    return stop_command(args)


if __name__ == "__main__":
    sys.exit(main())
