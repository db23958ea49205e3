"""Weight sync: how each policy version goes from the training ranks to the rollout instances.

- ``protocol``: what a version is on the wire (header, tensor specs, buckets, messages);
- ``shards``: the training weights tensor by tensor (FSDP2 row shards, gathered or not);
- ``wire_group``: a process group of its own per training rank, joined through a TCP store;
- ``send``: a training rank's sender;
- ``receive``: the remote receiver, and where a version's tensors go (staged, in place).

Nothing here imports the role workers: the rollout engines (vLLM's workers join the groups
themselves) and the workers both build on this package. Importing the package itself loads
no submodule.
"""
