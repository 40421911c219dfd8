"""The sections training configs are composed of, with their defaults and units.

Every config has the run's own fields (algorithm, seed, workdir, ...) and the
sections every algorithm reads: `mesh`, `model`, `task` (the examples and
their lengths), `train` (how a batch goes through the model), `optim`,
`eval`, `checkpoint` and `log`. Each algorithm adds only the sections it
reads (`sections(algorithm)`: the names of the sections its record in
`jrl.trainers` checks): the online ones (grpo, ppo, agent) the rollout sections
`rl`, `sampling`, `sampler`, `reward` and `topology` and an `sft` warm-up; dpo and sft a
`sampler` for held-out generation; the reward model none. Each section is
checked by the code that reads it (see `jrl.trainers.checks`).

Experiment files (`configs/grpo_arith.py`, ...) start from `base(algorithm)`,
or from another experiment with `derive(config, algorithm)`, change what they
need and return the result locked, so that a misspelt override
(`--config.optim.lrr=...`) fails instead of being ignored. Each takes a
variant argument: `--config=configs/grpo_arith.py:smoke` is the same job
shrunk to a run of seconds (`SMOKE`), the one the tests start from.
"""

import ml_collections
from ml_collections.config_dict import FieldReference

from jrl import losses as L

# The smoke variant: a tiny model (for fresh models; a checkpoint keeps its
# shape), at most 2 SFT and 3 RL / DPO / reward-model iterations, 16 rows per
# RL step in two minibatches of 8, evaluation and a checkpoint every 2
# iterations. Sections a config lacks are skipped.
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
  'dpo.steps': 3,
  'rm.steps': 3,
  'sampler.num_slots': 16,
  'eval.every': 2,
  'checkpoint.every': 2,
  'log.tensorboard': True,
}
VARIANTS = ('', 'smoke')


def variant(c, arg):
  """`c` (a locked experiment config) as the variant `arg` of get_config
  names: None or '' leaves it; 'smoke' sets `SMOKE` where `c` has the field,
  its iteration counts capped (a job with no SFT warm-up keeps none)."""
  if arg in (None, ''):
    return c
  if arg not in VARIANTS:
    raise ValueError(f'unknown config variant {arg!r}: one of {VARIANTS[1:]} (or none).')
  for key, value in SMOKE.items():
    *parents, name = key.split('.')
    node = c
    for p in parents:
      node = node[p] if p in node else None
      if node is None:
        break
    if node is not None:
      node[name] = min(node[name], value) if name == 'steps' else value
  return c


def mesh_section():
  """The device mesh: every algorithm."""
  s = ml_collections.ConfigDict()
  s.data = -1  # data-parallel ways (-1: all devices left over)
  s.fsdp = 1  # parameter-sharded data-parallel ways
  s.tensor = 1  # tensor-parallel ways
  return s


def model_section():
  """The policy (or the reward model's backbone): every algorithm."""
  s = ml_collections.ConfigDict()
  s.path = ''  # Hugging Face checkpoint directory; '' builds a fresh model:
  s.width = 128  # D
  s.mlp_width = 384  # F
  s.num_layers = 2  # L
  s.num_heads = 4  # H
  s.num_kv_heads = 2  # K
  s.head_dim = 32  # d
  s.tie_embeddings = True
  s.init_std = 0.02
  s.param_dtype = 'float32'  # master weights
  s.compute_dtype = 'float32'  # 'bfloat16' for bf16 matmuls
  # Training memory (model.path checkpoints too; never written to an export's config.json).
  # Per-layer activation checkpointing, what the backward pass keeps of a block:
  #   'auto'           chosen with the micro-batches by train.memory_plan (else 'none';
  #                    on the CPU the plan recomputes unless the update is small)
  #   'none'           everything (no recomputation)
  #   'full'           only the block's input; the whole block is recomputed
  #   'dots'           every matmul output but the float32 attention scores
  #   'dots_no_batch'  the projection outputs, not the [B, H, T, T] scores and probabilities
  s.remat = 'auto'
  s.scan_layers = False  # run the layers in one jax.lax.scan (needs every layer alike)
  # Attention kernel of the training passes: 'auto' (XLA on CPU, cuDNN flash attention on
  # GPU in bf16/fp16, Pallas splash attention on TPU), or one of 'xla', 'cudnn', 'splash',
  # 'lse' (XLA's numbers; its backward keeps O(T) per row, not each layer's [H, T, T]
  # probabilities: what lets remat 'none' fit, jrl/models/lse_attention.py).
  s.attention = 'auto'
  # LoRA (Hu et al., 2021): train low-rank adapters on the projections, the base frozen
  # (no update, no optimiser state). `export_hf` writes the merged weights and, in
  # hf_export/adapter/, the adapters in PEFT's layout (for the base at `model.path`).
  s.lora = ml_collections.ConfigDict()
  s.lora.rank = 0  # r (0: off, every parameter trains)
  s.lora.alpha = 16.0  # the adapters' output is scaled by alpha / rank (PEFT's lora_alpha)
  # Hugging Face module names, from q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj
  s.lora.targets = ('q_proj', 'k_proj', 'v_proj', 'o_proj')
  return s


def task_section():
  """The examples and their lengths: every algorithm."""
  s = ml_collections.ConfigDict()
  # 'arith' (generated), 'arith_tool' (agentic, generated), 'reasoning_gym' (reasoning-gym's
  # task sets, `reasoning_gym` below) or 'file' (alias 'jsonl'):
  # prompt files, JSONL or Parquet (by the '.parquet' extension); or an import path
  # 'package.module:function' of fn(task config) -> (train rows, held-out rows)
  # (docs/your_own_dataset.md)
  s.kind = 'arith'
  s.digits = 2  # arith: operand digits
  s.ops = '+'  # arith: operators, from '+-*'
  # arith: the worked answers SFT imitates drop an addition's units carry with this
  # probability (an imperfect teacher; rewards and evaluation check the true answer)
  s.carry_slip = 0.0
  # arith: a sum with a new digit (47+85=132) is only estimated, rounded down to tens
  # (130), with this probability (an imperfect teacher)
  s.rounding_slip = 0.0
  # arith: answers written units digit first (47+85=231), the order in which addition
  # computes them
  s.reverse_answers = False
  s.train_seed = 0  # arith, reasoning_gym: seed of the training problems
  s.eval_seed = 1  # arith, reasoning_gym: seed of the held-out problems
  s.eval_size = 200  # held-out examples
  s.train_path = ''  # file: training rows, .jsonl or .parquet
  s.eval_path = ''  # file: held-out rows
  s.prompt_key = 'prompt'  # file: the prompt field (GSM8K: 'question'), text or messages
  s.answer_key = 'answer'  # file: the answer field
  s.answer_extractor = 'none'  # file: 'none' | 'gsm8k' (the text after the last '####')
  s.max_prompt_len = 32  # tokens; longer prompts are an error (or filtered, below)
  # tokens of a response: a sampled completion's limit (rollouts and held-out
  # generation), and what SFT / DPO / reward-model responses must fit in (with an eos)
  s.max_response_len = 8
  # file: prompts over `max_prompt_len` are 'error' (refused, naming the row) or
  # 'filter' (dropped at load time and counted; `Task.filtered`)
  s.long_prompts = 'error'
  s.chat_template = False  # wrap prompts in the tokenizer's chat template
  s.system_prompt = ''  # chat template: system message opening each prompt ('' = none)
  # chat template: extra variables of its render (e.g. enable_thinking); set keys in
  # the experiment file, then `--config.task.chat_template_kwargs.KEY=...` overrides them
  s.chat_template_kwargs = ml_collections.ConfigDict()
  s.add_bos = False  # prepend the tokenizer's bos token
  s.reasoning_gym = reasoning_gym_section()
  return s


def reasoning_gym_section():
  """`task.reasoning_gym`: reasoning-gym's task sets (jrl/data/reasoning_gym.py)."""
  s = ml_collections.ConfigDict()
  # a dataset ('chain_sum') or a weighted mixture ('basic_arithmetic:1,chain_sum:0.5')
  s.datasets = 'basic_arithmetic'
  # settings.<dataset>.<field>: the dataset's own config fields (set the keys in the
  # experiment file, then `--config.task.reasoning_gym.settings.chain_sum.max_terms=4`)
  s.settings = ml_collections.ConfigDict()
  s.size = 10_000  # entries per dataset that training draws from (and held-out's seed stride)
  # how the reward reads the answer: 'answer_tag' (the last <answer>...</answer>,
  # reasoning-gym's convention) | 'last_line' | 'last_number' (numeric answers) | 'whole'
  s.answer = 'answer_tag'
  s.threshold = optional()  # None: the dataset's score, partial credit kept; t: 1 if >= t else 0
  # allow datasets whose scorer runs the answer through eval / sympy (code from the policy)
  s.unsafe_scorers = False
  s.curriculum = ml_collections.ConfigDict()
  # a dataset whose mean score over its last `window` completions reaches this rises a
  # level of reasoning-gym's curriculum (None: no curriculum, the settings as given)
  s.curriculum.raise_at = optional()
  s.curriculum.lower_at = optional()  # ... falls a level at or below this (None: never)
  s.curriculum.window = 64  # completions
  s.curriculum.start_level = 0  # every dataset's first level (held-out problems use it)
  return s


def train_section():
  """How a batch goes through the model in training: every algorithm."""
  s = ml_collections.ConfigDict()
  s.chunk_size = 1024  # tokens (rows of B·T) per chunk of the float32 logprobs over V
  # Sequence packing (jrl.data.packing): each batch's sequences end to end in rows
  # of pack_row_len tokens (0: task.max_prompt_len + task.max_response_len); same
  # losses and gradients as the padded rows, fewer tokens through the model.
  s.packing = False
  s.pack_row_len = 0
  # Shared prompts (jrl.data.layouts.shared_prompt): the sequences that share a
  # prompt (a GRPO group, a DPO pair) in one row, the prompt computed once and
  # each completion attending to it; same losses and gradients. Not with packing.
  s.shared_prompt = False
  # Split each (mini)batch's rows (padded, packed or shared-prompt) into
  # micro-batches of at most this many tokens per batch shard (gradients summed,
  # one optimiser step; the same result as the whole batch at once). 0: the
  # batch in one pass.
  s.micro_batch_tokens = 0
  # 'auto': the online algorithms' update takes the fastest model.remat and
  # micro_batch_tokens whose compiled program fits in memory (the fields left
  # at 'auto' / 0 only; jrl.trainers.memory_plan), logged; 'off': as set.
  s.memory_plan = 'auto'
  s.memory_limit_gib = 0.0  # what the update may allocate (0: 90% of a device's free memory)
  # XLA options of the training programs only (the updates, the reference and
  # proximal passes), written as XLA_FLAGS are ('--xla_<name>=<value> ...'); the
  # process's XLA_FLAGS apply to the rest, the sampler included (jrl.xla_options).
  s.xla_flags = ''
  return s


def optim_section():
  """The optimiser: every algorithm."""
  s = ml_collections.ConfigDict()
  s.lr = 1e-4  # peak learning rate
  s.warmup_steps = 0  # optimiser updates
  s.decay_steps = 0  # cosine decay after warm-up (0: constant)
  s.end_lr_ratio = 0.1  # final lr / peak lr
  s.weight_decay = 0.0
  s.b1 = 0.9
  s.b2 = 0.999
  s.eps = 1e-8
  s.clip_norm = 1.0  # global gradient norm clip (0: off)
  s.grad_accum = 1  # train steps per optimiser update
  return s


def eval_section():
  """Held-out evaluation every `every` iterations: every algorithm."""
  s = ml_collections.ConfigDict()
  s.every = 10  # iterations between held-out evaluations (0: never)
  s.at_start = True  # also evaluate before the first iteration (a fresh run)
  s.reward = 'exact_match'  # accuracy = share of held-out examples scoring > 0.5
  s.samples = 0  # n sampled completions per held-out example: mean@n, pass@k (0: greedy only)
  s.temperature = 1.0  # temperature of those samples
  s.group_key = ''  # a held-out row field (e.g. 'difficulty'): accuracy per value of it
  return s


def checkpoint_section():
  """Orbax checkpoints: every algorithm."""
  s = ml_collections.ConfigDict()
  s.every = 20  # iterations between checkpoints
  s.keep = 3  # checkpoints kept
  s.async_save = True
  # Restore steps that have no checksum manifest (saved before checksums, or the run
  # was killed before writing it) unverified; off: they are refused and a restart
  # resumes from the newest verified step (jrl/checkpoint.py)
  s.allow_unverified = False
  return s


def log_section():
  """Metrics, samples, traces and profiles: every algorithm."""
  s = ml_collections.ConfigDict()
  s.every = 1  # iterations between console lines
  s.tensorboard = True
  s.plot = True  # workdir/curves.png at the end
  s.samples_every = 10  # RL iterations between sample completions logged (0: never)
  s.wandb_project = ''  # Weights & Biases project ('' = off; pip install -e ".[wandb]")
  s.wandb_mode = 'offline'  # 'offline' (workdir/wandb, no network) | 'online'
  s.wandb_entity = ''  # W&B team or user ('' = the default)
  s.wandb_name = ''  # W&B run name ('' = the workdir's name)
  s.trace = True  # workdir/trace.json: per-stage spans (Perfetto / chrome://tracing)
  # iterations (1-based, as metrics' step) captured with jax.profiler into workdir/profile/
  # (TensorBoard's profiler, Perfetto); jrl's stages appear there as 'jrl/<stage>' annotations
  s.profile_steps = ()
  return s


def sft_section():
  """Supervised fine-tuning: the whole run of `sft`, the warm-up of the others."""
  s = ml_collections.ConfigDict()
  s.steps = 0  # SFT iterations (a warm-up before the algorithm's own)
  s.batch_size = 64  # sequences per SFT step
  s.lr = 1e-3  # SFT learning rate (the other optimiser settings come from `optim`)
  s.warmup_steps = 10  # SFT linear warm-up
  s.train_path = ''  # JSONL {"prompt", "response"}; '' = the task's (prompt, answer)
  # Demonstrations: only the first N examples of that source, repeated in a new
  # order each epoch (0: all of them; a generated task's are endless)
  s.examples = 0
  return s


def rl_section():
  """The online algorithms' iterations: the rollout batch and the policy loss."""
  s = ml_collections.ConfigDict()
  s.steps = 100  # RL iterations
  s.prompts_per_step = 16  # B
  s.group_size = 8  # G samples per prompt
  s.epochs = 1  # passes over each rollout batch
  s.minibatch_size = 128  # rows per optimiser step; divides B x G
  # 'row': minibatches of rows drawn at random; 'group': of whole groups (each
  # group's G completions in one minibatch); 'auto': 'group' with
  # train.shared_prompt (its prompt computed once) when minibatch_size is a
  # multiple of group_size, else 'row'
  s.minibatch_by = 'auto'
  s.advantage = 'grpo'  # grpo | dr_grpo | rloo | loo | reinforce_pp | reinforce_pp_baseline
  # rl.adv.<estimator>.<argument>: the estimators' keyword arguments under their own
  # names, seeded with their defaults (`jrl.losses.default_args`), e.g. rl.adv.grpo.scale
  # ('group' | 'batch' | 'none'), rl.adv.grpo.eps, rl.adv.reinforce_pp.gamma.
  s.adv = objective_section(L.ADVANTAGE_ESTIMATORS, L.ADVANTAGE_ARGS)
  # 'ppo' (clip) | 'gspo' | 'gmpo' | 'cispo' | 'sapo' | 'vespo' (clipped or gated);
  # 'icepop' | 'dppo' | 'kpop' (importance sampling on the tokens a band keeps);
  # 'importance_sampling' (unclipped, unmasked: see allow_unbounded_async)
  s.policy_loss = 'ppo'
  # rl.loss.<policy loss>.<argument>: the same for the policy losses, e.g.
  # rl.loss.ppo.eps_high (DAPO's clip-higher: 0.28), rl.loss.ppo.dual_clip_c,
  # rl.loss.sapo.tau_pos, rl.loss.vespo.k_neg. None: the function's default (ppo's
  # eps_high: eps_low; its dual_clip_c and log_ratio_clamp: off).
  s.loss = objective_section(L.POLICY_LOSSES, L.POLICY_LOSS_ARGS)
  # Train a policy loss that bounds no ratio π/π_old ('importance_sampling', or
  # a bound set past its limit: jrl.losses.unbounded_reason) on stale rollouts
  # (topology one_step_off / async at staleness > 0), which is refused otherwise:
  # unclipped importance sampling at staleness 3 grew the sampler-trainer KL ~30x
  # and collapsed the entropy (tinker-cookbook PR #822)
  s.allow_unbounded_async = False
  # How the per-token loss is reduced: the arguments of jrl.losses.aggregate_loss.
  s.reduction = ml_collections.ConfigDict()
  s.reduction.mode = 'token-mean'  # see jrl.losses.AGGREGATION_MODES
  s.reduction.loss_norm = optional()  # seq-mean-token-sum-norm constant (None: padded length)
  s.kl_coef = 0.0  # β; 0 skips the reference model
  s.kl_in = 'loss'  # 'loss' (GRPO) or 'reward' (REINFORCE++, PPO)
  # The per-token KL to the reference: the arguments of jrl.losses.kl_penalty.
  s.kl = ml_collections.ConfigDict()
  s.kl.estimator = 'k3'  # k1 | k2 | k3 | abs | k3_ratio_corrected (kl_in='loss' only)
  s.kl.input_clamp = optional()  # clamp on log(π/π_ref) (None: off)
  s.kl.output_clamp = optional()  # clamp on the per-token KL (None: off)
  # Drop whole sequences with A < 0 whose mean log(π_old/π) exceeds this
  # (DeepSeek-V3.2's off-policy sequence mask, TRL's off_policy_mask_threshold); None: off
  s.off_policy_mask_threshold = optional()
  # MoE models: the router's load-balancing loss (Switch Transformer; Hugging Face's
  # router_aux_loss_coef, 0.001 for Qwen3-MoE) added to the policy loss. 0: off.
  s.router_aux_coef = 0.0
  s.entropy_coef = 0.0  # entropy bonus weight
  s.overlong_buffer = 0  # DAPO: tokens before task.max_response_len where a length penalty starts
  s.overlong_penalty = 1.0  # DAPO: penalty at task.max_response_len
  s.dynamic_sampling = False  # DAPO: drop zero-variance groups and draw more prompts
  s.dynamic_sampling_max_draws = 3  # extra prompt draws per step
  return s


def optional(value=None):
  """A field holding a number or None (a bound, clamp or constant that can
  be off). On the command line its value is read as a Python literal:
  `--config.rl.loss.ppo.dual_clip_c=3.0`, `...=None`."""
  return FieldReference(value, field_type=object)


def objective_section(table, args):
  """`rl.adv` / `rl.loss`: a section per function of `table` holding its
  settable keyword arguments (`args`) with the function's own defaults."""
  s = ml_collections.ConfigDict()
  for name, defaults in L.default_args(table, args).items():
    s[name] = ml_collections.ConfigDict(
      {k: optional() if v is None else v for k, v in defaults.items()}
    )
  return s


def seed_preset(c, name):
  """Sets `c.rl` to the GRPO of preset `name` (`jrl.losses.PRESETS`: 'verl',
  'trl', 'openrlhf', 'nemo_rl', 'dr_grpo', 'dapo', 'trl_gmpo', 'prime_rl'):
  its advantage estimator and policy loss with their arguments (those it
  does not set back to the functions' defaults), the aggregation, the KL
  estimator, clamps and β in the loss. Returns `c`. The run's objective
  built from `c.rl` (`policy_step.objective_of`) is then the preset."""
  p, rl = L.get_preset(name), c.rl
  for section, kernel, table, args in (
    ('adv', p.advantage, L.ADVANTAGE_ESTIMATORS, L.ADVANTAGE_ARGS),
    ('loss', p.policy, L.POLICY_LOSSES, L.POLICY_LOSS_ARGS),
  ):
    defaults = L.default_args(table, args)[kernel.name]
    for key, default in defaults.items():
      rl[section][kernel.name][key] = kernel.kwargs.get(key, default)
  rl.advantage, rl.policy_loss = p.advantage.name, p.policy.name
  rl.reduction.mode, rl.reduction.loss_norm = p.loss_agg, p.loss_norm
  rl.kl_in, rl.kl_coef = 'loss', p.kl_coef
  rl.kl.estimator, rl.kl.input_clamp, rl.kl.output_clamp = (
    p.kl_estimator,
    p.kl_input_clamp,
    p.kl_output_clamp,
  )
  rl.entropy_coef, rl.off_policy_mask_threshold = p.entropy_coef, p.off_policy_mask_threshold
  return c


def sampling_section():
  """How a rollout draws each token: the online algorithms."""
  s = ml_collections.ConfigDict()
  s.temperature = 1.0  # sampling temperature (also the trainer's logprobs are at it)
  s.top_k = 0  # 0: off
  s.top_p = 1.0  # 1: off
  # Tokens a completion has before its stop tokens may be drawn (0: off; at most
  # task.max_response_len, which then fixes every completion's length).
  s.min_new_tokens = 0
  return s


def sampler_section():
  """The paged sampler: rollouts, and held-out generation of a policy."""
  s = ml_collections.ConfigDict()
  # 'jrl' (this paged sampler, reading the trainer's parameters in place) or an
  # import path 'package.module:make_engine' (jrl/trainers/rollouts/contracts.py: Engine)
  s.engine = 'jrl'
  s.num_slots = 64  # sequences decoded together
  s.page_size = 8  # tokens per KV page
  s.num_pages = 0  # 0: enough for every slot's worst case
  s.steps_per_dispatch = 8  # decode steps per jitted call
  # R data-parallel replicas: 1 (every device decodes every slot), mesh.data, or
  # mesh.data x mesh.fsdp; each decodes num_slots / R slots from a page pool of its own
  s.replicas = 1
  s.attention_impl = 'auto'  # 'auto' (by backend) | 'gather' | 'pallas_gpu' | 'pallas_tpu'
  # With mesh.fsdp > 1, the weights the sampler reads: 'gathered' (a copy whole on each
  # batch shard, made once per policy version: no fsdp collectives per decode step),
  # 'sharded' (the trainer's arrays), 'auto' (gathered when the copy takes at most a
  # quarter of a device's memory)
  s.decode_weights = 'auto'
  # Recompute each rollout's logprobs with the trainer and correct the engine's by
  # importance weights (topology.is_*), logging their mismatch: 'auto' (for an engine
  # other than 'jrl', whose logprobs are not the trainer's) | 'on' | 'off'
  s.recompute_logprobs = 'auto'
  # sampler.engine = 'vllm' (third_party/vllm, an optional install: docs/vllm.md)
  s.vllm = ml_collections.ConfigDict()
  s.vllm.kv_space_gib = 4  # GiB, the CPU build's KV cache (VLLM_CPU_KVCACHE_SPACE)
  s.vllm.threads = 0  # cores it binds (VLLM_CPU_OMP_THREADS_BIND 0-(n-1)); 0: its default
  s.vllm.weights_dir = ''  # each policy version written for it; '': <workdir>/vllm_weights
  s.vllm.enforce_eager = True  # no graph capture or compilation: starts in seconds
  return s


def code_section():
  """`reward.code`: the code_tests reward (jrl/rewards/code/README.md)."""
  s = ml_collections.ConfigDict()
  # the rows' test layout: 'auto' (detected from the fields, logged) | 'stdin' | 'call' |
  # 'apps' | 'codecontests' | 'livecodebench' | 'humaneval' | 'mbpp'
  s.format = 'auto'
  s.asserts = 'refuse'  # HumanEval/MBPP asserts that do not convert: 'refuse' | 'in_program'
  s.score = 'fraction'  # 'fraction' of the cases passed | 'all' (1.0 only when all pass)
  s.budget_s = 20.0  # seconds for one call's programs; keep it below reward.timeout_s
  s.concurrency = 0  # programs run at once; 0: 2 per CPU, 4 to 16
  s.case_wall_s = 0.0  # seconds per test case; 0: a row's `limits`, else 5
  s.strict_types = False  # call-based: the same types at every level (bool is not int)
  # call-based: a fresh process per case, instead of one process for a program's cases
  s.fresh_process_per_case = False
  # packages the programs may import, besides the standard library (e.g. ('numpy',)):
  # copied with their dependencies from this environment into the sandbox's own
  s.packages = ()
  return s


def reward_section():
  """Scoring completions: the online algorithms."""
  s = ml_collections.ConfigDict()
  s.functions = ('exact_match',)  # names in jrl.rewards.REGISTRY
  s.weights = ()  # one per function; () = all 1.0
  # A completion that a reward function could not score (None, a failure, a
  # timeout, no remote total): 'drop' leaves it out of the loss and of its
  # group's advantage statistics (unscored is not wrong); 'value' trains it
  # with `unscored_value` in its total, as if that were its score.
  s.unscored = 'drop'
  s.unscored_value = 0.0  # with unscored='value': the reward for "could not score"
  s.mode = 'process'  # 'process' (CPU-bound) | 'thread' (I/O-bound) | 'inline'
  s.workers = 2  # worker processes or threads
  s.timeout_s = 30.0  # per chunk of completions; late chunks count as timeouts
  # Stop the run (non-zero exit, checkpoints kept) once one reward function has
  # left more than this fraction of completions unscored (failures, timeouts,
  # no answer) for `max_unscored_steps` RL iterations in a row; 1.0: never.
  s.max_unscored_frac = 0.9
  s.max_unscored_steps = 3
  s.sandbox_unsafe = False  # programs (code_tests, tools): run even without namespaces (UNSAFE)
  s.code = code_section()
  s.url = ''  # score on a `python -m jrl.rewards.server` instead (functions set there)
  s.model_path = ''  # HF reward model (scalar head); name it 'reward_model' in functions
  s.judge_path = ''  # HF policy-format judge model; name it 'judge' in functions
  s.judge_rubric = 'Score how correct and helpful the response is.'  # the judge's rubric
  s.judge_max_new_tokens = 256  # judge output tokens
  s.judge_max_prompt_len = 2048  # judge input tokens
  s.clip = 0.0  # clip rewards to [-clip, clip] (after normalising); 0: off
  s.normalize = False  # (r - running mean) / running std, statistics kept in checkpoints
  return s


def topology_section():
  """Where the sampler runs relative to the trainer (jrl/trainers/rollouts/topology.py)."""
  s = ml_collections.ConfigDict()
  s.kind = 'colocated'  # 'colocated' | 'disaggregated' | 'one_step_off' | 'async'
  s.rollout_devices = 0  # disaggregated / one_step_off / async: the last N devices sample
  s.staleness = 1  # one_step_off: policy versions between generation and update (0|1)
  # async: rollouts generated up to this many iterations ahead, so at most this many
  # policy versions older than the update that trains on them (0: synchronous)
  s.max_staleness = 2
  # one_step_off / async: the correction of a stale rollout, decoupled PPO's
  # importance weight w = proximal / behaviour (jrl.losses.importance_weights):
  s.is_level = 'token'  # 'token' | 'sequence' (product over the sequence) | 'geometric'
  s.is_mode = 'truncate'  # 'truncate': min(w, is_cap) | 'mask': w in [is_low, is_cap], else 0
  s.is_cap = 2.0  # the upper bound
  s.is_low = 0.0  # mask: the lower bound (0: 1 / is_cap)
  # async: partial rollouts. A rollout moves to newer policy versions while it
  # decodes: one version more every `swap_every` decode dispatches, up to the
  # version that trains on it (waiting for it if the update has not made it yet);
  # every token keeps the version that produced it and its logprob.
  s.partial_rollouts = False
  s.swap_every = 4  # decode dispatches per version step
  s.kv_on_swap = 'recompute'  # samples in flight: 'recompute' their cache, or 'keep' it
  return s


# Every config holds the shared sections (`jrl.trainers.checks.SHARED`: mesh,
# model, task, train, optim, eval, checkpoint, log) and its algorithm's; a run's
# iterations are `sft.steps` (a warm-up, or the whole of `sft`) plus its own
# section's `steps` (`rl`, `dpo` or `rm`; `jrl.trainers.checks.iterations`).


def algorithms():
  """The algorithms jrl registers (`jrl.trainers.ALGORITHMS`)."""
  from jrl import trainers  # the algorithms' records; imported when a config is made

  return trainers.ALGORITHMS


def shared():
  """The sections every config holds (`jrl.trainers.checks.SHARED`)."""
  from jrl.trainers import checks

  return checks.SHARED


def sections(algorithm):
  """The sections a config of `algorithm` holds besides the shared ones, in
  order: those its `jrl.trainers` record reads."""
  if algorithm not in algorithms():
    raise ValueError(f'unknown algorithm {algorithm!r}: one of {tuple(algorithms())}.')
  return tuple(section.name for section in algorithms()[algorithm].sections)


def section(name, algorithm=None):
  """A new section `name` with its defaults: those its `checks.Section`
  gives (an algorithm's own sections, `algorithm`'s record), else this
  module's `<name>_section()`."""
  if algorithm is not None:
    for s in algorithms()[algorithm].sections:
      if s.name == name and s.defaults is not None:
        return s.defaults()
  return globals()[f'{name}_section']()


def base(algorithm='grpo'):
  """An unlocked config of `algorithm`: the run's fields, the shared
  sections, and the algorithm's sections, all at their defaults."""
  own = sections(algorithm)
  c = ml_collections.ConfigDict()
  # 'grpo' (GRPO family, see rl.*) | 'ppo' | 'dpo' | 'sft' | 'reward_model' | 'agent'
  c.algorithm = algorithm
  c.seed = 0  # everything random derives from (seed, iteration)
  c.workdir = 'runs/default'  # checkpoints, metrics.jsonl, tb/, curves.png
  c.tokenizer = 'char'  # 'char' (built in) or a directory with tokenizer.json ('' = model.path)
  # write workdir/hf_export (safetensors) at the end; with LoRA also hf_export/adapter (PEFT)
  c.export_hf = False
  c.max_nonfinite_steps = 5  # stop after this many iterations in a row with skipped updates
  for name in shared() + own:
    c[name] = section(name, algorithm)
  return c


def derive(config, algorithm):
  """An unlocked config of `algorithm` with `config`'s run fields and every
  section both algorithms have (copied), the others at their defaults:
  `derive(grpo_arith.arith_job(), 'dpo')` is DPO on the default job's
  model and task, without its rollout sections."""
  c = base(algorithm)
  for key, value in config.items():
    if key == 'algorithm' or (isinstance(value, ml_collections.ConfigDict) and key not in c):
      continue
    if isinstance(value, ml_collections.ConfigDict):
      value = value.copy_and_resolve_references()
      value.unlock()
    c[key] = value
  return c


def distill_section():
  """The `distill` fields of GRPO-family configs: on-policy distillation
  (jrl/trainers/distill.py); off while `teachers` is empty."""
  d = ml_collections.ConfigDict()
  # checkpoint directories (Hugging Face format, the student's tokenizer) scoring the samples
  d.teachers = ()
  d.teacher_weights = ()  # one positive weight per teacher, normalised; () : equal
  d.coef = 1.0  # weight of the distillation advantage (per-token reverse KL to the teachers)
  d.reward_coef = 0.0  # weight of the run's own advantage from its reward beside it
  d.clip = 0.0  # bound on each token's |reverse KL| (0: none)
  d.discount = 0.0  # 0: per-token advantage; γ > 0: the discounted reverse KL to go
  return d


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
  # a name in jrl.trainers.rollouts.episodes.ENVIRONMENTS, or an import path
  # 'package.module:factory' of factory(tokenizer) -> jrl.envs.Environment
  # (docs/your_own_environment.md)
  a.env = 'arith_tool'
  a.trainer = 'grpo'  # 'grpo' (rl.advantage) or 'ppo' (critic + GAE; add a `ppo` section)
  a.max_turns = 4  # tool calls per trajectory before it is ended
  a.step_timeout_s = 10.0  # per environment step; a late step ends its trajectory
  # wall-clock seconds from an episode's reset to its last step's answer; 0: no limit
  a.episode_timeout_s = 0.0
  a.max_env_tokens = 16  # longest environment answer (tokens)
  # threads running environment steps; a waiting sample is parked and the others keep
  # decoding. 0: each step is waited for in the sampler's loop (same trajectories, slower)
  a.env_workers = 16
  a.sft_tool_frac = 0.5  # share of SFT demonstrations that use the tool
  return a


def rm_section():
  """The `rm` fields of reward-model training configs."""
  r = ml_collections.ConfigDict()
  r.steps = 300  # reward-model updates
  r.pairs_per_step = 32  # preference pairs per step
  r.margin = 0.0  # Bradley-Terry margin (a row's "margin" field overrides it)
  r.center_coef = 0.01  # weight of (r_chosen + r_rejected)^2, keeps rewards near 0
  r.train_path = ''  # JSONL {"prompt", "chosen", "rejected"}; '' = pairs from the arith task
  r.eval_path = ''  # held-out JSONL pairs ('' with arith: pairs from the held-out problems)
  return r


def dpo_section():
  """The `dpo` fields of DPO configs."""
  d = ml_collections.ConfigDict()
  d.steps = 100  # DPO updates (after the `sft` warm-up)
  d.loss = 'dpo'  # 'dpo' | 'ipo' | 'hinge' | 'simpo' | 'orpo'
  d.beta = 0.1  # β (ORPO: λ)
  d.label_smoothing = 0.0  # conservative DPO ε
  d.simpo_gamma = 0.5  # SimPO target margin
  d.pairs_per_step = 32  # preference pairs per step
  d.train_path = ''  # JSONL {"prompt", "chosen", "rejected"}; '' = pairs from the arith task
  return d
