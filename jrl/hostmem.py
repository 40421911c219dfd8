"""Host memory of XLA:CPU programs on transparent huge pages.

XLA:CPU allocates each execution's buffers (its temporaries: 13.5 GiB for
SmolLM2-135M's update in two micro-batches) with malloc, and glibc serves
large requests with fresh mappings, so every step faults them in 4 KiB at a
time: 16.6 million minor faults and a quarter of the process's CPU time in
the kernel over a `launch/bench_layouts.py --size real` run. glibc's
`glibc.malloc.hugetlb=1` tunable makes malloc advise huge pages
(MADV_HUGEPAGE) on the memory it maps, which the kernel honours when
/sys/kernel/mm/transparent_hugepage/enabled is 'madvise' or 'always': 512
times fewer faults, and that update took 88.8 s instead of 113.2 s.

glibc reads its tunables when a process starts, so `ensure_huge_pages`
re-executes the running command once with the variable added (the
launchers call it first thing). `JRL_HUGE_PAGES=0` keeps a process as it is.
Nothing computed changes: only where the allocator's pages come from.
"""

import os
import sys

TUNABLE = 'glibc.malloc.hugetlb=1'
THP_ENABLED = '/sys/kernel/mm/transparent_hugepage/enabled'


def thp_mode(path=THP_ENABLED):
  """The kernel's transparent-huge-page mode ('always', 'madvise', 'never'),
  or None where there is no such file (not Linux, or no THP)."""
  try:
    with open(path, encoding='ascii') as f:
      text = f.read()
  except OSError:
    return None
  for word in text.split():
    if word.startswith('[') and word.endswith(']'):
      return word[1:-1]
  return None


def tunables(env, mode, libc):
  """The GLIBC_TUNABLES value a process should run with, or None when it
  should stay as it is: huge pages opted out (`JRL_HUGE_PAGES=0`), not glibc,
  THP off or absent, or the tunable already set."""
  if env.get('JRL_HUGE_PAGES', '1') == '0' or libc != 'glibc' or mode not in ('always', 'madvise'):
    return None
  current = env.get('GLIBC_TUNABLES', '')
  if 'glibc.malloc.hugetlb=' in current:
    return None
  return f'{current}:{TUNABLE}' if current else TUNABLE


def ensure_huge_pages():
  """Re-executes this process with `TUNABLE` in GLIBC_TUNABLES where
  `tunables` says so (the same interpreter, arguments and environment);
  returns where nothing needs doing. Call it before any work."""
  import platform

  value = tunables(os.environ, thp_mode(), platform.libc_ver()[0])
  if value is None:
    return
  env = dict(os.environ, GLIBC_TUNABLES=value)
  sys.stdout.flush()
  sys.stderr.flush()
  os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)
