import sys

from kimi_supervisor.cli import main

sys.exit(main())
