"""The ``dataplane`` console script and its sub-commands.

:mod:`dataplane.cli.script` holds :func:`main` (the parser and the terminal behaviour every
command shares, with :mod:`dataplane.cli.console`); each sub-command is one module here
(``bench``, ``demo``, ``export``, ``inspect``), imported only when it runs. ``python -m
dataplane.cli`` runs the same :func:`main` as the ``dataplane`` script.
"""

from dataplane.cli.script import main

__all__ = ["main"]
