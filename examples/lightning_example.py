"""Lightning with mpckpt: the one-line change, top-k, resuming from "last", and loading the best model.

    python examples/lightning_example.py              # trains 3 epochs into ./runs/lightning-example
    python examples/lightning_example.py --epochs 5   # run again: resumes from last.ckpt, trains to epoch 5
    python examples/lightning_example.py --ddp        # the same with strategy="ddp" on 2 CPU processes

Needs ``pip install 'mpckpt[lightning]'``.
"""

from __future__ import annotations

import argparse

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn

import mpckpt
from mpckpt.integrations.lightning import MpckptCheckpointIO


class Regressor(L.LightningModule):
    def __init__(self, lr: float = 1e-2) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 1))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], i: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], i: int) -> None:
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self.net(x), y), sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)

    def _data(self, seed: int) -> torch.utils.data.DataLoader:
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(512, 32, generator=g)
        y = x.sum(dim=1, keepdim=True) + 0.1 * torch.randn(512, 1, generator=g)
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=64)

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        return self._data(0)

    def val_dataloader(self) -> torch.utils.data.DataLoader:
        return self._data(1)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", default="runs/lightning-example")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--ddp", action="store_true")
    args = parser.parse_args()

    checkpoints = ModelCheckpoint(dirpath=args.dir, monitor="val_loss", save_top_k=2, save_last=True)
    trainer = L.Trainer(
        max_epochs=args.epochs,
        accelerator="cpu",
        devices=2 if args.ddp else 1,
        strategy="ddp" if args.ddp else "auto",
        plugins=[MpckptCheckpointIO(workers=2)],   # the one-line change
        callbacks=[checkpoints],
        logger=False,
        enable_progress_bar=False,
    )
    trainer.fit(Regressor(), ckpt_path="last")      # resumes when last.ckpt exists, else starts afresh
    if trainer.is_global_zero:
        print(f"best: {checkpoints.best_model_path} ({float(checkpoints.best_model_score):.4f})")
        print(f"last: {checkpoints.last_model_path}")
        # the files are Lightning checkpoints: load them as always (any machine, no mpckpt needed)
        best = Regressor.load_from_checkpoint(checkpoints.best_model_path)
        print(f"loaded the best model (lr={best.hparams.lr}) with Regressor.load_from_checkpoint")
        root = trainer.strategy.checkpoint_io.root_for(checkpoints.last_model_path)  # beside the folder
        with mpckpt.Checkpointer(root, read_only=True) as ckpt:
            print(f"mpckpt steps in {root}: {ckpt.steps()}  (inspect them: mpckpt ls {root})")


if __name__ == "__main__":
    main()
