"""Lets the end-to-end modules share helpers (`from test_cli import ...`)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
