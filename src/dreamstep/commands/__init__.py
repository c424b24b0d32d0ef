"""The commands that are not trainers, one module each, beside :mod:`dreamstep.cli`. A module provides
``configure_parser(parser, key)`` and ``run(args, key)``; the work itself lives in the library packages."""
