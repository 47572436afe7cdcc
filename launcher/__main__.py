"""`python -m launcher`: servers in the background for `make serve-prefill serve-decode stop`.

    python -m launcher start NAME MODULE --address HOST:PORT [--run-dir DIR] -- FLAGS...
    python -m launcher stop NAME... [--run-dir DIR]

`start` runs `python -m MODULE FLAGS...` in the background (its log and pid in --run-dir as NAME.log
and NAME.pid) and returns once it serves, or fails with the log's last lines if it exits first. It
asks the server's health as the server's own FLAGS say: over TLS with --tls-cert (trusting --tls-ca,
--tls-client-ca and the certificate itself; presenting --tls-client-cert, or the server's own
certificate, where --tls-client-ca requires one), or on its plaintext --health-port.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path

from launcher.process import ServerFailed, ServerProcess, pid_alive


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
    parser = argparse.ArgumentParser(prog="python -m launcher", description=__doc__,
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
