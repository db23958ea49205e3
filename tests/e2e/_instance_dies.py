"""Imported by every worker of a fault test's run (``imports=[tests.e2e._instance_dies]``): the
rollout instance of rank 2 dies in the middle of receiving a version (from version 3 on), in
its first process only (ASYNCFLOW_TEST_INSTANCE_DIES=in_sync) or in every one (=always)."""
from __future__ import annotations

import os

MODE = os.environ.get("ASYNCFLOW_TEST_INSTANCE_DIES", "")

if MODE and os.environ.get("RANK") == "2":
    from asyncflow.weight_sync import intake

    _load = intake.Staged._load
    _first_process = os.environ.get("ASYNCFLOW_RESTART", "0") == "0"

    def _dies_mid_version(self, header, tensors):
        if header.version >= 3 and (_first_process or MODE == "always"):
            for _ in tensors:  # the first bucket is in, the others are still on the wire
                os._exit(9)
        return _load(self, header, tensors)

    intake.Staged._load = _dies_mid_version
