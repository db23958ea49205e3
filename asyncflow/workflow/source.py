"""The prompt source: turns dataset records into the rows of a step, n rows per prompt.

Every row carries its own sampling seed, derived from the run seed, the prompt's
position in the stream and the sample's index in its group, so a response does not
depend on how rows are batched (sync and stream see the same samples).
"""
from __future__ import annotations

from typing import Any, Iterator

import torch


def row_seed(run_seed: int, prompt_uid: int, j: int) -> int:
    return (run_seed * 1_000_003 + prompt_uid * 8191 + j * 131 + 1) % (2 ** 31 - 1)


class PromptSource:
    def __init__(self, records: Iterator[dict], group_size: int, seed: int, start_uid: int = 0):
        self.records = records
        self.group_size = group_size
        self.seed = seed
        self.next_uid = start_uid  # prompts issued so far: the data position saved in checkpoints

    async def __call__(self, step: int, n_prompts: int) -> dict[str, Any]:
        prompt_ids, answers, seeds, index, groups = [], [], [], [], []
        for _ in range(n_prompts):
            rec = next(self.records)
            uid = self.next_uid
            self.next_uid += 1
            ids = torch.as_tensor(rec["prompt_ids"], dtype=torch.long)
            for j in range(self.group_size):
                prompt_ids.append(ids)
                answers.append(str(rec["answer"]))
                seeds.append(row_seed(self.seed, uid, j))
                index.append(int(rec.get("index", uid)))
                groups.append(uid)
        return {"prompt_ids": prompt_ids, "answer": answers, "seed": torch.tensor(seeds, dtype=torch.long),
                "prompt_index": torch.tensor(index, dtype=torch.long), "__groups__": groups}
