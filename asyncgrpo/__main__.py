"""``python -m asyncgrpo``: the ``asyncgrpo`` command (``demo``, ``train``, ``plot``, ...)."""

from asyncgrpo.shell.commands import main

if __name__ == "__main__":
    raise SystemExit(main())
