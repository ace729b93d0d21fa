"""`python -m tfdist.launch`: the same as `tfdist launch`."""

import sys

from tfdist.launch import main

sys.exit(main())
