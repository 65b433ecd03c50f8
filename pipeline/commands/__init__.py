"""The bodies of the `specpipe` subcommands, one module per subcommand. pipeline/cli.py parses argv, calls
these and turns their results and errors into exit codes: nothing here reads sys.argv or calls sys.exit."""
