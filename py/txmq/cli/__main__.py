import sys

from txmq.cli.app import main

sys.exit(main())
