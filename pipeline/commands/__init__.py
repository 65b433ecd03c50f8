"""The bodies of the `specpipe` subcommands, one module per subcommand. pipeline/cli.py parses argv, calls
these and turns their results and errors into exit codes: nothing here reads sys.argv or calls sys.exit."""


def stop_signals() -> None:
    """SIGTERM (`kill <pid>`, Slurm's preemption and time limit) and SIGINT raise KeyboardInterrupt, so a command
    unwinds as on Ctrl-C: the servers it started (vLLM, Triton: each in its own process group, which the terminal's
    Ctrl-C does not reach) are stopped by their context managers, and a stage in progress commits nothing. Also when
    the process was started with SIGINT ignored."""
    import signal

    def _term(*_):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, _term)
    signal.signal(signal.SIGINT, _term)
