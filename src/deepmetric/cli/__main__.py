"""``python -m deepmetric.cli`` and ``torchrun ... -m deepmetric.cli``: the ``deepmetric`` command."""
import sys

from deepmetric.cli import main

sys.exit(main())
