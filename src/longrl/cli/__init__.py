"""The command line: ``longrl COMMAND`` (main.py parses and dispatches; one module per group of commands)."""
