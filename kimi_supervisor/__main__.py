import sys

from kimi_supervisor.cli.entry import main

sys.exit(main())
