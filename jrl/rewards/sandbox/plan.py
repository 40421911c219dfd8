"""Isolation capability detection: which mechanisms this machine enforces.

`make_plan` probes them in a fresh process (`launcher --probe`), finds where
a cgroup per run can be made, self-tests a program through the chosen set
and falls back one step at a time while it fails; `derive` adds the
isolation level and the notes on what is not enforced. See README.md beside
this file.
"""

import json
import os
import subprocess
import sys
import time

from jrl.rewards.sandbox.cgroups import find_cgroup
from jrl.rewards.sandbox.results import Limits
from jrl.rewards.sandbox.runner import LAUNCHER, PATH, private_proc, run

ISOLATION_LEVELS = ('broken', 'degraded', 'no_cgroup', 'full')  # index: `isolation_metric()`


def make_plan():
  """Probes the mechanisms in a fresh process, then self-tests the chosen set."""
  found = _probe_in_subprocess()
  found['cgroup'], why = find_cgroup()
  if why:
    found.setdefault('errors', {})['cgroup'] = why
  return plan_from(found)


def _probe_in_subprocess():
  probe = subprocess.run(
    [sys.executable, '-I', '-S', LAUNCHER, '--probe'],
    capture_output=True,
    timeout=60,
    env={'PATH': PATH, 'LANG': 'C.UTF-8'},
    cwd='/',
  )
  try:
    found = json.loads(probe.stdout.decode().strip().splitlines()[-1])
  except (ValueError, IndexError):
    found = {'root': os.geteuid() == 0, 'errors': {'probe': probe.stderr.decode()[-2000:]}}
  return found


NAMESPACES = {  # name in notes -> (plan key, probe key)
  'network namespace': ('network_namespace', 'net'),
  'PID namespace': ('pid_namespace', 'pid'),
  'mount namespace': ('mount_namespace', 'mount'),
  'IPC namespace': ('ipc_namespace', 'ipc'),
}


def plan_from(found):
  """The mechanisms to use, given what the probe `found` to work."""
  root = bool(found.get('root'))
  userns = not root and bool(found.get('user'))
  proc = found.get('proc')
  plan = {
    'root': root,
    'uid_drop': root and bool(found.get('uid')),
    'user_namespace': userns,
    'network_namespace': bool(found.get('net')),
    'pid_namespace': bool(found.get('pid')),
    'mount_namespace': bool(found.get('mount')),
    'ipc_namespace': bool(found.get('ipc')),
    'cgroup': (found.get('cgroup') or {}).get('kind'),
    'rlimits': True,
    'process_group': True,
    'no_new_privs': True,
    '_proc_options': proc if isinstance(proc, str) else None,
    '_cgroup': found.get('cgroup'),
    '_uid_range': found.get('uid_range'),
    '_errors': dict(found.get('errors', {})),
  }
  # Fall back one step at a time while the self-test fails: first without the
  # cgroup, then without the uid drop, then (not root) without the user
  # namespace and all it enables.
  plan['self_test'] = _self_test(plan)
  if plan['self_test'] != 'ok' and plan['cgroup']:
    plan['_errors']['cgroup'] = f'a program could not run in a cgroup: {plan["self_test"]}'
    plan['cgroup'] = plan['_cgroup'] = None
    plan['self_test'] = _self_test(plan)
  if plan['self_test'] != 'ok' and plan['uid_drop']:
    plan['_errors']['uid'] = f'a program could not run as an unprivileged uid: {plan["self_test"]}'
    plan['uid_drop'] = False
    plan['self_test'] = _self_test(plan)
  if plan['self_test'] != 'ok' and plan['user_namespace']:
    why = f'namespaces inside a user namespace failed the self-test: {plan["self_test"]}'
    for key, probe_key in NAMESPACES.values():
      plan[key] = False
      plan['_errors'][probe_key] = why
    plan['user_namespace'] = False
    plan['self_test'] = _self_test(plan)
  derive(plan)
  return plan


def derive(plan):
  """The keys that follow from the mechanisms: summaries, level, notes."""
  plan['private_proc'] = private_proc(plan)
  plan['memory_total'] = (
    'cgroup' if plan['cgroup'] else 'watchdog' if plan['private_proc'] else 'per_process'
  )
  plan['kills_escaped_processes'] = plan['pid_namespace'] or plan['uid_drop']
  plan['contains_signals'] = plan['pid_namespace'] or plan['uid_drop']
  unprivileged = plan['uid_drop'] or plan['user_namespace']
  namespaces = all(plan[key] for key, _ in NAMESPACES.values()) and plan['private_proc']
  if plan['self_test'] != 'ok':
    plan['isolation'] = 'broken'
  elif not (namespaces and unprivileged):
    plan['isolation'] = 'degraded'
  else:
    plan['isolation'] = 'full' if plan['cgroup'] else 'no_cgroup'
  plan['notes'] = _notes(plan)


def _self_test(plan):
  t0 = time.monotonic()
  try:
    r = run(plan, 'import sys\nprint(sys.stdin.read()[::-1])\n', 'kcos', Limits(), t0)
  except Exception as e:
    return f'{type(e).__name__}: {e}'
  if r.status == 'ok' and r.stdout == 'sock\n':
    return 'ok'
  return f'status {r.status!r}, stdout {r.stdout[:200]!r}, stderr {r.stderr[-2000:]!r}'


def _notes(plan):
  notes = []
  if plan['memory_total'] == 'watchdog':
    why = plan['_errors'].get('cgroup', '')
    notes.append(
      'no cgroup' + (f' ({why})' if why else '') + ': the memory of all processes together '
      'is polled every 20 ms and bounded by max_processes x memory_bytes in between'
    )
  elif plan['memory_total'] == 'per_process':
    notes.append('no cgroup and no private /proc: all processes together may use '
                 'max_processes x memory_bytes')  # fmt: skip
  for name, (key, probe_key) in NAMESPACES.items():
    if not plan[key]:
      why = plan['_errors'].get(probe_key, '')
      notes.append(f'no {name}' + (f' ({why})' if why else ''))
  if plan['mount_namespace'] and plan['pid_namespace'] and not plan['private_proc']:
    notes.append(f'no private /proc ({plan["_errors"].get("proc", "")}): /proc is empty')
  if not plan['network_namespace']:
    notes.append('the program has the network of the caller')
  if not plan['mount_namespace']:
    notes.append(
      "the program sees the host's whole filesystem (the hidden tests included), and the "
      'filesystem is not read-only: the program may write wherever its uid may '
      '(e.g. /tmp, /dev/shm); only single files are size-limited, there is no disk quota'
    )
  if not plan['uid_drop']:
    if plan['root']:
      notes.append(f'no uid drop: {plan["_errors"].get("uid", "setuid failed")}')
      notes.append('RLIMIT_NPROC is not enforced (root ignores it)')
      notes.append('THE PROGRAM RUNS AS ROOT: it can undo every other mechanism')
    elif plan['user_namespace']:
      notes.append(
        "the program runs as the caller's uid, in a user namespace, without capabilities"
      )
    else:
      notes.append("the program runs as the caller's uid (RLIMIT_NPROC counts all its processes)")
  if not plan['kills_escaped_processes']:
    notes.append('a daemon that calls setsid to leave the process group outlives the run')
  if not plan['contains_signals']:
    notes.append("the program may signal every process of the caller's user, the caller too")
  if plan['self_test'] != 'ok':
    notes.append(f'self-test failed: {plan["self_test"]}')
  return notes
