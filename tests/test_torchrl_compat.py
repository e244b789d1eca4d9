"""The private TorchRL names masked_rl relies on.

``MaskedGAE`` subclasses TorchRL's ``GAE`` and the masked losses subclass its PPO losses; a few
of their private hooks are used rather than copied. This test fails first when a TorchRL
release renames one (the upper bound on torchrl in ``pyproject.toml``, which pip enforces,
keeps users off untested releases until it passes).
"""

from __future__ import annotations

import torch
import torchrl
from torchrl.modules import ProbabilisticActor, ValueOperator
from tensordict.nn import TensorDictModule
from torchrl.objectives import ClipPPOLoss, PPOLoss
from torchrl.objectives.value import GAE, advantages

MODULE_FUNCTIONS = ["_self_set_grad_enabled", "_self_set_skip_existing", "_standardize_by_group"]
GAE_METHODS = ["_call_value_nets", "_prepare_shifted_tensordict", "_prepare_signals",
               "_broadcast_optional", "_expand_to_match", "_group_ids", "_get_time_dim", "_AcceptedKeys"]
LOSS_CLASS_ATTRIBUTES = ["_AcceptedKeys", "_forward_value_estimator_keys", "_set_in_keys", "_reduce_loss",
                         "_loss_mask_keys", "_standardize_advantage"]
LOSS_INSTANCE_ATTRIBUTES = ["_in_keys", "_tensor_keys", "_value_estimator", "_has_critic",
                            "_cached_critic_network_params_detached"]


def test_private_torchrl_names_exist():
    actor = ProbabilisticActor(TensorDictModule(torch.nn.Linear(3, 4), ["observation"], ["logits"]),
                               in_keys=["logits"], distribution_class=torch.distributions.Categorical)
    loss = ClipPPOLoss(actor, ValueOperator(torch.nn.Linear(3, 1), in_keys=["observation"]))
    missing = [f"advantages.{n}" for n in MODULE_FUNCTIONS if not hasattr(advantages, n)]
    missing += [f"GAE.{n}" for n in GAE_METHODS if not hasattr(GAE, n)]
    missing += [f"PPOLoss.{n}" for n in LOSS_CLASS_ATTRIBUTES if not hasattr(PPOLoss, n)]
    missing += [f"ClipPPOLoss().{n}" for n in LOSS_INSTANCE_ATTRIBUTES if not hasattr(loss, n)]
    assert not missing, f"TorchRL {torchrl.__version__} lacks {missing}: update masked_rl and the bound"
