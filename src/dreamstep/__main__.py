import sys

if sys.argv[1:2] == ["train"]:  # a trainer's signal handlers come first (dreamstep.engine.interrupt)
    from dreamstep.engine.interrupt import hold_from_the_start

    hold_from_the_start()

from dreamstep.cli import main  # noqa: E402

sys.exit(main())
