"""`jrl.hostmem`: launchers re-execute once with glibc's huge-page tunable."""

import os
import subprocess
import sys

from jrl import hostmem

PROBE = (
  'import os; from jrl import hostmem; hostmem.ensure_huge_pages(); '
  'print(os.environ.get("GLIBC_TUNABLES", "-"))'
)


def test_thp_mode_reads_the_bracketed_word(tmp_path):
  path = tmp_path / 'enabled'
  path.write_text('always [madvise] never\n')
  assert hostmem.thp_mode(str(path)) == 'madvise'
  assert hostmem.thp_mode(str(tmp_path / 'absent')) is None


def test_tunables_when_and_what():
  assert hostmem.tunables({}, 'madvise', 'glibc') == hostmem.TUNABLE
  assert hostmem.tunables({}, 'always', 'glibc') == hostmem.TUNABLE
  kept = hostmem.tunables({'GLIBC_TUNABLES': 'glibc.malloc.arena_max=2'}, 'madvise', 'glibc')
  assert kept == 'glibc.malloc.arena_max=2:' + hostmem.TUNABLE
  for env, mode, libc in [
    ({}, 'never', 'glibc'),
    ({}, None, 'glibc'),
    ({}, 'madvise', ''),  # musl or not Linux
    ({'JRL_HUGE_PAGES': '0'}, 'madvise', 'glibc'),
    ({'GLIBC_TUNABLES': 'glibc.malloc.hugetlb=0'}, 'madvise', 'glibc'),  # the user's choice
  ]:
    assert hostmem.tunables(env, mode, libc) is None


def _probe(**env):
  env = {k: v for k, v in {**os.environ, **env}.items() if v is not None}
  out = subprocess.run([sys.executable, '-c', PROBE], env=env, capture_output=True, text=True)
  assert out.returncode == 0, out.stderr
  return out.stdout.strip()


def test_the_process_runs_again_with_the_tunable_once():
  import platform

  expected = hostmem.tunables({}, hostmem.thp_mode(), platform.libc_ver()[0]) or '-'
  # Same interpreter and arguments; prints once, so the second start did not exec again.
  assert _probe(GLIBC_TUNABLES=None, JRL_HUGE_PAGES=None) == expected
  assert _probe(GLIBC_TUNABLES=None, JRL_HUGE_PAGES='0') == '-'
