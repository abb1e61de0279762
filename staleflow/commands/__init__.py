"""One module per ``staleflow`` subcommand, each importing what it needs at module level.

``staleflow.cli`` builds the parser and imports only the module of the command being run
(by name, from its table), so ``staleflow --help`` loads none of them.
"""
