"""Weight sync: how each policy version goes from the training ranks to the rollout instances.

- ``protocol``: what a version is on the wire (header, tensor specs, buckets, messages);
- ``shards``: the training weights tensor by tensor (FSDP2 row shards, gathered or not);
- ``wire_group``: a process group of its own per training rank, joined through a TCP store;
- ``send``: a training rank's sender; ``receive``: a rollout rank's receiver over the wire;
- ``sinks``: where a version's tensors go on the rollout side (staged, in place);
- ``intake``: how a rollout instance takes each version in, one strategy per way (staged,
  in place, or received by the engine's own processes), chosen once;
- ``publish``: ``publish_and_swap``, one version from the policy to every instance (the
  warm-up and phase syncs and the streaming executor alike).

Nothing here imports the role workers: the rollout engines (vLLM's workers join the groups
themselves) and the workers both build on this package. Importing the package itself loads
no submodule (the driver imports ``publish`` without torch).
"""
