"""Full fine-tuning (PUMA Table 2(a), 2(b)): every backbone parameter trains, and the head."""

from __future__ import annotations

from puma.methods import linear
from puma.methods.method import Method

FULL_FINETUNE = Method(name="full_finetune", build=linear.build, trainable=("backbone", "head"))
