"""Language-model training: labkit's Trainer with the hooks next-token prediction needs.

    from labkit.models.gpt import GPT, GPTConfig, adamw
    from labkit.lm import LMTrainer
    trainer = LMTrainer(model, adamw(model, 3e-4, rt=rt), rt, cfg, train_batches, val_batches)
    trainer.fit()

Kept apart from labkit/gpt.py so that the model file depends on torch only (as nanoGPT's model.py):
the dependency points loop -> model, never model -> loop.
"""

from __future__ import annotations

import torch.nn.functional as F

from labkit.loop import Trainer


class LMTrainer(Trainer):
    """labkit.Trainer for next-token prediction: batches are (x, y), both (B, T) token ids.

    Under TrainConfig.compile the model is compiled with its loss inside (GPT.forward(x, y) returns it), so the
    forward, the cross-entropy and their backward are one graph (labkit.runtime.step).

    Records: loss in nats per token; evaluate() gives val_loss (nats per token) and val_acc
    (next-token accuracy). examples/s counts sequences: tokens/s = examples/s * T."""

    def train_step(self, batch):
        x, y = batch
        with self.autocast():
            _, loss = self.model(x, y)
        self.backward(loss)  # the GradScaler's scaled backward under fp16
        return loss

    def eval_step(self, batch) -> dict:
        x, y = batch
        with self.autocast():
            logits, _ = self.model(x)
        logits = logits.float()
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), y.reshape(-1), ignore_index=-1, reduction="sum")
        return {"loss_sum": loss, "correct": (logits.argmax(-1) == y).sum(), "count": (y >= 0).sum()}
