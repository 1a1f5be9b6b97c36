"""train/memory_model.py `MemoryModel`: one call over a whole multi-segment sequence computes
what one `memtrain train` micro-step on that sample computes (train/bptt.py `run_window`
with the episodic cuts), loss and gradients, whatever the mechanism, BPTT depth and segment
checkpointing; it trains in a plain torch loop and inside transformers.Trainer."""

import copy

import pytest
import torch
from pretrained_helpers import TINY, V, hf_model_section

from data_pipeline.streams import SegmentBatch
from model import ModelConfig, build_model
from model.io import save_model
from train.bptt import episode_cuts, run_window
from train.memory_model import MemoryModel

L, N_SEG = 6, 3


@pytest.fixture(scope="module")
def hf_ckpt(tmp_path_factory):
    return TINY["llama"](tmp_path_factory.mktemp("hf") / "llama")


def _model(kind, hf_ckpt):
    torch.manual_seed(0)
    if kind == "hf-causal":
        section = hf_model_section(hf_ckpt, 3, L, finetune="lora")
        section["rmt"]["pattern"] = "causal"
        return build_model(ModelConfig.from_dict(section))
    if kind == "hf-armt":
        section = hf_model_section(hf_ckpt, 3, L)
        section.update(mechanism="armt", armt={"d_key": 8})
        return build_model(ModelConfig.from_dict(section))
    return build_model(ModelConfig(mechanism="rmt", vocab_size=V, tgt_len=L, mem_len=0,
                                   dropout=0.0, rmt={"num_mem_tokens": 2}))


def _sample(n_tokens=N_SEG * L + 1, batch=2, seed=0):
    return torch.randint(0, V, (batch, n_tokens), generator=torch.Generator().manual_seed(seed))


def _engine_grads(model, x, depth, checkpoint_segments):
    """What `memtrain train` does with one task sample: segments of L+1 tokens, fresh
    memory, the episodic cuts, one backward."""
    segs = [SegmentBatch(tokens=x[:, i * L:(i + 1) * L + 1], reset=torch.zeros(2, dtype=bool),
                         loss_mask=None, epoch=0, step=0) for i in range((x.shape[1] - 1) // L)]
    model.zero_grad()
    res = run_window(model, None, segs, torch.device("cpu"),
                     detach_before=episode_cuts(len(segs), depth),
                     checkpoint_segments=checkpoint_segments)
    res.loss.backward()
    return res.loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()
                               if p.grad is not None}


@pytest.mark.parametrize("kind", ["native-rmt", "hf-causal", "hf-armt"])
@pytest.mark.parametrize("depth,ckpt", [(None, False), (1, True), (0, False)])
def test_loss_and_gradients_equal_memtrain_trains_window_on_the_same_sample(
        kind, depth, ckpt, hf_ckpt):
    model = _model(kind, hf_ckpt).train()
    x = _sample()
    loss, grads = _engine_grads(model, x, N_SEG if depth is None else depth, ckpt)
    drop_in = MemoryModel(model, bptt_depth=depth, checkpoint_segments=ckpt).train()
    model.zero_grad()
    out = drop_in(input_ids=x, labels=x)
    out.loss.backward()
    torch.testing.assert_close(out.loss.detach(), loss, atol=1e-6, rtol=1e-6)
    ours = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert set(ours) == set(grads)
    for name, g in grads.items():
        torch.testing.assert_close(ours[name], g, atol=1e-6, rtol=1e-5, msg=name)
    # transformers' output shape: one logit row per input position.
    assert out.logits.shape == (2, x.shape[1], model.cfg.vocab_size)


def test_ignored_labels_and_right_padding_are_not_counted(hf_ckpt):
    model = MemoryModel(_model("hf-causal", hf_ckpt)).eval()
    x = _sample()
    labels = x.clone()
    labels[:, 3:7] = -100
    mask = torch.ones_like(x)
    mask[1, 15:] = 0
    with torch.no_grad():
        out = model(x, labels=labels, attention_mask=mask)
        lp = out.logits[:, :-1].gather(-1, x[:, 1:, None])[..., 0]
    counted = (labels[:, 1:] != -100) & mask[:, 1:].bool()
    torch.testing.assert_close(out.loss, -(lp * counted).sum() / counted.sum())
    with pytest.raises(ValueError, match="padding must be on the right"):
        model(x, labels=x, attention_mask=torch.flip(mask, [1]))


def test_a_plain_torch_loop_takes_the_same_steps_as_the_engine_window(hf_ckpt):
    model = _model("hf-causal", hf_ckpt).train()
    twin = copy.deepcopy(model)
    drop_in = MemoryModel(model, bptt_depth=1)
    opt_a = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    opt_b = torch.optim.Adam([p for p in twin.parameters() if p.requires_grad], lr=1e-2)
    for step in range(3):
        x = _sample(seed=step)
        opt_a.zero_grad()
        drop_in(x, labels=x).loss.backward()
        opt_a.step()
        _engine_grads(twin, x, 1, False)
        opt_b.step()
    for (name, a), b in zip(model.named_parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5, msg=name)


def test_it_trains_inside_transformers_trainer_with_the_engines_gradient(hf_ckpt, tmp_path):
    from transformers import Trainer, TrainingArguments
    model = _model("hf-causal", hf_ckpt).train()
    save_model(model, tmp_path / "m.safetensors")
    drop_in = MemoryModel.from_pretrained(tmp_path / "m.safetensors")
    twin = copy.deepcopy(drop_in.model)
    x = _sample(batch=4)
    data = [{"input_ids": row, "labels": row} for row in x]
    lr = 0.5
    args = TrainingArguments(output_dir=str(tmp_path / "hf"), per_device_train_batch_size=4,
                             max_steps=1, learning_rate=lr, optim="sgd", max_grad_norm=0.0,
                             weight_decay=0.0, lr_scheduler_type="constant", report_to=[],
                             use_cpu=True, save_strategy="no", logging_steps=1,
                             dataloader_drop_last=False)
    Trainer(model=drop_in, args=args, train_dataset=data).train()
    # One SGD step on the whole batch (rows in any order: the loss is a token mean).
    _, grads = _engine_grads(twin, x, N_SEG, False)
    for (name, p), q in zip(drop_in.model.named_parameters(), twin.parameters(), strict=True):
        want = q - lr * grads[name] if name in grads else q
        torch.testing.assert_close(p, want, atol=1e-6, rtol=1e-5, msg=name)
    assert not torch.equal(drop_in.model.memory_init.value, twin.memory_init.value)
