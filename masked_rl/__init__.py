"""masked-rl: exact masked Generalized Advantage Estimation for TorchRL PPO."""

from masked_rl.advantages import MaskedGAE
from masked_rl.functional import masked_generalized_advantage_estimate, masked_standardize
from masked_rl.loss import MaskedClipPPOLoss, attach_masked_gae

__all__ = [
    "MaskedClipPPOLoss",
    "MaskedGAE",
    "attach_masked_gae",
    "masked_generalized_advantage_estimate",
    "masked_standardize",
]
__version__ = "0.1.0"
