"""Imported by every worker of a fault test's run (``imports=[tests.e2e._instance_dies]``): the
rollout instance of rank 2 dies in the middle of receiving a version (from version 3 on) in
its first process (ASYNCFLOW_TEST_INSTANCE_DIES=in_sync); with =always, every new process of
rank 2 also dies as it starts (while its worker is built: an instance that keeps dying); with
=every_sync, every process of rank 2 dies in its first version from 3 on."""
from __future__ import annotations

import os

MODE = os.environ.get("ASYNCFLOW_TEST_INSTANCE_DIES", "")

if MODE and os.environ.get("RANK") == "2":
    if os.environ.get("ASYNCFLOW_RESTART", "0") != "0" and MODE != "every_sync":
        if MODE == "always":
            os._exit(9)
    else:
        from asyncflow.weight_sync import intake

        _load = intake.Staged._load

        def _dies_mid_version(self, header, tensors):
            if header.version < 3:
                return _load(self, header, tensors)

            def first_then_die():  # the first bucket is in, the others are still on the wire
                for _ in tensors:
                    os._exit(9)
                yield from ()
            return _load(self, header, first_then_die())

        intake.Staged._load = _dies_mid_version
