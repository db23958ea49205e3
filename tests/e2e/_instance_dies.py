"""Imported by every worker of a fault test's run (``imports=[tests.e2e._instance_dies]``): the
rollout instance of rank 2 dies in the middle of receiving a version (from version 3 on) in
its first process (ASYNCFLOW_TEST_INSTANCE_DIES=in_sync); with =always, every new process of
rank 2 also dies as it starts (while its worker is built: an instance that keeps dying); with
=every_sync, every process of rank 2 dies in its first version from 3 on; with =in_reward,
the first process of rank 2 dies inside its third reward call (placement.reward_with=rollout),
before it writes a score."""
from __future__ import annotations

import os

MODE = os.environ.get("ASYNCFLOW_TEST_INSTANCE_DIES", "")

if MODE and os.environ.get("RANK") == "2":
    if os.environ.get("ASYNCFLOW_RESTART", "0") != "0" and MODE != "every_sync":
        if MODE == "always":
            os._exit(9)
    elif MODE == "in_reward":
        import functools

        from asyncflow.workers import reward

        _compute = reward.RewardWorker.compute
        _calls = [0]

        @functools.wraps(_compute)  # keeps its @register mark
        def _dies_scoring(self, *args, **kwargs):
            _calls[0] += 1
            if _calls[0] >= 3:
                os._exit(9)
            return _compute(self, *args, **kwargs)

        reward.RewardWorker.compute = _dies_scoring
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
