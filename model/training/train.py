"""Train our own `QKVTransformerForCausalLM` on text: next-byte prediction.

AdamW, linear warm-up then cosine decay, gradient clipping, a fixed seed, a held-out
validation split (the last `val_fraction` of the bytes), periodic validation loss, a progress
bar, and the result saved in our safetensors layout (loadable by `LLM(DIR)` and the service).

    python -m model.training.train --text corpus.txt --out runs/base --threads 2
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from model.config import PRESETS, ModelConfig
from model.models.transformer import Transformer


@dataclass(frozen=True)
class TrainConfig:
    """Optimisation settings; the defaults fit the paper's base shape on a 2-core CPU in an hour."""

    steps: int = 1000
    batch_size: int = 16
    seq_len: int = 256
    lr: float = 7e-4  # peak, after warm-up
    min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio
    warmup_steps: int = 100
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = 1.0
    seed: int = 0
    val_fraction: float = 0.05
    eval_every: int = 100
    eval_batches: int = 16

    def __post_init__(self) -> None:
        for name in ("steps", "batch_size", "seq_len", "eval_every", "eval_batches"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not 0.0 < self.val_fraction < 0.5:
            raise ValueError(f"val_fraction must be in (0, 0.5), got {self.val_fraction}")


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warm-up to cfg.lr, then cosine decay to cfg.lr * min_lr_ratio at the last step."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
    floor = cfg.lr * cfg.min_lr_ratio
    return floor + 0.5 * (cfg.lr - floor) * (1.0 + math.cos(math.pi * min(1.0, progress)))


def split_bytes(data: bytes, val_fraction: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Train and validation byte tensors: the validation split is the last part of the text."""
    ids = torch.frombuffer(bytearray(data), dtype=torch.uint8).long()
    cut = int(len(ids) * (1.0 - val_fraction))
    return ids[:cut], ids[cut:]


def sample_batch(data: torch.Tensor, batch: int, seq_len: int, gen: torch.Generator) -> torch.Tensor:
    """(batch, seq_len + 1) windows at random offsets: inputs are [:, :-1], targets [:, 1:]."""
    if len(data) <= seq_len + 1:
        raise ValueError(f"text of {len(data)} bytes is too short for seq_len {seq_len}")
    starts = torch.randint(0, len(data) - seq_len - 1, (batch,), generator=gen)
    return torch.stack([data[s:s + seq_len + 1] for s in starts.tolist()])


def batch_loss(net: Transformer, window: torch.Tensor) -> torch.Tensor:
    """Mean next-byte cross-entropy (nats) of a (B, T + 1) window."""
    logits = net.forward_train(window[:, :-1])  # (B, T, vocab)
    return F.cross_entropy(logits.flatten(0, 1), window[:, 1:].flatten())


@torch.no_grad()
def evaluate(net: Transformer, data: torch.Tensor, cfg: TrainConfig) -> float:
    """Validation loss in nats per byte over fixed windows (the same ones at every evaluation)."""
    net.eval()
    gen = torch.Generator().manual_seed(cfg.seed + 1)
    losses = [batch_loss(net, sample_batch(data, cfg.batch_size, cfg.seq_len, gen)).item()
              for _ in range(cfg.eval_batches)]
    net.train()
    return sum(losses) / len(losses)


def train(model_cfg: ModelConfig, text: bytes, cfg: TrainConfig, progress: bool = True,
          on_eval: Callable[[Transformer, dict], None] | None = None,
          before_step: Callable[[int], None] | None = None) -> tuple[Transformer, list[dict]]:
    """Train a fresh model; returns it and its history (one dict per evaluation).

    `on_eval(model, record)` runs after each evaluation (e.g. to save a checkpoint);
    `before_step(step)` before each optimisation step (e.g. to pause while the machine is busy).
    Wall time in the history counts only time spent inside steps and evaluations."""
    torch.manual_seed(cfg.seed)
    train_ids, val_ids = split_bytes(text, cfg.val_fraction)
    net = Transformer(model_cfg)
    net.init_weights(cfg.seed)
    net.train()
    opt = torch.optim.AdamW(_param_groups(net, cfg.weight_decay), lr=cfg.lr, betas=cfg.betas)
    gen = torch.Generator().manual_seed(cfg.seed)
    history: list[dict] = []
    busy = 0.0
    bar = tqdm(range(cfg.steps), disable=not progress, desc="train", unit="step")
    for step in bar:
        if before_step:
            before_step(step)
        start = time.perf_counter()
        for group in opt.param_groups:
            group["lr"] = lr_at(step, cfg)
        loss = batch_loss(net, sample_batch(train_ids, cfg.batch_size, cfg.seq_len, gen))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), cfg.grad_clip)
        opt.step()
        bar.set_postfix(loss=f"{loss.item():.3f}")
        if (step + 1) % cfg.eval_every == 0 or step + 1 == cfg.steps:
            record = {"step": step + 1, "train_loss": loss.item(), "val_loss": evaluate(net, val_ids, cfg)}
            record["val_bits_per_byte"] = record["val_loss"] / math.log(2)
            busy += time.perf_counter() - start
            record["elapsed_s"] = busy
            history.append(record)
            if on_eval:
                on_eval(net, record)
        else:
            busy += time.perf_counter() - start
    return net.eval(), history


def _param_groups(net: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Decay matrices; leave biases, norms and 1-D parameters alone."""
    decay = [p for p in net.parameters() if p.dim() >= 2]
    rest = [p for p in net.parameters() if p.dim() < 2]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": rest, "weight_decay": 0.0}]


def main(argv: list[str] | None = None) -> None:
    from model.loading.checkpoint import save_model

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--text", nargs="+", required=True, help="UTF-8 (or any) text files to learn")
    ap.add_argument("--out", required=True, help="checkpoint directory to write")
    ap.add_argument("--preset", default="transformer-base", help="model shape to train (a preset name)")
    for f in dataclasses.fields(TrainConfig):
        if f.name != "betas":
            ap.add_argument(f"--{f.name.replace('_', '-')}", type=type(f.default), default=f.default)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    text = b"\n\n".join(Path(p).read_bytes() for p in args.text)
    cfg = TrainConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(TrainConfig) if f.name != "betas"})
    model_cfg = PRESETS[args.preset]
    out = Path(args.out)
    history: list[dict] = []

    def checkpoint(net: Transformer, record: dict) -> None:
        """Save after every evaluation, so that an interrupted run keeps its latest model."""
        history.append(record)
        tqdm.write(f"step {record['step']}: val {record['val_loss']:.4f} nats/byte "
                   f"({record['val_bits_per_byte']:.3f} bits/byte), {record['elapsed_s']:.0f} s")
        save_model(net, out)
        (out / "training.json").write_text(json.dumps(
            {"train_config": dataclasses.asdict(cfg), "preset": args.preset, "text_bytes": len(text),
             "torch_threads": torch.get_num_threads(), "history": history}, indent=2) + "\n")

    train(model_cfg, text, cfg, on_eval=checkpoint)
    print(f"saved {out}; final validation {history[-1]['val_bits_per_byte']:.3f} bits/byte")


if __name__ == "__main__":
    main()
