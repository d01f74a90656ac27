"""Teacher-forced logit agreement between implementations of the same model.

Used by the bf16 fast-path gate (``tests/model/test_gpu_fastpath.py``) and by
``benchmarks/bf16_agreement.py``: every model reads the same tokens (8 requests, a prefilled
context, then single-token decode steps), and each pair of models is compared per row by the
median of max |logit difference| / max |logit| and by argmax agreement.

Argmax agreement counts a row when the candidate's argmax is *an* argmax of the reference:
a bf16 reference rounds its logits to bf16 (as transformers' ``lm_head`` does), and with a
129K vocabulary and flat random-weight logits its top two often round to the same value
(spacing 2^-6 between 2 and 4); ``argmax`` then names the lower token id, which a model with
fp32 logits matches only by chance. The strict first-index figure is reported beside it.
"""

from __future__ import annotations

import torch

from rackserve.model.deepseek_v4 import DeepseekV4ForCausalLM
from rackserve.model.generate import ContiguousCache


def argmax_agreement(logits: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
    """[R] bool: row r's argmax of ``logits`` is one of the maximal entries of
    ``reference`` row r (exact ties at the reference's max all count)."""
    picked = reference.gather(-1, logits.argmax(dim=-1, keepdim=True)).squeeze(-1)
    return picked == reference.amax(dim=-1)


def reference_ties(reference: torch.Tensor) -> torch.Tensor:
    """[R] bool: row r's maximum is reached by more than one entry."""
    return (reference == reference.amax(dim=-1, keepdim=True)).sum(dim=-1) > 1


@torch.inference_mode()
def teacher_forced_agreement(
    models: dict[str, DeepseekV4ForCausalLM],
    pairs: list[tuple[str, str]],
    context: int,
    steps: int,
    num_reqs: int = 8,
) -> dict:
    """Compare ``pairs`` of ``models`` (name -> model, all on one device) over ``steps``
    teacher-forced decode steps after a ``context``-token prefill. Returns, per pair
    ``"a_vs_b"``, the argmax agreement (``argmax_agreement``; the strict first-index figure
    and the share of rows where b ties at its max beside it) and median relative logit error
    (b is the reference of the pair), and, where a model named "fp32" is present, the fp32
    top-1/top-2 margins of the rows where the first pair disagrees."""
    first = next(iter(models.values()))
    device = next(first.parameters()).device
    gen = torch.Generator().manual_seed(context)
    vocab = first.cfg.vocab_size
    tokens = torch.randint(2, vocab, (num_reqs, context + steps), generator=gen).to(device)
    caches = {m: ContiguousCache(model, num_reqs, context + steps) for m, model in models.items()}
    rows = list(range(num_reqs))
    for m, model in models.items():  # prefill each request's context (not compared)
        for r in rows:
            model(tokens[r, :context], caches[m].batch([0], [context], [r]), caches[m].tensors)
    agree: dict[tuple[str, str], list[torch.Tensor]] = {p: [] for p in pairs}
    strict: dict[tuple[str, str], list[torch.Tensor]] = {p: [] for p in pairs}
    ties: dict[tuple[str, str], list[torch.Tensor]] = {p: [] for p in pairs}
    err: dict[tuple[str, str], list[torch.Tensor]] = {p: [] for p in pairs}
    margins = []
    for step in range(steps):
        pos = context + step
        logits = {}
        for m, model in models.items():
            batch = caches[m].batch([pos] * num_reqs, [1] * num_reqs, rows)
            hidden, _ = model(tokens[:, pos], batch, caches[m].tensors)
            logits[m] = model.compute_logits(hidden).float()
        for a, b in pairs:
            scale = logits[b].abs().amax(dim=-1)
            err[(a, b)].append((logits[a] - logits[b]).abs().amax(dim=-1) / scale)
            agree[(a, b)].append(argmax_agreement(logits[a], logits[b]))
            strict[(a, b)].append(logits[a].argmax(-1) == logits[b].argmax(-1))
            ties[(a, b)].append(reference_ties(logits[b]))
        if "fp32" in logits:
            top2 = logits["fp32"].topk(2, dim=-1).values
            margin = (top2[:, 0] - top2[:, 1]) / logits["fp32"].abs().amax(dim=-1)
            margins.append(margin[~agree[pairs[0]][-1]])
    out: dict = {"context": context, "steps": steps, "requests": num_reqs}
    for a, b in pairs:
        out[f"{a}_vs_{b}"] = {
            "argmax_agreement": torch.cat(agree[(a, b)]).float().mean().item(),
            "argmax_agreement_first_index": torch.cat(strict[(a, b)]).float().mean().item(),
            "reference_tie_rows": torch.cat(ties[(a, b)]).float().mean().item(),
            "median_rel_err": torch.cat(err[(a, b)]).median().item(),
        }
    if margins:
        out["fp32_margin_where_first_pair_disagrees"] = torch.cat(margins).tolist()
    return out
