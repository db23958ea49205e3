"""The trainer in parts: starting a recipe's roles (``roles``), the phases around RL
(``phases``: warm-up, evaluation, weight sync) and the observers the executor tells about
each step (``observers``: metrics, checkpoints, evaluation schedule, sample audit).
``asyncflow.training.trainer.Training`` puts them together."""
