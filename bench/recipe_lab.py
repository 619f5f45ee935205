"""Recipe lab: why small batches hurt PUMA, with curves (in-process, no Ray; the same model, loss,
optimiser and train step as jobs/train.py).

Decodes the prepared demo data once, then trains one config in this process and logs, every
``--log-every`` steps: loss, CurricularFace t, proxy norms, head weight norm, adapter output /
input norm ratio, prompt-pool weights (alpha) spread, gradient norms per group, and per-dataset
R@1 on the chosen evaluation split (``val``: held-out training classes; ``test`` only to report).

    .venv/bin/python bench/recipe_lab.py --name base optim.lr=2e-5
    .venv/bin/python bench/recipe_lab.py --name proxy1e2 optim.proxy_lr_mult=100 --split val

Writes ``bench/results/recipe_lab/<name>.json`` (config, curves, final metrics). It is a
diagnosis tool; the recipe itself is chosen by tune/sweep.py on validation classes.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from puma import storage  # noqa: E402
from puma.config import absolute_paths, load_config  # noqa: E402
from puma.data import schema  # noqa: E402
from puma.data.images import ViewSpec, item_rng, make_view  # noqa: E402
from puma.data.manifest import load_manifest  # noqa: E402
from puma.data.splits import global_label_map, label_range  # noqa: E402
from puma.eval.metrics import evaluate_embeddings  # noqa: E402

OUT = ROOT / "bench" / "results" / "recipe_lab"


def read_split(manifest, split: str, val_fraction: float) -> dict[str, np.ndarray | list]:
    """Rows of ``split`` (train | val | test): item_id, dataset, label, role, image bytes."""
    stored = schema.TEST if split == schema.TEST else schema.TRAIN
    cols = {k: [] for k in ("item_id", "dataset", "label", "role", "image")}
    for uri in manifest.shard_uris(stored):
        table = pq.read_table(uri, columns=list(cols))
        for row in table.to_pylist():
            rng = label_range(manifest, row["dataset"], split, val_fraction)
            if row["label"] in rng:
                for k in cols:
                    cols[k].append(row[k])
    if split == schema.VAL:
        cols["role"] = [schema.QUERY] * len(cols["item_id"])
    return cols


def eval_arrays(rows: dict, spec: ViewSpec) -> np.ndarray:
    return np.stack([make_view(b, spec) for b in rows["image"]])  # (N, 3, H, W)


@torch.no_grad()
def evaluate(model, images: np.ndarray, rows: dict, batch: int = 128) -> dict[str, float]:
    model.eval()
    out = [model(torch.as_tensor(images[i:i + batch])).numpy() for i in range(0, len(images), batch)]
    model.train()
    emb = np.concatenate(out)
    metrics = evaluate_embeddings(emb, np.asarray(rows["label"]), np.asarray(rows["dataset"]),
                                  np.asarray(rows["role"]), ks=(1,))
    return {**metrics, **spread(emb)}


def spread(emb: np.ndarray) -> dict[str, float]:
    """Collapse indicators: mean pairwise cosine, and the share of variance in the top direction."""
    mean_cos = float((np.square(emb.sum(0)).sum() - len(emb)) / (len(emb) * (len(emb) - 1)))
    centred = emb - emb.mean(0)
    sv = np.linalg.svd(centred, compute_uv=False) ** 2
    return {"emb/mean_cos": mean_cos, "emb/top1_var": float(sv[0] / sv.sum()),
            "emb/eff_rank": float(np.exp(-(p := sv / sv.sum()) @ np.log(p + 1e-12)))}


@torch.no_grad()
def zero_shot(model, images: np.ndarray, rows: dict, batch: int = 128) -> dict[str, float]:
    model.eval()
    feats = [torch.nn.functional.normalize(model.forward_features(torch.as_tensor(images[i:i + batch])),
                                           dim=-1).numpy() for i in range(0, len(images), batch)]
    model.train()
    return evaluate_embeddings(np.concatenate(feats), np.asarray(rows["label"]), np.asarray(rows["dataset"]),
                               np.asarray(rows["role"]), ks=(1,))


def batches_for_epoch(labels: np.ndarray, batch: int, rng: np.random.Generator, sampler: str,
                      m: int) -> list[np.ndarray]:
    """Index batches: uniform (a permutation cut into batches) or m images per class."""
    if sampler == "uniform":
        order = rng.permutation(len(labels))
        return [order[i:i + batch] for i in range(0, len(order) - batch + 1, batch)]
    by_class = {c: rng.permutation(np.flatnonzero(labels == c)) for c in np.unique(labels)}
    chunks = [idx[i:i + m] for idx in by_class.values() for i in range(0, len(idx) - m + 1, m)]
    order = np.concatenate([chunks[i] for i in rng.permutation(len(chunks))])
    return [order[i:i + batch] for i in range(0, len(order) - batch + 1, batch)]


class Probe:
    """Forward hooks: adapter output / input norm ratio, prompt-pool alpha statistics."""

    def __init__(self, model) -> None:
        from puma.models.adapter import StochasticAdapter

        self.ratios: list[float] = []
        self.alpha: list[np.ndarray] = []
        self.block_norms: dict[tuple[int, str], list[float]] = {}
        for module in model.modules():
            if isinstance(module, StochasticAdapter):
                module.register_forward_hook(self._adapter)
        for i, block in enumerate(model.backbone.blocks):
            if hasattr(block, "adapter_attn"):
                parts = (("ls1", None), ("ls2", None), ("adapter_attn", "ls1"), ("adapter_mlp", "ls2"))
                for name, scale in parts:
                    scale = getattr(block, scale) if scale and block.adapter_layer_scale else None
                    getattr(block, name).register_forward_hook(self._norm_hook(i, name, scale))
        pool = getattr(model, "prompt_pool", None)
        if pool is not None:
            pool.register_forward_hook(self._pool)

    def _adapter(self, module, inputs, output) -> None:
        self.ratios.append(float(output.detach().norm() / inputs[0].detach().norm().clamp_min(1e-12)))

    def _norm_hook(self, i: int, name: str, scale=None):
        def hook(module, inputs, output) -> None:  # the update as it enters the residual stream
            update = scale(output.detach()) if scale is not None else output.detach()
            self.block_norms.setdefault((i, name), []).append(float(update.norm()))
        return hook

    def _pool(self, module, inputs, output) -> None:
        self.alpha.append(module.weights(inputs[0]).detach().numpy())

    def pop(self) -> dict[str, float]:
        out = {}
        if self.ratios:
            out["adapter_ratio"] = float(np.mean(self.ratios))
        if self.alpha:
            a = np.concatenate(self.alpha)  # (B, M)
            out["alpha_mean"] = float(a.mean())
            out["alpha_std_over_prompts"] = float(a.std(axis=1).mean())
            out["alpha_std_over_images"] = float(a.std(axis=0).mean())
        blocks = sorted({i for i, _ in self.block_norms})
        for i in blocks:  # adapter output / the sub-block's own (LayerScaled) update, MSA and MLP summed
            own = np.mean(self.block_norms[(i, "ls1")]) + np.mean(self.block_norms[(i, "ls2")])
            adapter = (np.mean(self.block_norms[(i, "adapter_attn")])
                       + np.mean(self.block_norms[(i, "adapter_mlp")]))
            out[f"adapter_vs_block/{i}"] = float(adapter / max(own, 1e-12))
        self.ratios, self.alpha, self.block_norms = [], [], {}
        return out


def group_grad_norms(optimizer) -> dict[str, float]:
    out = {}
    for group in optimizer.param_groups:
        grads = [p.grad.norm() ** 2 for p in group["params"] if p.grad is not None]
        out[f"grad/{group['name']}"] = float(torch.stack(grads).sum().sqrt()) if grads else 0.0
    return out


def loss_stats(loss_module) -> dict[str, float]:
    inner = getattr(loss_module, "loss", loss_module)
    out = {}
    if hasattr(inner, "W"):
        out["proxy_norm"] = float(inner.W.detach().norm(dim=0).mean())
    if hasattr(inner, "t"):
        t = inner.t.detach()
        seen = t[t != 0]
        out["t_mean"] = float(seen.mean()) if len(seen) else 0.0
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--name", required=True)
    ap.add_argument("--config", default=str(ROOT / "configs" / "demo.yaml"))
    ap.add_argument("--split", default="val", choices=["val", "test"])
    ap.add_argument("--val-fraction", type=float, default=0.4)
    ap.add_argument("--steps", type=int, default=100, help="total training steps")
    ap.add_argument("--log-every", type=int, default=10)
    ap.add_argument("--eval-every", type=int, default=50)
    ap.add_argument("--sampler", default="uniform", choices=["uniform", "balanced"])
    ap.add_argument("--m", type=int, default=4, help="images per class (balanced sampler)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--pool-lr-mult", type=float, default=0.0,
                    help="probe: the prompt pool in its own group at lr x this (0: with the modules)")
    ap.add_argument("--prompt-init-scale", type=float, default=1.0,
                    help="probe: multiply the initial prompts P by this (0: prompts start at zero)")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    result = run(args)
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / f"{args.name}.json").write_text(json.dumps(result, indent=1))
    final = result["final"]
    print(f"[lab] {args.name}: harmonic r@1 {final['harmonic/r@1']:.4f} (zero-shot "
          f"{result['zero_shot']['harmonic/r@1']:.4f}) in {result['seconds']:.0f}s")
    return 0


def scale_prompts(model, scale: float) -> None:
    """Probe: the initial prompts P x ``scale`` (1: unchanged)."""
    if scale != 1.0 and getattr(model, "prompt_pool", None) is not None:
        with torch.no_grad():
            model.prompt_pool.prompts.mul_(scale)


def split_pool_group(optimizer, model, cfg_optim, mult: float) -> None:
    """Probe: move the prompt pool out of the "modules" group into its own at lr x ``mult`` (0: no)."""
    if not mult or getattr(model, "prompt_pool", None) is None:
        return
    pool = list(model.prompt_pool.parameters())
    ids = {id(p) for p in pool}
    modules = next(g for g in optimizer.param_groups if g["name"] == "modules")
    modules["params"] = [p for p in modules["params"] if id(p) not in ids]
    optimizer.add_param_group({"name": "pool", "params": pool, "lr": cfg_optim.lr * mult, "lr_mult": mult,
                               "weight_decay": cfg_optim.weight_decay})


def run(args) -> dict:
    from puma.data.images import backbone_normalisation
    from puma.methods import build_method_training, build_model
    from puma.models.trainable import count_trainable, trainable_parameter_groups
    from puma.optim import build_optimizer, build_scheduler, end_warmup_epoch, set_step_lr
    from puma.train.data_init import needs_data_init, start_from_data
    from puma.train.step import train_step

    cfg = absolute_paths(load_config(args.config, args.overrides))
    storage.configure(cfg.storage)
    torch.manual_seed(cfg.train.seed)
    manifest = load_manifest(cfg.data.uri)
    val_fraction = args.val_fraction if args.split == "val" else 0.0
    label_map = global_label_map(manifest, val_fraction)
    train = read_split(manifest, schema.TRAIN, val_fraction)
    ev = read_split(manifest, args.split, val_fraction)
    mean, std = backbone_normalisation(cfg)
    size = cfg.model.backbone.img_size
    ev_images = eval_arrays(ev, ViewSpec(size, mean, std, train=False))
    pairs = zip(train["dataset"], train["label"], strict=True)
    train_labels = np.array([label_map[(d, c)] for d, c in pairs])
    model = build_model(cfg.model)
    method = build_method_training(cfg, model, len(label_map))
    module = method.module
    zs = zero_shot(model, ev_images, ev)
    if needs_data_init(cfg):
        train_ev = eval_arrays(train, ViewSpec(size, mean, std, train=False))

        def batches():
            return ({"image": train_ev[i:i + 128], "label": train_labels[i:i + 128]}
                    for i in range(0, len(train_ev), 128))

        done = start_from_data(cfg, model, module.loss, batches, torch.device("cpu"), lambda b: b["label"])
        print(f"[lab] data init: {done}", flush=True)
    init_stats = evaluate(model, ev_images, ev)
    print(f"[lab] zero-shot {zs['harmonic/r@1']:.4f}, "
          f"step 0 with head {init_stats['harmonic/r@1']:.4f}", flush=True)
    scale_prompts(model, args.prompt_init_scale)
    optimizer = build_optimizer(trainable_parameter_groups(model), module.loss, cfg.optim)
    split_pool_group(optimizer, model, cfg.optim, args.pool_lr_mult)
    scheduler = build_scheduler(optimizer, cfg.optim)
    probe = Probe(model)
    spec = ViewSpec(size, mean, std, train=True)
    rng = np.random.default_rng(cfg.train.seed)
    curves, step, epoch, losses, start = [], 0, 0, [], time.perf_counter()
    steps_per_epoch = len(train_labels) // cfg.train.batch_size
    module.train()
    while step < args.steps:
        for idx in batches_for_epoch(train_labels, cfg.train.batch_size, rng, args.sampler, args.m):
            if step >= args.steps:
                break
            images = torch.as_tensor(np.stack([make_view(train["image"][i], spec,
                                                         item_rng(cfg.train.seed, epoch, train["item_id"][i]))
                                               for i in idx]))
            labels = torch.as_tensor(train_labels[idx])
            set_step_lr(optimizer, scheduler, step, cfg.optim.warmup_steps)
            out = train_step(module, optimizer, images, labels, cfg.optim.clip_value)
            losses.append(out["loss"])
            step += 1
            if step % args.log_every == 0:
                row = {"step": step, "epoch": epoch, "loss": float(np.mean(losses[-args.log_every:])),
                       **loss_stats(module.loss), **probe.pop(), **group_grad_norms(optimizer),
                       "head_norm": float(model.head.proj.weight.detach().norm())}
                if step % args.eval_every == 0 or step == args.steps:
                    row.update(evaluate(model, ev_images, ev))
                curves.append(row)
                shown = {k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()
                         if "/" not in k or k.endswith("r@1") or k.startswith(("emb/", "adapter_vs"))}
                print(json.dumps(shown), flush=True)
            else:
                probe.pop()
        epoch += 1
        end_warmup_epoch(optimizer, scheduler)
        scheduler.step()
    final = evaluate(model, ev_images, ev)
    return {"args": vars(args), "config_overrides": args.overrides, "trainable": count_trainable(model),
            "steps_per_epoch": steps_per_epoch, "zero_shot": zs, "init": init_stats, "curves": curves,
            "final": final, "seconds": time.perf_counter() - start}


if __name__ == "__main__":
    raise SystemExit(main())
