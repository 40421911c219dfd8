"""Runs a job as N JAX processes on this machine: the tested path to multi-host.

    python launch/local.py --num_processes 2 --devices_per_process 4 -- \
        --config configs/grpo_arith.py --config.rl.steps=20

Each process is `python launch/train.py <args after -->` with its own
`devices_per_process` fake CPU devices; they join through `jax.distributed`
(process 0 is the coordinator on a free local port, CPU collectives go over
gloo) and see one global mesh of N x devices_per_process devices, exactly
as the hosts of a TPU slice or GPU cluster do. SIGTERM and SIGINT are
forwarded to every process (they save a checkpoint and exit); the exit
status is the first non-zero status of a process, else 0. Output of
processes other than 0 goes to `<log_dir>/process_<i>.log`.
"""

import argparse
import os
import signal
import socket
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_port():
  with socket.socket() as s:
    s.bind(('localhost', 0))
    return s.getsockname()[1]


def process_env(base_env, index, num_processes, devices_per_process, port):
  """The environment of process `index`."""
  env = dict(base_env)
  flags = [f for f in env.get('XLA_FLAGS', '').split() if 'device_count' not in f]
  flags.append(f'--xla_force_host_platform_device_count={devices_per_process}')
  env['XLA_FLAGS'] = ' '.join(flags)
  env['JAX_PLATFORMS'] = 'cpu'
  env['JRL_COORDINATOR_ADDRESS'] = f'localhost:{port}'
  env['JRL_NUM_PROCESSES'] = str(num_processes)
  env['JRL_PROCESS_ID'] = str(index)
  return env


def parse_args(argv):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--num_processes', type=int, default=2)
  parser.add_argument('--devices_per_process', type=int, default=4)
  parser.add_argument('--port', type=int, default=0, help='coordinator port (0: a free one)')
  parser.add_argument('--log_dir', default='', help="other processes' output (default: tmp)")
  parser.add_argument('--entry', default=os.path.join(ROOT, 'launch', 'train.py'))
  parser.add_argument('job_args', nargs=argparse.REMAINDER, help='-- then train.py arguments')
  opts = parser.parse_args(argv)
  if opts.num_processes < 1:
    parser.error('--num_processes must be >= 1')
  if opts.devices_per_process < 1:
    parser.error('--devices_per_process must be >= 1')
  if opts.job_args and opts.job_args[0] == '--':
    opts.job_args = opts.job_args[1:]
  return opts


def main(argv=None):
  opts = parse_args(sys.argv[1:] if argv is None else argv)
  port = opts.port or free_port()
  log_dir = opts.log_dir or os.path.join('/tmp', f'jrl_local_{os.getpid()}')
  os.makedirs(log_dir, exist_ok=True)
  procs, logs = [], []
  for i in range(opts.num_processes):
    env = process_env(os.environ, i, opts.num_processes, opts.devices_per_process, port)
    out = None
    if i > 0:
      out = open(os.path.join(log_dir, f'process_{i}.log'), 'w')
      logs.append(out)
    cmd = [sys.executable, opts.entry, *opts.job_args]
    err = subprocess.STDOUT if out else None
    procs.append(subprocess.Popen(cmd, env=env, stdout=out, stderr=err))

  def forward(signum, frame):
    del frame
    for p in procs:
      if p.poll() is None:
        p.send_signal(signum)

  signal.signal(signal.SIGTERM, forward)
  signal.signal(signal.SIGINT, forward)
  status = 0
  try:
    while any(p.poll() is None for p in procs):
      failed = [p for p in procs if p.poll() not in (None, 0)]
      if failed:
        # One process died: the others would wait for it forever in a collective.
        time.sleep(2)
        for p in procs:
          if p.poll() is None:
            p.kill()
        break
      time.sleep(0.2)
    for i, p in enumerate(procs):
      code = p.wait()
      if code and not status:
        status = code
        where = '' if i == 0 else f' (output in {log_dir}/process_{i}.log)'
        print(f'process {i} exited with status {code}{where}', file=sys.stderr)
  finally:
    for f in logs:
      f.close()
  return status


if __name__ == '__main__':
  sys.exit(main())
