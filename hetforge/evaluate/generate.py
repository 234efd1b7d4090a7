"""Sampling from a trained model: greedy, or temperature with optional top-k."""

from __future__ import annotations

import torch
from torch import nn


@torch.no_grad()
def generate(
    model: nn.Module,
    prompt_ids: list[int],
    max_new_tokens: int,
    context: int,
    temperature: float = 0.0,
    top_k: int | None = None,
    eot_id: int | None = None,
    seed: int | None = None,
) -> list[int]:
    """Continue `prompt_ids`. temperature=0 is greedy. The window is the last `context` tokens:
    rotary positions are relative, so a sliding window is what the model saw in training."""
    if not prompt_ids:
        raise ValueError("the prompt must encode to at least one token")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0 (got {temperature})")
    device = next(model.parameters()).device
    gen = torch.Generator(device="cpu")
    if seed is not None:
        gen.manual_seed(seed)
    was_training = model.training
    model.eval()
    ids = list(prompt_ids)
    for _ in range(max_new_tokens):
        x = torch.tensor([ids[-context:]], device=device)
        logits = model(x)[0, -1].float().cpu()
        if temperature == 0:
            nxt = int(logits.argmax())
        else:
            logits = logits / temperature
            if top_k:
                kth = torch.topk(logits, min(top_k, logits.numel())).values[-1]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            nxt = int(torch.multinomial(torch.softmax(logits, -1), 1, generator=gen))
        ids.append(nxt)
        if eot_id is not None and nxt == eot_id:
            break
    model.train(was_training)
    return ids[len(prompt_ids):]
