"""VPTSP-G's memory bank of class prompts (paper section 4.4, "Memory Consumption").

Every class c has prompts t^c (CLS-L, m, D); with thousands of classes (SOP: 11,318) the table
and its AdamW state (x3) would fill the accelerator, so they stay in host memory. Each step:

    gather(classes)  the batch's K unique classes' rows -> one leaf tensor (K, CLS-L, m, D) on the
                     compute device, requires_grad; the model reads it, backward fills its .grad
    step(...)        AdamW for exactly those K rows: their state rows (exp_avg, exp_avg_sq, step)
                     move to the device, update, and move back with the new prompts

Update semantics (lazy AdamW). A row is updated only in steps where its class is in the batch;
rows without gradient are untouched (no momentum step, no weight decay), and each row counts its
own steps for bias correction. This is exactly ``torch.optim.AdamW`` with every class's prompts as
a parameter of its own whose ``.grad`` is None when the class is absent (AdamW skips such
parameters): the "all prompts resident" reference of tests/test_vptspg.py. It differs from a dense
AdamW over one (C, ...) parameter, where absent rows would get a zero gradient and still move
(decoupled weight decay, and the decaying momentum of earlier steps). A row whose class is present
in every step gets the dense update exactly. ``offload=False`` keeps the table on the compute
device with the same semantics (results equal the offloaded bank).

Distributed: the bank is outside DDP, and every rank holds a replica. Every rank gathers the rows
of the *global* batch's classes (the same K on every rank, from the all-gathered labels); rows a
rank's local samples do not use get a zero gradient there. ``step`` all-reduces the (K, ...)
gradient and divides by the world size, the average DDP applies to model parameters, so every
replica applies the identical update and the replicas stay equal.

The bank is held by VPTSP-G's loss (puma.losses.semantic_proxy.SemanticProxyLoss), which saves and
loads its state; the train module (puma/methods/vptsp_g.py) steps it after each backward.
"""

from __future__ import annotations

import torch

from puma.distributed import average_over_ranks

STATE_KEYS = ("table", "exp_avg", "exp_avg_sq", "steps")


class ClassPromptBank:
    """All class prompts (C, *shape) and their AdamW state; only the batch's rows reach the device."""

    def __init__(self, table: torch.Tensor, offload: bool = True) -> None:
        self.offload = offload
        self.table = table.detach().to("cpu").clone()  # (C, CLS-L, m, D)
        self.exp_avg = torch.zeros_like(self.table)
        self.exp_avg_sq = torch.zeros_like(self.table)
        self.steps = torch.zeros(self.table.shape[0], dtype=torch.int64)  # AdamW step count per row
        self.rows: torch.Tensor | None = None  # (K,) the rows on the device now
        self.gathered: torch.Tensor | None = None  # (K, ...) the leaf handed to the model
        self.rows_moved = 0  # rows moved to the device so far (with their state)

    @property
    def num_classes(self) -> int:
        return self.table.shape[0]

    @property
    def storage_device(self) -> torch.device:
        return self.table.device

    def gather(self, classes: torch.Tensor) -> torch.Tensor:
        """Unique class ids (K,) on the compute device -> their prompts (K, ...) as a leaf there."""
        if classes.numel() and (int(classes.min()) < 0 or int(classes.max()) >= self.num_classes):
            raise ValueError(f"class ids must be in [0, {self.num_classes}); got {classes.tolist()}")
        if not self.offload and self.storage_device != classes.device:
            self._move_storage(classes.device)  # resident: the whole table lives on the compute device
        self.rows = classes.to(self.storage_device)
        self.gathered = self.table[self.rows].to(classes.device).requires_grad_(True)
        self.rows_moved += int(self.rows.numel())
        return self.gathered

    def step(self, lr: float, weight_decay: float, betas: tuple[float, float] = (0.9, 0.999),
             eps: float = 1e-8, clip_value: float | None = None, grad_scale: float = 1.0) -> bool:
        """AdamW on the gathered rows from their gradient; False (nothing changed) without one."""
        leaf, rows = self.gathered, self.rows
        self.gathered = None
        if leaf is None or leaf.grad is None:
            return False
        grad = average_over_ranks(leaf.grad) / grad_scale
        if not bool(torch.isfinite(grad).all()):  # an fp16 overflow step: skipped, as GradScaler does
            return False
        if clip_value is not None:
            grad = grad.clamp(-clip_value, clip_value)  # clip by value, as train_step does
        device = leaf.device
        param = leaf.detach().clone()
        exp_avg, exp_avg_sq = self.exp_avg[rows].to(device), self.exp_avg_sq[rows].to(device)
        steps = self.steps[rows].to(device) + 1
        adamw_rows(param, grad, exp_avg, exp_avg_sq, steps, lr, weight_decay, betas, eps)
        storage = self.storage_device
        self.table[rows], self.exp_avg[rows] = param.to(storage), exp_avg.to(storage)
        self.exp_avg_sq[rows], self.steps[rows] = exp_avg_sq.to(storage), steps.to(storage)
        return True

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The table and its AdamW state (CPU tensors, for safetensors)."""
        return {key: getattr(self, key).detach().to("cpu") for key in STATE_KEYS}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Restore :meth:`state_dict`; shapes must match this bank."""
        missing = sorted(set(STATE_KEYS) - set(state))
        if missing:
            raise ValueError(f"class-prompt bank state is missing {missing}; expected {list(STATE_KEYS)}")
        if tuple(state["table"].shape) != tuple(self.table.shape):
            raise ValueError(f"class-prompt table of shape {tuple(state['table'].shape)} does not fit this "
                             f"bank {tuple(self.table.shape)} (classes, CLS-L, m, D)")
        for key in STATE_KEYS:
            setattr(self, key, state[key].to(self.storage_device, getattr(self, key).dtype).clone())

    def _move_storage(self, device: torch.device) -> None:
        for key in STATE_KEYS:
            setattr(self, key, getattr(self, key).to(device))


def adamw_rows(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
               steps: torch.Tensor, lr: float, weight_decay: float, betas: tuple[float, float],
               eps: float) -> None:
    """In place: torch.optim.AdamW's update for K rows (K, ...), each with its own step count (K,)."""
    beta1, beta2 = betas
    shape = (-1,) + (1,) * (param.ndim - 1)
    t = steps.double()
    step_size = (lr / (1 - beta1 ** t)).to(param.dtype).view(shape)  # lr / bias_correction1
    bc2_sqrt = ((1 - beta2 ** t) ** 0.5).to(param.dtype).view(shape)
    param.mul_(1 - lr * weight_decay)  # decoupled weight decay
    exp_avg.lerp_(grad, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    denom = (exp_avg_sq.sqrt() / bc2_sqrt).add_(eps)
    param.sub_(step_size * exp_avg / denom)
