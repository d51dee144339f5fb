"""Gradient clipping bounds the gradient the optimizer steps with (a planted bug that ignored
`grad_clip` passed every other training test: AdamW's first update hardly depends on the scale)."""

import pytest
import torch

from gptlab.train import Trainer
from test_train import byte_data, config  # noqa: F401 (byte_data is a fixture)


def grad_norm(model) -> float:
    norms = [torch.linalg.vector_norm(p.grad) for p in model.parameters() if p.grad is not None]
    return float(torch.linalg.vector_norm(torch.stack(norms)))


@pytest.mark.parametrize("grad_clip", [0.05, 0.0])
def test_grad_clip_bounds_the_norm_the_optimizer_steps_with(byte_data, tmp_path, grad_clip):  # noqa: F811
    trainer = Trainer(config(byte_data, tmp_path / "run", grad_clip=grad_clip, precision="float32"))
    stepped = []
    optimizer_step = trainer.optimizer.step

    def recording_step(*args, **kwargs):
        stepped.append(grad_norm(trainer.raw_model))
        return optimizer_step(*args, **kwargs)

    trainer.optimizer.step = recording_step
    record = trainer.step()
    assert record["grad_norm"] > 10 * 0.05  # the norm logged is the raw one, well above the bound (measured 2.79)
    if grad_clip:
        assert stepped == [pytest.approx(grad_clip, rel=1e-4)]
    else:  # 0 turns clipping off
        assert stepped == [pytest.approx(record["grad_norm"], rel=1e-4)]
