import sys

from dreamstep.cli import main

sys.exit(main())
