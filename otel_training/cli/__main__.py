"""``python -m otel_training.cli``: the ``otel-training`` command."""

import sys

from otel_training.cli import main

sys.exit(main())
