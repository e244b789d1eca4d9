"""masked-rl: exact masked Generalized Advantage Estimation for TorchRL PPO.

The semantics are explained in ``docs/semantics.md``.
"""

from masked_rl.advantages import MaskedGAE
from masked_rl.episodes import CompleteEpisodes
from masked_rl.functional import masked_generalized_advantage_estimate, masked_standardize
from masked_rl.loss import (
    MaskedClipPPOLoss,
    MaskedKLPENPPOLoss,
    MaskedPPOLoss,
    attach_masked_gae,
    select_trainable_steps,
)
from masked_rl.policy import SkipMaskedSteps

__all__ = [
    "CompleteEpisodes",
    "MaskedClipPPOLoss",
    "MaskedGAE",
    "MaskedKLPENPPOLoss",
    "MaskedPPOLoss",
    "SkipMaskedSteps",
    "attach_masked_gae",
    "masked_generalized_advantage_estimate",
    "masked_standardize",
    "select_trainable_steps",
]
__version__ = "0.1.0"
