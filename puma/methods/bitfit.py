"""BitFit (Ben Zaken et al., PUMA Table 2(c)): every backbone bias trains (LayerNorm's too), and a head."""

from __future__ import annotations

from puma.methods import linear
from puma.methods.method import Method

BITFIT = Method(name="bitfit", build=linear.build, trainable=("backbone_biases", "head"))
