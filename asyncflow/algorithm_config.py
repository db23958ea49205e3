"""The ``algorithm`` section of the run's configuration, on its own so that asyncflow.algorithms
(whose functions take it as their ``cfg``) and asyncflow.config (which checks a run's algorithm
names against their registries) both import it without importing each other.
``asyncflow.config.AlgorithmConfig`` is the same class."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class AlgorithmConfig:
    """The ``algorithm`` section; the functions of asyncflow.algorithms take it as their ``cfg``.
    Defaults follow verl's core_algos (eps 1e-6, unbiased group std, clip 0.2, dual-clip c 3,
    log-ratio clamp 20)."""
    advantage: str = "grpo"  # a name in asyncflow.algorithms.ADVANTAGES
    norm_std: bool = True  # grpo divides by the group std (verl: norm_adv_by_std_in_grpo)
    unbiased_std: bool = True  # that std with Bessel's correction (n - 1, as verl); false: population std
    eps: float = 1e-6  # added to every std before dividing (grpo, and whitening), so zero spread gives 0
    gamma: float = 1.0  # discount, in [0, 1]
    lam: float = 1.0  # GAE lambda, in [0, 1]
    whiten: bool = True  # reinforce_pp and gae whiten their advantages over the batch's valid tokens
    policy_loss: str = "auto"  # auto: decoupled_ppo in async mode, ppo_clip otherwise
    # An old_log_prob stage recomputes the proximal log-probs before the update. Without it, an
    # update of one optimizer step takes them at its own forward (the same values, at no extra
    # cost); an update of several (ppo_epochs, mini-batches) computes them first itself.
    recompute_proximal: bool = False
    loss_agg: str = "token-mean"
    clip_low: float = 0.2  # ratio clip range [1 - clip_low, 1 + clip_high]; clip_low in [0, 1)
    clip_high: float = 0.2  # DAPO's clip-higher raises it (e.g. 0.28)
    dual_clip_c: float = 3.0  # dual_clip (verl's vanilla): for A < 0 the loss is capped at c * -A; > 1
    is_cap: float = 2.0  # cap on decoupled_ppo's behaviour importance weight
    tis_cap: float = 2.0  # cap on tis's truncated importance weight
    max_log_ratio: float = 20.0  # log-ratios are clamped to +-this before exp (verl: 20)
    # gspo: the clip range [1 - gspo_clip_low, 1 + gspo_clip_high] of the sequence-level ratio (a
    # length-normalised ratio moves far less than a token's: the GSPO paper's 3e-4 / 4e-4). Keys of
    # their own so that switching policy_loss to gspo never keeps ppo's 0.2; verl reuses clip_ratio_*.
    gspo_clip_low: float = 3e-4  # in [0, 1)
    gspo_clip_high: float = 4e-4  # >= 0
    # cispo: its stop-gradient importance weight is clipped to [1 - cispo_clip_low, 1 + cispo_clip_high].
    # MiniMax-M1 sets no lower bound (cispo_clip_low 1: a floor of 0) and tunes only the upper one,
    # whose value the paper does not give; 3 puts the weight's ceiling at 4.
    cispo_clip_low: float = 1.0  # in [0, 1]
    cispo_clip_high: float = 3.0  # >= 0
    # Rollout correction (asyncflow/algorithms/rollout_corr.py): the engine that sampled the
    # tokens (behaviour log-probs) and the trainer (proximal log-probs) disagree even on the
    # same weights. rho = exp(proximal - behaviour) per token; every policy loss composes with it.
    rollout_is: str = ""  # "" | token | sequence | geometric: weight the loss by min(rho, rollout_is_cap)
    rollout_is_cap: float = 2.0  # > 0; the cap on that weight
    rollout_mask: str = ""  # "" | token | sequence | geometric | any_token: drop tokens whose rho leaves the band
    rollout_mask_low: float = 0.5  # the band [low, high]: 0 < low < 1
    rollout_mask_high: float = 2.0  # high > 1
    kl_coef: float = 0.0  # > 0 adds the reference stage
    kl_estimator: str = "k3"
    kl_in_reward: bool = False
    entropy_coef: float = 0.0
    value_loss: str = "clipped"
    value_clip: float = 0.2
    dynamic_sampling: bool = True  # drop groups whose rewards are all equal, refill from new prompts
    max_refill_factor: float = 3.0  # give up refilling after this many times the step's prompts
    # Optimizer steps per trained batch (verl's names): each of ppo_epochs passes over the step's
    # rows takes one step per mini-batch of ppo_mini_batch_size prompts (0: the whole step), so
    # that the ratio moves away from 1 and clipping acts. The proximal log-probs are fixed before
    # the first step (the old_log_prob stage, or computed by the update itself).
    ppo_epochs: int = 1
    ppo_mini_batch_size: int = 0
