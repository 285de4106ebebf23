"""Sub-commands of the ``dataplane`` CLI, one module each (see ``dataplane.cli``)."""

__all__: list[str] = []
