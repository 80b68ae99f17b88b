"""Shared fixtures: the SmolLM2 tokenizer, the tiny random model and a renderer for them."""

from __future__ import annotations

import pytest
import torch

from looprl.chat import ChatRenderer
from looprl.models import load_causal_lm, load_tokenizer

# The tiny model is far too small for intra-op threads to pay off; with a busy machine
# they make every forward pass orders of magnitude slower.
torch.set_num_threads(1)


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
