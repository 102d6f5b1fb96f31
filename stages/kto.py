"""kto: Kahneman-Tversky Optimization on single answers tagged desirable or undesirable.

The loss follows TRL 1.16's ``KTOTrainer`` (paper eq. 7, https://huggingface.co/papers/2402.01306):

    z0        = clamp(mean(log pi(y'|x) - log ref(y'|x)), min=0), detached   (y' = a mismatched answer)
    desirable   : w_d * (1 - sigmoid(beta * (log pi(y|x) - log ref(y|x) - z0)))
    undesirable : w_u * (1 - sigmoid(beta * (z0 - (log pi(y|x) - log ref(y|x)))))

TRL's trainer itself wants raw prompt/completion text and tokenizes it; our rows arrive already
tokenized by the registries through Ray Data (with the mismatched KL example built there), so the
loss lives in a thin ``transformers.Trainer`` subclass instead.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn.functional as F


@dataclass
class KTOLossOutput:
    loss: torch.Tensor  # scalar: mean over the batch's rows of the weighted per-row losses
    chosen_rewards: torch.Tensor  # beta * log-ratio of each desirable row (detached)
    rejected_rewards: torch.Tensor  # beta * log-ratio of each undesirable row (detached)
    kl: torch.Tensor  # the clamped, detached KL estimate z0 (a 0-d tensor)


def kto_loss(
    policy_logps: torch.Tensor,
    reference_logps: torch.Tensor,
    policy_kl_logps: torch.Tensor,
    reference_kl_logps: torch.Tensor,
    tags: torch.Tensor,
    beta: float,
    desirable_weight: float = 1.0,
    undesirable_weight: float = 1.0,
    reduce_kl: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
) -> KTOLossOutput:
    """The KTO loss of one batch from summed log-probs of each row's labelled tokens.

    ``tags`` is True for desirable rows. ``reduce_kl`` averages the KL estimate over workers (TRL
    gathers it across ranks) before it is clamped, so every rank uses the same reference point.
    """
    tags = tags.to(device=policy_logps.device, dtype=torch.bool)
    # The KL term is a baseline, not something to optimise: no gradient flows through it.
    kl = (policy_kl_logps - reference_kl_logps).mean().detach()
    if reduce_kl is not None:
        kl = reduce_kl(kl)
    kl = kl.clamp(min=0)

    logratios = policy_logps - reference_logps
    chosen_ratios, rejected_ratios = logratios[tags], logratios[~tags]
    chosen_losses = 1 - torch.sigmoid(beta * (chosen_ratios - kl))
    rejected_losses = 1 - torch.sigmoid(beta * (kl - rejected_ratios))
    losses = torch.cat((desirable_weight * chosen_losses, undesirable_weight * rejected_losses))
    return KTOLossOutput(
        loss=losses.mean(),
        chosen_rewards=beta * chosen_ratios.detach(),
        rejected_rewards=beta * rejected_ratios.detach(),
        kl=kl,
    )
