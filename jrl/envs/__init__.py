"""jrl.envs: environments for multi-turn (agentic) rollouts, tools, built-in tasks."""

from jrl.envs.arith import ArithToolTask
from jrl.envs.base import FINISH_REASONS, Environment, EnvPool, Step, TurnSampling, run_step
from jrl.envs.tools import TOOLS, ToolEnv, ToolError, calculator, parse_call
