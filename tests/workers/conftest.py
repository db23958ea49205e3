"""The worker tests reuse the cluster helpers of the single-controller tests (a module of
its own there, imported by name)."""
from __future__ import annotations

import os
import sys

_SC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "single_controller")
if _SC not in sys.path:
    sys.path.insert(0, _SC)
