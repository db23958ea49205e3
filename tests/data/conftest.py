from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def char_tok():
    from asyncflow.models.char_tokenizer import build_char_tokenizer

    return build_char_tokenizer()
