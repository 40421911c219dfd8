"""Fields every training config has, with their defaults and units.

Experiment files (`configs/grpo_arith.py`, ...) start from `base()`, change
what they need and return the result locked, so that a misspelt override
(`--config.rl.lr=...`) fails instead of being ignored. Each takes a variant
argument: `--config=configs/grpo_arith.py:smoke` is the same job shrunk to a
run of seconds (`SMOKE`), the one the tests start from.
"""

import ml_collections

# The smoke variant: a tiny model (for fresh models; a checkpoint keeps its
# shape), at most 2 SFT and 3 RL iterations, 16 rows per RL step in two
# minibatches of 8, evaluation and a checkpoint every 2 iterations.
SMOKE = {
  'model.width': 32,
  'model.mlp_width': 64,
  'model.num_layers': 1,
  'model.head_dim': 8,
  'task.eval_size': 8,
  'sft.steps': 2,
  'sft.batch_size': 8,
  'rl.steps': 3,
  'rl.prompts_per_step': 4,
  'rl.group_size': 4,
  'rl.minibatch_size': 8,
  'sampler.num_slots': 16,
  'eval.every': 2,
  'checkpoint.every': 2,
  'log.tensorboard': True,
}
VARIANTS = ('', 'smoke')


def variant(c, arg):
  """`c` (a locked experiment config) as the variant `arg` of get_config
  names: None or '' leaves it; 'smoke' sets `SMOKE`, its iteration counts
  capped (a job with no SFT warm-up keeps none)."""
  if arg in (None, ''):
    return c
  if arg not in VARIANTS:
    raise ValueError(f'unknown config variant {arg!r}: one of {VARIANTS[1:]} (or none).')
  for key, value in SMOKE.items():
    *parents, name = key.split('.')
    node = c
    for p in parents:
      node = node[p]
    node[name] = min(node[name], value) if name == 'steps' else value
  return c


def base():
  c = ml_collections.ConfigDict()
  # 'grpo' (GRPO family, see rl.*) | 'ppo' | 'dpo' | 'sft' | 'reward_model' | 'agent'
  c.algorithm = 'grpo'
  c.seed = 0  # everything random derives from (seed, iteration)
  c.workdir = 'runs/default'  # checkpoints, metrics.jsonl, tb/, curves.png
  c.tokenizer = 'char'  # 'char' (built in) or a directory with tokenizer.json ('' = model.path)
  # write workdir/hf_export (safetensors) at the end; with LoRA also hf_export/adapter (PEFT)
  c.export_hf = False
  c.max_nonfinite_steps = 5  # stop after this many iterations in a row with skipped updates

  c.mesh = ml_collections.ConfigDict()
  c.mesh.data = -1  # data-parallel ways (-1: all devices left over)
  c.mesh.fsdp = 1  # parameter-sharded data-parallel ways
  c.mesh.tensor = 1  # tensor-parallel ways

  # Where the sampler runs relative to the trainer (see jrl/trainers/topology.py):
  c.topology = ml_collections.ConfigDict()
  c.topology.kind = 'colocated'  # 'colocated' | 'disaggregated' | 'one_step_off'
  c.topology.rollout_devices = 0  # disaggregated / one_step_off: the last N devices sample
  c.topology.staleness = 1  # one_step_off: policy versions between generation and update (0|1)
  c.topology.is_cap = 2.0  # one_step_off: truncation of the proximal/behaviour weight

  c.model = ml_collections.ConfigDict()
  c.model.path = ''  # Hugging Face checkpoint directory; '' builds a fresh model:
  c.model.width = 128  # D
  c.model.mlp_width = 384  # F
  c.model.num_layers = 2  # L
  c.model.num_heads = 4  # H
  c.model.num_kv_heads = 2  # K
  c.model.head_dim = 32  # d
  c.model.tie_embeddings = True
  c.model.init_std = 0.02
  c.model.param_dtype = 'float32'  # master weights
  c.model.compute_dtype = 'float32'  # 'bfloat16' for bf16 matmuls
  # Training memory (model.path checkpoints too; never written to an export's config.json).
  # Per-layer activation checkpointing, what the backward pass keeps of a block:
  #   'none'           everything (no recomputation)
  #   'full'           only the block's input; the whole block is recomputed
  #   'dots'           every matmul output but the float32 attention scores
  #   'dots_no_batch'  the projection outputs, not the [B, H, T, T] scores and probabilities
  c.model.remat = 'none'
  c.model.scan_layers = False  # run the layers in one jax.lax.scan (needs every layer alike)
  # Attention kernel of the training passes: 'auto' (XLA on CPU, cuDNN flash attention on
  # GPU in bf16/fp16, Pallas splash attention on TPU), or one of 'xla', 'cudnn', 'splash'.
  c.model.attention = 'auto'
  # LoRA (Hu et al., 2021): train low-rank adapters on the projections, the base frozen
  # (no update, no optimiser state). `export_hf` writes the merged weights and, in
  # hf_export/adapter/, the adapters in PEFT's layout (for the base at `model.path`).
  c.model.lora = ml_collections.ConfigDict()
  c.model.lora.rank = 0  # r (0: off, every parameter trains)
  c.model.lora.alpha = 16.0  # the adapters' output is scaled by alpha / rank (PEFT's lora_alpha)
  # Hugging Face module names, from q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj
  c.model.lora.targets = ('q_proj', 'k_proj', 'v_proj', 'o_proj')

  c.task = ml_collections.ConfigDict()
  # 'arith' (generated), 'arith_tool' (agentic, generated) or 'file' (alias 'jsonl'):
  # prompt files, JSONL or Parquet (by the '.parquet' extension); or an import path
  # 'package.module:function' of fn(task config) -> (train rows, held-out rows)
  # (docs/your_own_dataset.md)
  c.task.kind = 'arith'
  c.task.digits = 2  # arith: operand digits
  c.task.ops = '+'  # arith: operators, from '+-*'
  c.task.train_seed = 0  # arith: seed of the training problems
  c.task.eval_seed = 1  # arith: seed of the held-out problems
  c.task.eval_size = 200  # held-out examples
  c.task.train_path = ''  # file: training rows, .jsonl or .parquet
  c.task.eval_path = ''  # file: held-out rows
  c.task.prompt_key = 'prompt'  # file: the prompt field (GSM8K: 'question'), text or messages
  c.task.answer_key = 'answer'  # file: the answer field
  c.task.answer_extractor = 'none'  # file: 'none' | 'gsm8k' (the text after the last '####')
  # file: prompts over `rl.max_prompt_len` are 'error' (refused, naming the row) or
  # 'filter' (dropped at load time and counted; `Task.filtered`)
  c.task.long_prompts = 'error'
  c.task.chat_template = False  # wrap prompts in the tokenizer's chat template
  c.task.system_prompt = ''  # chat template: system message opening each prompt ('' = none)
  # chat template: extra variables of its render (e.g. enable_thinking); set keys in
  # the experiment file, then `--config.task.chat_template_kwargs.KEY=...` overrides them
  c.task.chat_template_kwargs = ml_collections.ConfigDict()
  c.task.add_bos = False  # prepend the tokenizer's bos token

  c.reward = ml_collections.ConfigDict()
  c.reward.functions = ('exact_match',)  # names in jrl.rewards.REGISTRY
  c.reward.weights = ()  # one per function; () = all 1.0
  c.reward.unscored_value = 0.0  # reward for "could not score" (and for failures, timeouts)
  c.reward.mode = 'process'  # 'process' (CPU-bound) | 'thread' (I/O-bound) | 'inline'
  c.reward.workers = 2  # worker processes or threads
  c.reward.timeout_s = 30.0  # per chunk of completions; late chunks count as timeouts
  # Stop the run (non-zero exit, checkpoints kept) once one reward function has
  # left more than this fraction of completions unscored (failures, timeouts,
  # no answer) for `max_unscored_steps` RL iterations in a row; 1.0: never.
  c.reward.max_unscored_frac = 0.9
  c.reward.max_unscored_steps = 3
  c.reward.sandbox_unsafe = False  # code_tests: run programs even without namespaces (UNSAFE)
  c.reward.url = ''  # score on a `python -m jrl.rewards.server` instead (functions set there)
  c.reward.model_path = ''  # HF reward model (scalar head); name it 'reward_model' in functions
  c.reward.judge_path = ''  # HF policy-format judge model; name it 'judge' in functions
  c.reward.judge_rubric = 'Score how correct and helpful the response is.'  # the judge's rubric
  c.reward.judge_max_new_tokens = 256  # judge output tokens
  c.reward.judge_max_prompt_len = 2048  # judge input tokens
  c.reward.clip = 0.0  # clip rewards to [-clip, clip] (after normalising); 0: off
  c.reward.normalize = False  # (r - running mean) / running std, statistics kept in checkpoints

  c.sft = ml_collections.ConfigDict()
  c.sft.steps = 0  # supervised warm-up iterations before RL
  c.sft.batch_size = 64  # sequences per SFT step
  c.sft.lr = 1e-3  # SFT learning rate (the other optimiser settings come from `optim`)
  c.sft.warmup_steps = 10  # SFT linear warm-up
  c.sft.train_path = ''  # JSONL {"prompt", "response"}; '' = the task's (prompt, answer)

  c.rl = ml_collections.ConfigDict()
  c.rl.steps = 100  # RL iterations
  c.rl.prompts_per_step = 16  # B
  c.rl.group_size = 8  # G samples per prompt
  c.rl.max_prompt_len = 32  # tokens; longer prompts are an error
  c.rl.max_new_tokens = 8  # tokens per completion
  c.rl.temperature = 1.0  # sampling temperature (also used for the trainer's logprobs)
  c.rl.top_k = 0  # 0: off
  c.rl.top_p = 1.0  # 1: off
  c.rl.epochs = 1  # passes over each rollout batch
  c.rl.minibatch_size = 128  # rows per optimiser step; divides B x G
  # Sequence packing of the update (jrl.data.packing): each minibatch's sequences
  # end to end in rows of pack_row_len tokens (0: max_prompt_len + max_new_tokens);
  # same losses and gradients as the padded rows, fewer tokens through the model.
  c.rl.packing = False
  c.rl.pack_row_len = 0
  # With packing: split each minibatch's packed rows into micro-batches of at most
  # this many tokens per batch shard (gradients summed, one optimiser step; the
  # same result as the whole minibatch at once). 0: the minibatch in one pass.
  c.rl.micro_batch_tokens = 0
  c.rl.advantage = 'grpo'  # grpo | dr_grpo | rloo | loo | reinforce_pp | reinforce_pp_baseline
  c.rl.adv_scale = 'group'  # grpo: 'group' | 'batch' | 'none'
  c.rl.adv_std = 'unbiased'  # grpo: 'unbiased' | 'biased'
  c.rl.adv_eps = 1e-6  # added to the std
  c.rl.gamma = 1.0  # REINFORCE++ discount
  c.rl.policy_loss = 'ppo'  # 'ppo' (clip) | 'gspo' | 'cispo' | 'sapo' | 'vespo' (TRL's defaults)
  c.rl.eps_low = 0.2  # clip range below 1
  c.rl.eps_high = 0.2  # clip range above 1 (DAPO clip-higher: 0.28)
  c.rl.dual_clip_c = 0.0  # dual-clip bound for A < 0 (0: off)
  c.rl.log_ratio_clamp = 0.0  # clamp log-ratios before exp (0: off)
  c.rl.loss_agg = 'token-mean'  # see jrl.losses.AGGREGATION_MODES
  c.rl.loss_norm = 0.0  # seq-mean-token-sum-norm constant (0: padded length)
  c.rl.kl_coef = 0.0  # β; 0 skips the reference model
  c.rl.kl_in = 'loss'  # 'loss' (GRPO) or 'reward' (REINFORCE++, PPO)
  c.rl.kl_estimator = 'k3'  # k1 | k2 | k3 | abs | k3_ratio_corrected (kl_in='loss' only)
  c.rl.sapo_tau_pos = 1.0  # sapo: gate temperature for A > 0 (TRL's default)
  c.rl.sapo_tau_neg = 1.05  # sapo: gate temperature for A <= 0
  c.rl.vespo_k_pos = 2.0  # vespo: kernel exponent k for A >= 0 (TRL's default)
  c.rl.vespo_lambda_pos = 3.0  # vespo: kernel decay λ for A >= 0
  c.rl.vespo_k_neg = 3.0  # vespo: kernel exponent k for A < 0
  c.rl.vespo_lambda_neg = 2.0  # vespo: kernel decay λ for A < 0
  # Drop whole sequences with A < 0 whose mean log(π_old/π) exceeds this
  # (DeepSeek-V3.2's off-policy sequence mask, TRL's off_policy_mask_threshold); 0: off
  c.rl.off_policy_mask_threshold = 0.0
  # MoE models: the router's load-balancing loss (Switch Transformer; Hugging Face's
  # router_aux_loss_coef, 0.001 for Qwen3-MoE) added to the policy loss. 0: off.
  c.rl.router_aux_coef = 0.0
  c.rl.kl_input_clamp = 0.0  # 0: off
  c.rl.kl_output_clamp = 0.0  # 0: off
  c.rl.entropy_coef = 0.0  # entropy bonus weight
  c.rl.overlong_buffer = 0  # DAPO: tokens before max_new_tokens where a length penalty starts
  c.rl.overlong_penalty = 1.0  # DAPO: penalty at max_new_tokens
  c.rl.dynamic_sampling = False  # DAPO: drop zero-variance groups and draw more prompts
  c.rl.dynamic_sampling_max_draws = 3  # extra prompt draws per step
  c.rl.chunk_size = 1024  # tokens (rows of B·T) per chunk of the float32 logprobs over V

  c.optim = ml_collections.ConfigDict()
  c.optim.lr = 1e-4  # peak learning rate
  c.optim.warmup_steps = 0  # optimiser updates
  c.optim.decay_steps = 0  # cosine decay after warm-up (0: constant)
  c.optim.end_lr_ratio = 0.1  # final lr / peak lr
  c.optim.weight_decay = 0.0
  c.optim.b1 = 0.9
  c.optim.b2 = 0.999
  c.optim.eps = 1e-8
  c.optim.clip_norm = 1.0  # global gradient norm clip (0: off)
  c.optim.grad_accum = 1  # train steps per optimiser update

  c.sampler = ml_collections.ConfigDict()
  c.sampler.num_slots = 64  # sequences decoded together
  c.sampler.page_size = 8  # tokens per KV page
  c.sampler.num_pages = 0  # 0: enough for every slot's worst case
  c.sampler.steps_per_dispatch = 8  # decode steps per jitted call
  c.sampler.attention_impl = 'auto'  # 'auto' | 'gather' | 'pallas'

  c.eval = ml_collections.ConfigDict()
  c.eval.every = 10  # iterations between held-out evaluations (0: never)
  c.eval.at_start = True  # also evaluate before the first iteration (a fresh run)
  c.eval.reward = 'exact_match'  # accuracy = share of held-out examples scoring > 0.5
  c.eval.samples = 0  # n sampled completions per held-out example: mean@n, pass@k (0: greedy only)
  c.eval.temperature = 1.0  # temperature of those samples
  c.eval.group_key = ''  # a held-out row field (e.g. 'difficulty'): accuracy per value of it

  c.checkpoint = ml_collections.ConfigDict()
  c.checkpoint.every = 20  # iterations between checkpoints
  c.checkpoint.keep = 3  # checkpoints kept
  c.checkpoint.async_save = True

  c.log = ml_collections.ConfigDict()
  c.log.every = 1  # iterations between console lines
  c.log.tensorboard = True
  c.log.plot = True  # workdir/curves.png at the end
  c.log.samples_every = 10  # RL iterations between sample completions logged (0: never)
  c.log.wandb_project = ''  # Weights & Biases project ('' = off; pip install -e ".[wandb]")
  c.log.wandb_mode = 'offline'  # 'offline' (workdir/wandb, no network) | 'online'
  c.log.wandb_entity = ''  # W&B team or user ('' = the default)
  c.log.wandb_name = ''  # W&B run name ('' = the workdir's name)
  c.log.trace = True  # workdir/trace.json: per-stage spans (Perfetto / chrome://tracing)
  # iterations (1-based, as metrics' step) captured with jax.profiler into workdir/profile/
  # (TensorBoard's profiler, Perfetto); jrl's stages appear there as 'jrl/<stage>' annotations
  c.log.profile_steps = ()
  return c


def ppo_section():
  """The `ppo` fields of PPO configs."""
  p = ml_collections.ConfigDict()
  p.gamma = 1.0  # GAE discount
  p.lam = 0.95  # GAE λ
  p.value_clip = 0.5  # clipped value loss range (0: off)
  p.critic_lr = 1e-4  # critic learning rate (other optimiser settings from `optim`)
  p.critic_path = ''  # initialise the critic from this HF checkpoint (e.g. a reward model)
  p.adaptive_kl = True  # Ziegler et al. controller on rl.kl_coef (KL in the reward only)
  p.kl_target = 0.05  # adaptive KL target (per token, nats)
  p.kl_horizon = 10000  # adaptive KL horizon (samples)
  return p


def agent_section():
  """The `agent` fields of multi-turn (tool-use) configs."""
  a = ml_collections.ConfigDict()
  # a name in jrl.trainers.episodes.ENVIRONMENTS, or an import path 'package.module:factory'
  # of factory(tokenizer) -> jrl.envs.Environment (docs/your_own_environment.md)
  a.env = 'arith_tool'
  a.trainer = 'grpo'  # 'grpo' (rl.advantage) or 'ppo' (critic + GAE; add a `ppo` section)
  a.max_turns = 4  # tool calls per trajectory before it is ended
  a.step_timeout_s = 10.0  # per environment step; a late step ends its trajectory
  a.max_env_tokens = 16  # longest environment answer (tokens)
  a.sft_tool_frac = 0.5  # share of SFT demonstrations that use the tool
  return a


def rm_section():
  """The `rm` fields of reward-model training configs."""
  r = ml_collections.ConfigDict()
  r.pairs_per_step = 32  # preference pairs per step
  r.margin = 0.0  # Bradley-Terry margin (a row's "margin" field overrides it)
  r.center_coef = 0.01  # weight of (r_chosen + r_rejected)^2, keeps rewards near 0
  r.train_path = ''  # JSONL {"prompt", "chosen", "rejected"}; '' = pairs from the arith task
  r.eval_path = ''  # held-out JSONL pairs ('' with arith: pairs from the held-out problems)
  return r


def dpo_section():
  """The `dpo` fields of DPO configs."""
  d = ml_collections.ConfigDict()
  d.loss = 'dpo'  # 'dpo' | 'ipo' | 'hinge' | 'simpo' | 'orpo'
  d.beta = 0.1  # β (ORPO: λ)
  d.label_smoothing = 0.0  # conservative DPO ε
  d.simpo_gamma = 0.5  # SimPO target margin
  d.pairs_per_step = 32  # preference pairs per step
  d.train_path = ''  # JSONL {"prompt", "chosen", "rejected"}; '' = pairs from the arith task
  return d
