"""`python -m devstack`: the whole stack on loopback (`make run`)."""
import sys

from devstack.stack import main

sys.exit(main())
