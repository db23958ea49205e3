"""Engines: rollout (generation) and training backends.

Kept empty of imports on purpose: engines pull in heavy libraries (transformers,
vllm) lazily, so `import asyncflow.engines` must stay cheap.
"""
