"""m3c's entry point: SIGINT and SIGTERM are handled from the first moment, before the command line imports torch.

Importing the command line (torch, Triton, click, rich) takes a second or more; an interrupt then used to end in a
KeyboardInterrupt traceback or a silent death by signal. Here it ends as every interrupt of m3c does: one line and
exit status 130. While a command runs, the command line's own handlers take over (m3compile.cli: a signal while a
command writes removes its partial output) and put this one back when it returns; outside a command nothing is
being written, so this handler can leave at once, saying which outputs (if any) were put in place before it.

When the command is done the process ends at once (os._exit, after flushing what was printed), its handler in place
to the last moment: the interpreter's own shutdown puts the default handlers back before it tears down torch's
modules, which takes long enough that a SIGTERM landing then killed a finished command silently (-15, no line).
"""
import os
import signal
import sys

__all__ = ["main"]

EXIT_INTERRUPTED = 130


def _interrupted(signum, frame):
    written = getattr(sys.modules.get("m3compile.outputs"), "COMMITTED", None)  # only once it was imported
    message = (f"interrupted after {', '.join(map(str, written))} was written in full" if written else
               "interrupted; no output was written")
    try:
        sys.stdout.flush()  # what a finished command printed
    except Exception:  # noqa: BLE001 (a signal in the middle of a write: what was printed stays unflushed)
        pass
    os.write(2, f"error: {message}\n".encode())
    os._exit(EXIT_INTERRUPTED)


def main() -> None:
    """The console script `m3c`: the handlers first, then m3compile.cli.main, then the exit with its status."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _interrupted)
    from m3compile import cli  # the heavy imports

    try:
        cli.main()
        code = 0
    except SystemExit as e:
        code = e.code
    if code is not None and not isinstance(code, int):  # sys.exit("message"), as Python would show it
        print(code, file=sys.stderr)
        code = 1
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except Exception:  # noqa: BLE001 (a closed pipe: nothing more can be shown)
        pass
    os._exit(code or 0)


if __name__ == "__main__":
    main()
