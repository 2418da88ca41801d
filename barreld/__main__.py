import sys

from barreld.main import main

sys.exit(main())
