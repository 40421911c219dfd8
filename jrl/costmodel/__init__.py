"""A cost model of one RL step: memory per device and seconds per stage.

Inputs are plain values: the model (a `jrl.models.ModelConfig`, or one of
`MODEL_PRESETS`); the hardware (a `Hardware`: the `HARDWARE` presets, or
`measure_this_machine()`); the workload (a `Workload`: prompts per step, G,
prompt and response lengths, epochs, minibatch, reference model, packing);
the layout (a `Layout`: topology, chips for training and for rollout,
tensor-parallel degrees, micro-batch rows).

Stage times come from `Coefficients`: the roofline of the hardware
(`Coefficients.from_hardware`) or fitted to the spans of a measured run
(`calibrate`). Generation is simulated slot by slot by the sampler's own
scheduler (`simulate_generation` drives `jrl.sampler.Scheduler` on the
host: admissions within the page pool, the rows of each dispatch, the page
bound), so the long tail of response lengths costs what it costs the real
sampler; the training passes cost the tokens
they run (`tokens_run`: padded rows, or rows packed as the trainer packs
them), so packing pays what it pays the real trainer.

Step composition by topology (stages in seconds):

* colocated:      generate + reward + reference + update;
* disaggregated:  reshard + generate + reward + reference + update, with
  rollout and training on separate chips (each side idles while the other
  works: the bubbles);
* one_step_off:   max(generate + reward, reference + proximal + update)
  (+ reshard on separate chips); on shared chips the device work of both
  sides still adds up, so only host time (dispatch, reward scoring)
  overlaps;
* async (k = `Layout.staleness`): on separate chips the pipeline of
  `predict.pipeline_step`, generation up to k steps ahead with step-to-step
  spread `Workload.generation_cv` (k = 1 is one_step_off; with no spread
  every k >= 1 gives the same max); on shared chips as one_step_off. The
  rollout side holds k copies of the weights.

Everything here is arithmetic on the host: no JAX computation, no devices.

Modules: `hardware` (chips), `model` (presets, FLOPs and bytes per token),
`workload` (Workload, Layout, tokens_run), `memory`, `coefficients`
(Coefficients, calibrate), `predict` (simulate_generation, predict).
"""

from jrl.costmodel.coefficients import (
  Coefficients,
  calibrate,
  generation_cv,
  trace_model,
  workload_from_config,
)
from jrl.costmodel.hardware import HARDWARE, GiB, Hardware, measure_this_machine
from jrl.costmodel.memory import kv_pages, kv_pool_bytes, memory, micro_batch
from jrl.costmodel.model import (
  MODEL_PRESETS,
  flops_per_token,
  kv_bytes_per_token,
  matmul_params,
  model_preset,
)
from jrl.costmodel.predict import pipeline_step, predict, simulate_generation
from jrl.costmodel.workload import TOPOLOGIES, Layout, Tokens, Workload, tokens_run

__all__ = [
  'HARDWARE',
  'MODEL_PRESETS',
  'TOPOLOGIES',
  'Coefficients',
  'GiB',
  'Hardware',
  'Layout',
  'Tokens',
  'Workload',
  'calibrate',
  'flops_per_token',
  'generation_cv',
  'kv_bytes_per_token',
  'kv_pages',
  'kv_pool_bytes',
  'matmul_params',
  'measure_this_machine',
  'memory',
  'micro_batch',
  'model_preset',
  'pipeline_step',
  'predict',
  'simulate_generation',
  'tokens_run',
  'trace_model',
  'workload_from_config',
]
