"""Role workers: what the workflow's stages call. Each reads its input columns from the
TransferQueue and writes its output columns back (see asyncflow.workflow)."""
