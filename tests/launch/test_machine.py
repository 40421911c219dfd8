"""Every benchmark record names its machine (`launch/machine.py`)."""

import json

from launch import machine
from launch.benches import common

INTEL = """processor\t: 0
vendor_id\t: GenuineIntel
model name\t: Intel(R) Xeon(R) Platinum 8481C CPU @ 2.70GHz
flags\t\t: fpu sse2 avx2 fma avx512f avx512_bf16 amx_bf16 amx_tile amx_int8 avx512_vnni
processor\t: 1
model name\t: something else
"""
AMD = """vendor_id\t: AuthenticAMD
model name\t: AMD EPYC
flags\t\t: fpu avx2 fma avx512f avx512_bf16
"""


def test_cpu_facts_read_the_first_processor_and_the_flags_that_matter():
  model, vendor, flags = machine.cpu_facts(INTEL)
  assert model == 'Intel(R) Xeon(R) Platinum 8481C CPU @ 2.70GHz' and vendor == 'GenuineIntel'
  assert flags == [
    'avx2',
    'fma',
    'avx512f',
    'avx512_bf16',
    'avx512_vnni',
    'amx_bf16',
    'amx_int8',
    'amx_tile',
  ]
  assert machine.cpu_facts(AMD)[2] == ['avx2', 'fma', 'avx512f', 'avx512_bf16']
  assert machine.cpu_facts('') == ('', '', [])


def test_a_bench_json_carries_the_machine_and_the_backend(tmp_path):
  out = tmp_path / 'figures.json'
  common.write_json(str(out), {'median_s': {'step': 1.0}})
  record = json.loads(out.read_text())
  assert record['median_s'] == {'step': 1.0}
  facts = record['machine']
  assert facts['cores'] >= 1 and facts['cpu_model']
  assert 'jaxlib' in facts['packages'] and record['backend'].startswith('cpu')
  line = machine.describe(facts)
  assert facts['cpu_model'] in line and f'jaxlib {facts["packages"]["jaxlib"]}' in line
