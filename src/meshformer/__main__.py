import sys

from meshformer.cli.main import main

sys.exit(main())
