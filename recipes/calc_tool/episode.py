"""The calculator episode: the model may write `<expression>`; the calculator's result comes
back as text, and the model goes on until it answers. Scored 1 when its last turn is the sum."""
from __future__ import annotations

from asyncflow.agents.episode import EpisodeContext, Trajectory
from asyncflow.data.calc import CALL_CLOSE, CALL_OPEN, RESULT_END


async def calc_episode(row: dict, ctx: EpisodeContext) -> Trajectory:
    conv = ctx.start()
    text = await conv.model(stop=CALL_CLOSE)
    while text.endswith(CALL_CLOSE) and CALL_OPEN in text and not conv.done:
        expression = text[text.rindex(CALL_OPEN) + 1:-1]
        await conv.tool("calculator", expression)
        conv.env(RESULT_END)
        if conv.done:
            break
        text = await conv.model(stop=CALL_CLOSE)
    return conv.finish(float(text.strip() == ctx.answer))
