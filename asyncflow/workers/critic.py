"""The critic (PPO): a value head on the policy's backbone; values in, a value-loss step out.
Its regression targets are the ``returns`` column of the recipe's advantage stage."""
from __future__ import annotations

from typing import Any

from .. import column_names as col
from ..algorithms import VALUE_LOSSES
from ..algorithms.aggregate import aggregate
from ..single_controller import Dispatch, Worker, register
from ..transfer_queue.meta import BatchMeta
from ..workflow.stages import StageIO
from .common import (
    EngineCheckpoints,
    EngineOffload,
    engine_optim,
    per_token_column,
    policy_model,
    resolved_of,
    rows,
    setup_rank,
    train_engine_class,
)


class CriticWorker(EngineCheckpoints, EngineOffload, Worker):
    def __init__(self, cfg: dict, optim: str = "critic_optim"):
        run = resolved_of(cfg, self.platform.name)
        self.cfg = c = run.config
        setup_rank(run)
        self.optim_key = optim
        self.engine = train_engine_class(c.model.train_engine)(
            policy_model(c), engine_optim(c, optim), process_group=self.process_group, platform=self.platform,
            value_head=True)
        self.start_idle(run.derived.offload_idle)  # colocated placement: free the device while other roles run

    @register(Dispatch.ONE_TO_ALL)
    def reset_optimizer(self, phase: str = "rl") -> None:
        self.engine.reset_optimizer(engine_optim(self.cfg, self.optim_key, phase))

    @register(Dispatch.ONE_TO_ALL)
    def compute_values(self, meta: BatchMeta, io: StageIO | dict[str, Any] | None = None) -> None:
        """[prompt, response] -> one value per response token."""
        per_token_column(self, meta, StageIO.of(io, [col.PROMPT_IDS, col.RESPONSE_IDS], [col.VALUES]),
                         self.engine.compute_values)

    @register(Dispatch.ONE_TO_ALL)
    def update(self, meta: BatchMeta, io: StageIO | dict[str, Any] | None = None) -> dict:
        """One value-loss step on this rank's share: [prompt, response, values, returns], plus a
        ``loss_mask`` column when the stage reads one (multi-turn rows: only model tokens, 1, are
        regressed on and counted; tool/environment tokens, 0, are not)."""
        stage = StageIO.of(io, [col.PROMPT_IDS, col.RESPONSE_IDS, col.VALUES, col.RETURNS], [])
        positional = [c for c in stage.inputs if c != col.LOSS_MASK]
        if len(positional) < 4:
            raise ValueError(f"critic rank {self.rank}: update reads [prompt, response, values, returns] "
                             f"columns (and optionally loss_mask); the stage declares {stage.inputs}")
        p_col, r_col, v_col, ret_col = positional[:4]
        mask_cols = [col.LOSS_MASK] if col.LOSS_MASK in stage.inputs else []
        mine = meta.part(self.dp_size, self.dp_rank)
        data = self.tq.get_columns(mine, [p_col, r_col, v_col, ret_col, *mask_cols]) if len(mine) else None
        pick = (lambda c: [x.float() if c in (v_col, ret_col) else x for x in rows(data[c])]) if data is not None \
            else (lambda c: [])
        a = self.cfg.algorithm
        loss_name, clip = a.value_loss, a.value_clip

        def loss_fn(values, entropy, mask, fields, norm):
            per_token, diag = VALUE_LOSSES.get(loss_name)(values, fields["old_values"], fields[col.RETURNS], mask,
                                                          clip=clip)
            loss = aggregate(per_token, mask, "token-mean", num_tokens=norm.num_tokens, num_seqs=norm.num_seqs)
            m = mask.float()
            return loss, {f"critic/{k}": float((v.float() * m).sum() / m.sum().clamp(min=1)) for k, v in diag.items()}

        fields = {"old_values": pick(v_col), col.RETURNS: pick(ret_col)}
        if mask_cols:  # the engine ANDs it into the mask and counts only model tokens
            fields[col.LOSS_MASK] = pick(col.LOSS_MASK)
        m = self.engine.train_step(pick(p_col), pick(r_col), fields, loss_fn)
        return {f"critic/{k}" if "/" not in k else k: float(v) for k, v in m.items() if isinstance(v, (int, float))}
