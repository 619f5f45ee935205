"""Checkpoints written before the method records (commit eb27426; tests/data/checkpoints_v0, made by
its make.py) still load: the model rebuilt from their config reproduces their probe embeddings,
their model id is unchanged (indexes built from them accept them), and their loss state resumes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from puma.checkpoint import checkpoint_id, load_model, read_checkpoint
from puma.methods import build_model, build_train_module
from puma.models import trainable_state_dict

OLD = Path(__file__).resolve().parent / "data" / "checkpoints_v0"
IDS: dict[str, str] = json.loads((OLD / "ids.json").read_text())
NUM_CLASSES = 4  # what make.py trained the loss state with


@pytest.mark.parametrize("method", sorted(IDS))
def test_an_old_checkpoint_loads_reproduces_its_embeddings_and_keeps_its_id(method):
    uri = str(OLD / method)
    model, cfg = load_model(uri)  # verify: the probe embeddings saved with it, to 1e-4
    assert cfg.model.method == model.method == method
    assert set(read_checkpoint(uri).model) == set(trainable_state_dict(model))  # the same trainable set
    assert checkpoint_id(uri) == IDS[method]


@pytest.mark.parametrize("method", ["vptsp_g", "udml_ss"])
def test_the_loss_state_of_an_old_checkpoint_resumes(method):
    """As the worker loop resumes: the method's train module loads the saved loss state exactly."""
    state = read_checkpoint(str(OLD / method))
    module = build_train_module(state.config, build_model(state.config.model), NUM_CLASSES)
    module.loss.load_state_dict(dict(state.loss))
    resumed = module.loss.state_dict()
    assert set(resumed) == set(state.loss)
    for key, value in state.loss.items():
        assert torch.equal(resumed[key].cpu(), value), key
    if method == "vptsp_g":
        assert int(module.loss.class_prompts.steps.sum()) > 0  # the bank's trained rows came back
