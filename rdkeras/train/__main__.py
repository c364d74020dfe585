import sys

from rdkeras.train.app import main

sys.exit(main())
