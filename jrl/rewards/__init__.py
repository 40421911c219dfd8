"""jrl.rewards: reward functions, the registry, and the service that runs them."""

from jrl.rewards import code, reasoning_gym  # reasoning_gym imports the package only to score
from jrl.rewards.base import REGISTRY, ScoredBatch, get_reward_fn, register, uses_sandbox
from jrl.rewards.format import (
  boxed_format,
  format_think_answer,
  make_regex_reward,
  overlong_penalty,
)
from jrl.rewards.math import exact_match, extract_answer, is_equivalent, math_answer, normalize
from jrl.rewards.service import RewardService
