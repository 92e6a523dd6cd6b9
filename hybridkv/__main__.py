"""`python -m hybridkv demo | serve ...`: the same as the `hybridkv` command."""
import sys

from hybridkv.cli import main

sys.exit(main())
