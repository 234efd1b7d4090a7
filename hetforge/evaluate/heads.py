"""Fine-tuned heads on pooled embeddings (as FORGE evaluates its models beyond zero-shot): the
pre-trained model is frozen, each text becomes the mean of its final hidden states, and a small head
is trained on top, then scored on a held-out split beside a baseline that uses no text at all.

Two tasks on the aclsum benchmark that the demo corpus comes from (its `aclsum/dataset/{train,
val,test}.jsonl`): classifying each sentence of a paper's abstract, introduction and conclusion as
stating the paper's challenge, approach or outcome, or none (macro-F1; baseline: the majority
class), with the sentence's section as a known feature; and predicting a paper's publication year,
read from its ACL Anthology id, from its abstract (MAE in years; baseline: the training mean). The
test-split papers are kept out of the default pre-training corpus (`data.sources[].exclude_splits`),
and `held_out` checks that against the shards a checkpoint was trained on.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from sklearn.metrics import accuracy_score, f1_score, mean_absolute_error

from hetforge.data.corpus import aclsum_dir
from hetforge.data.shards import read_doc_ids

SECTIONS = ("abstract", "introduction", "conclusion")
LABELS = ("none", "challenge", "approach", "outcome")
TASKS = ("aclsum-aspects", "aclsum-year")


def paper_year(paper_id: str) -> int | None:
    """ACL Anthology ids: new style "2020.acl-main.33", old style "P19-1012" / "E09-1056"."""
    m = re.match(r"^(\d{4})\.", paper_id)
    if m:
        return int(m.group(1))
    m = re.match(r"^[A-Z](\d{2})-\d+$", paper_id)
    if m:
        yy = int(m.group(1))
        return 1900 + yy if yy > 60 else 2000 + yy
    return None


def _papers(split: str) -> list[dict]:
    path = aclsum_dir() / f"{split}.jsonl"
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def aspect_sentences(split: str) -> tuple[list[str], list[int], list[int]]:
    """(sentence, section index, label index) for every sentence of a split's papers. A sentence
    marked for more than one aspect takes the first of challenge, approach, outcome."""
    texts, sections, labels = [], [], []
    for p in _papers(split):
        for s_i, section in enumerate(SECTIONS):
            for k, sent in enumerate(p["sentences"].get(section, [])):
                label = 0
                for a_i, aspect in enumerate(LABELS[1:], 1):
                    marks = p["highlights"][aspect].get(section, [])
                    if k < len(marks) and marks[k]:
                        label = a_i
                        break
                texts.append(sent)
                sections.append(s_i)
                labels.append(label)
    return texts, sections, labels


def abstracts(split: str) -> tuple[list[str], list[int]]:
    texts, years = [], []
    for p in _papers(split):
        year = paper_year(p["id"])
        if year is not None and p["sentences"].get("abstract"):
            texts.append(" ".join(p["sentences"]["abstract"]))
            years.append(year)
    return texts, years


@torch.no_grad()
def embed(model, tok, texts: list[str], max_len: int, device: torch.device, batch_size: int = 64) -> torch.Tensor:
    """Mean of the final hidden states over each text's tokens (truncated to `max_len`)."""
    ids = [tok.encode(t, add_special_tokens=False).ids[:max_len] or [0] for t in texts]
    order = sorted(range(len(ids)), key=lambda i: -len(ids[i]))
    out = torch.zeros(len(ids), model.cfg.d_model)
    for start in range(0, len(order), batch_size):
        chunk = order[start:start + batch_size]
        width = len(ids[chunk[0]])
        x = torch.zeros(len(chunk), width, dtype=torch.long)
        mask = torch.zeros(len(chunk), width)
        for row, i in enumerate(chunk):
            x[row, :len(ids[i])] = torch.tensor(ids[i])
            mask[row, :len(ids[i])] = 1
        h = model.features(x.to(device)).float().cpu()
        out[chunk] = (h * mask[..., None]).sum(1) / mask.sum(1, keepdim=True)
    return out


@dataclass
class Head:
    """A linear head on standardised features, with the weight decay chosen on validation."""

    layer: torch.nn.Linear
    mean: torch.Tensor
    std: torch.Tensor
    weight_decay: float
    y_mean: float = 0.0
    y_std: float = 1.0

    @torch.no_grad()
    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer((x - self.mean) / self.std)


def _fit(x, y, kind: str, n_out: int, weight_decay: float, epochs: int, seed: int, class_weight=None):
    torch.manual_seed(seed)
    layer = torch.nn.Linear(x.shape[1], n_out)
    opt = torch.optim.AdamW(layer.parameters(), lr=1e-2, weight_decay=weight_decay)
    for _ in range(epochs):  # full batch: the data is small and the objective convex
        opt.zero_grad()
        out = layer(x)
        loss = F.cross_entropy(out, y, weight=class_weight) if kind == "classify" else F.mse_loss(out[:, 0], y)
        loss.backward()
        opt.step()
    return layer


def train_head(x_train: torch.Tensor, y_train, x_val: torch.Tensor, y_val, kind: str, n_classes: int = 0,
               epochs: int = 300, decays=(1e-3, 1e-2, 1e-1, 1.0), seed: int = 0) -> Head:
    """Classification (class-weighted cross-entropy, chosen by validation macro-F1) or regression
    (MSE on a standardised target, chosen by validation MAE)."""
    mean, std = x_train.mean(0), x_train.std(0) + 1e-6
    xt, xv = (x_train - mean) / std, (x_val - mean) / std
    best = None
    if kind == "classify":
        yt = torch.as_tensor(y_train, dtype=torch.long)
        counts = torch.bincount(yt, minlength=n_classes).float()
        weight = counts.sum() / (n_classes * counts.clamp(min=1))
        for wd in decays:
            layer = _fit(xt, yt, kind, n_classes, wd, epochs, seed, weight)
            with torch.no_grad():
                score = f1_score(y_val, layer(xv).argmax(1).numpy(), average="macro", labels=list(range(n_classes)),
                                 zero_division=0)
            if best is None or score > best[0]:
                best = (score, Head(layer, mean, std, wd))
        return best[1]
    yt = torch.as_tensor(y_train, dtype=torch.float32)
    y_mean, y_std = float(yt.mean()), float(yt.std()) + 1e-6
    for wd in decays:
        layer = _fit(xt, (yt - y_mean) / y_std, kind, 1, wd, epochs, seed)
        with torch.no_grad():
            err = mean_absolute_error(y_val, layer(xv)[:, 0].numpy() * y_std + y_mean)
        if best is None or err < best[0]:
            best = (err, Head(layer, mean, std, wd, y_mean, y_std))
    return best[1]


def _features(model, tok, texts, sections, max_len, device) -> torch.Tensor:
    x = embed(model, tok, texts, max_len, device)
    if sections is None:
        return x
    return torch.cat([x, F.one_hot(torch.tensor(sections), len(SECTIONS)).float()], dim=1)


def aspects_report(model, tok, max_len: int, device: torch.device) -> dict:
    data = {s: aspect_sentences(s) for s in ("train", "val", "test")}
    x = {s: _features(model, tok, d[0], d[1], max_len, device) for s, d in data.items()}
    y = {s: np.array(d[2]) for s, d in data.items()}
    head = train_head(x["train"], y["train"], x["val"], y["val"], "classify", len(LABELS))
    pred = head(x["test"]).argmax(1).numpy()
    majority = np.bincount(y["train"], minlength=len(LABELS)).argmax()
    labels = list(range(len(LABELS)))
    per_class = f1_score(y["test"], pred, average=None, labels=labels, zero_division=0)
    return {
        "task": "aclsum-aspects", "metric": "macro-F1", "split": "test",
        "score": float(f1_score(y["test"], pred, average="macro", labels=labels, zero_division=0)),
        "baseline": float(f1_score(y["test"], np.full_like(y["test"], majority), average="macro", labels=labels,
                                   zero_division=0)),
        "baseline_name": f"majority class ({LABELS[majority]})",
        "accuracy": float(accuracy_score(y["test"], pred)),
        "per_class_f1": {LABELS[i]: float(v) for i, v in enumerate(per_class)},
        "n_train": len(y["train"]), "n_test": len(y["test"]), "weight_decay": head.weight_decay,
    }


def year_report(model, tok, max_len: int, device: torch.device) -> dict:
    data = {s: abstracts(s) for s in ("train", "val", "test")}
    x = {s: _features(model, tok, d[0], None, max_len, device) for s, d in data.items()}
    y = {s: np.array(d[1], dtype=np.float64) for s, d in data.items()}
    head = train_head(x["train"], y["train"], x["val"], y["val"], "regress")
    pred = head(x["test"])[:, 0].numpy() * head.y_std + head.y_mean
    return {
        "task": "aclsum-year", "metric": "MAE (years)", "split": "test",
        "score": float(mean_absolute_error(y["test"], pred)),
        "baseline": float(mean_absolute_error(y["test"], np.full_like(y["test"], y["train"].mean()))),
        "baseline_name": f"training mean ({y['train'].mean():.1f})",
        "n_train": len(y["train"]), "n_test": len(y["test"]), "weight_decay": head.weight_decay,
    }


def held_out(state: dict) -> dict:
    """How many of the aclsum test papers the checkpoint's pre-training shards contain (by paper id)."""
    test_ids = {p["id"] for p in _papers("test")}
    meta_path = Path(state["data_dir"]) / "meta.json" if state.get("data_dir") else None
    if meta_path is None or not meta_path.is_file():
        return {"test_papers": len(test_ids), "in_pretraining": None, "note": "the checkpoint's shards are not at hand"}
    meta = json.loads(meta_path.read_text())
    ids = [d for split in meta["splits"] for d in read_doc_ids(meta_path.parent, split)]
    seen = {Path(re.split(r"[:@#]\d+$", d)[0]).stem for d in ids}
    return {"test_papers": len(test_ids), "in_pretraining": len(test_ids & seen)}


REPORTS = {"aclsum-aspects": aspects_report, "aclsum-year": year_report}
