"""Write the tiny checkpoints in this folder with the code of commit eb27426 (before issue 17).

They prove that checkpoints written before the method records still load (tests/test_checkpoint_compat.py).
Run against that commit's tree, not this one:

    mkdir /tmp/old && git archive eb27426 | tar -x -C /tmp/old
    PYTHONPATH=/tmp/old:/tmp/old/tests python tests/data/checkpoints_v0/make.py tests/data/checkpoints_v0

Each method's tiny model gets seeded, perturbed trainable weights; VPTSP-G and UDML-SS also save the
loss state of one training step (the class-prompt bank, the proxies). ``ids.json`` holds each
checkpoint's model id as that commit's embed job computed it.
"""
# ruff: noqa: I001 (puma.train.methods exists only in that commit, so ruff cannot place it)

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from tiny import tiny_images, tiny_model_config

from puma.checkpoint import CheckpointState, probe_embeddings, save_checkpoint
from puma.config import Config, LossConfig
from puma.inference.job import checkpoint_id
from puma.models import build_model
from puma.models.trainable import trainable_state_dict
from puma.train.methods import build_method_training

METHODS = {"puma": {}, "vpt_deep": {"vpt": {"length": 2}}, "puma_lora": {"lora": {"rank": 4}},
           "bitfit": {}, "vptsp_g": {"vptsp_g": {"prompt_length": 2, "class_prompt_layers": 2}},
           "udml_ss": {"udml_ss": {"num_clusters": 2}}}
NUM_CLASSES = 4


def make(out: Path, method: str, sections: dict) -> str:
    loss = LossConfig(name="proxy_anchor" if method == "vptsp_g" else "curricularface")
    cfg = Config(model=tiny_model_config(method=method, **sections), loss=loss)
    torch.manual_seed(0)
    model = build_model(cfg.model)
    module = build_method_training(cfg, model, NUM_CLASSES).module
    if method in ("vptsp_g", "udml_ss"):  # one step fills the bank / memory: non-initial loss state
        module.train()(tiny_images(8), torch.arange(NUM_CLASSES).repeat(2))["loss"].backward()
        module.after_backward(torch.optim.AdamW([torch.zeros(1)]), 1.0, 1.0) if method == "vptsp_g" else None
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(0.05 * torch.randn(p.shape, generator=gen))
    meta = {"probe": probe_embeddings(model, cfg.model.backbone.img_size), "backbone_weights": "none"}
    uri = str(out / method)
    save_checkpoint(uri, CheckpointState(config=cfg, model=trainable_state_dict(model),
                                         loss=module.loss.state_dict(), meta=meta))
    return checkpoint_id(uri)


if __name__ == "__main__":
    folder = Path(sys.argv[1])
    ids = {method: make(folder, method, sections) for method, sections in METHODS.items()}
    (folder / "ids.json").write_text(json.dumps(ids, indent=2, sort_keys=True) + "\n")
