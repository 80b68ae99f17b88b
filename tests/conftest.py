"""Shared fixtures: the SmolLM2 tokenizer, the tiny random model and a renderer for them."""

from __future__ import annotations

import pytest
import torch
from hypothesis import settings

from looprl.chat import ChatRenderer
from looprl.model.load import load_causal_lm, load_tokenizer

# The tiny model is far too small for intra-op threads to pay off; with a busy machine
# they make every forward pass orders of magnitude slower.
torch.set_num_threads(1)

# Property tests check what is generated, not how fast: on a loaded 2-core machine a
# single example can take longer than hypothesis's default 200 ms deadline.
settings.register_profile("looprl", deadline=None)
settings.load_profile("looprl")


@pytest.fixture(scope="session")
def tokenizer():
    return load_tokenizer("tiny-random")


@pytest.fixture(scope="session")
def tiny_model():
    model = load_causal_lm("tiny-random", torch.float32)
    model.eval()
    return model


@pytest.fixture(scope="session")
def renderer(tokenizer):
    return ChatRenderer(tokenizer, model_name="tiny-random")
