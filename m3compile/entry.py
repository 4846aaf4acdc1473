"""m3c's entry point: SIGINT and SIGTERM are handled from the first moment, before the command line imports torch.

Importing the command line (torch, Triton, click, rich) takes a second or more; an interrupt then used to end in a
KeyboardInterrupt traceback or a silent death by signal. Here it ends as every interrupt of m3c does: one line and
exit status 130. While a command runs, the command line's own handlers take over (m3compile.cli: a signal while a
command writes removes its partial output) and put this one back when it returns; outside a command nothing is
being written, so this handler can leave at once, saying which outputs (if any) were put in place before it.
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
    """The console script `m3c`: the handlers first, then m3compile.cli.main."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _interrupted)
    from m3compile import cli  # the heavy imports

    cli.main()


if __name__ == "__main__":
    main()
