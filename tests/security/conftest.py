"""Security tests reuse the cluster helpers of the single-controller and TransferQueue
tests (modules of their own there, imported by name)."""
from __future__ import annotations

import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
for _d in ("single_controller", "transfer_queue"):
    _p = os.path.join(os.path.dirname(_HERE), _d)
    if _p not in sys.path:
        sys.path.insert(0, _p)
