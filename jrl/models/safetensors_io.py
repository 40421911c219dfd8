"""A lazy, validating reader for `.safetensors` files, and a writer.

The format: 8 bytes little-endian header length N, N bytes of JSON
`{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}`,
then the raw little-endian tensor bytes. The reader memory-maps the file and
returns only the slice asked for, so a device can load its own shard of a
tensor without reading the rest; it checks the header against the file size
first, so a truncated or corrupt file fails with an error naming it instead
of returning garbage. Pickle-based formats are never read.
"""

import json
import os
import struct

import ml_dtypes
import numpy as np
import safetensors.numpy

DTYPES = {
  'F64': np.dtype(np.float64),
  'F32': np.dtype(np.float32),
  'F16': np.dtype(np.float16),
  'BF16': np.dtype(ml_dtypes.bfloat16),
  'I64': np.dtype(np.int64),
  'I32': np.dtype(np.int32),
  'I16': np.dtype(np.int16),
  'I8': np.dtype(np.int8),
  'U8': np.dtype(np.uint8),
  'BOOL': np.dtype(np.bool_),
}
_MAX_HEADER = 100 * 2**20


class SafetensorsFile:
  """Read-only view of one .safetensors file.

  Raises:
    FileNotFoundError if the file is missing; ValueError naming the file if
    its header is malformed or any tensor lies outside the file.
  """

  def __init__(self, path):
    self.path = os.fspath(path)
    size = os.path.getsize(self.path)
    with open(self.path, 'rb') as f:
      prefix = f.read(8)
      if len(prefix) < 8:
        raise ValueError(f'{self.path}: not a safetensors file (shorter than 8 bytes).')
      (n,) = struct.unpack('<Q', prefix)
      if n > min(size - 8, _MAX_HEADER):
        raise ValueError(
          f'{self.path}: corrupt or truncated safetensors file (header length {n} '
          f'does not fit in a file of {size} bytes).'
        )
      try:
        header = json.loads(f.read(n))
      except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f'{self.path}: corrupt safetensors header ({e}).') from None
    if not isinstance(header, dict):
      raise ValueError(f'{self.path}: corrupt safetensors header (not a JSON object).')
    self.metadata = header.pop('__metadata__', None) or {}
    self._data_start = 8 + n
    data_size = size - self._data_start
    self._entries = {}
    for name, info in header.items():
      try:
        dtype = DTYPES[info['dtype']]
        shape = tuple(int(s) for s in info['shape'])
        begin, end = (int(o) for o in info['data_offsets'])
      except (KeyError, TypeError, ValueError):
        raise ValueError(
          f'{self.path}: corrupt header entry for tensor `{name}`: {info!r}.'
        ) from None
      nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
      if end - begin != nbytes or begin < 0:
        raise ValueError(
          f'{self.path}: tensor `{name}` has offsets [{begin}, {end}) but its dtype '
          f'{info["dtype"]} and shape {list(shape)} need {nbytes} bytes.'
        )
      if end > data_size:
        raise ValueError(
          f'{self.path}: truncated file: tensor `{name}` ends at byte {end} of the data '
          f'section, which has only {data_size} bytes.'
        )
      self._entries[name] = (dtype, shape, begin)
    self._mmap = None

  def keys(self):
    return list(self._entries)

  def __contains__(self, name):
    return name in self._entries

  def shape(self, name):
    return self._entries[name][1]

  def dtype(self, name):
    return self._entries[name][0]

  def read(self, name, index=None):
    """The tensor (or `tensor[index]`) as a NumPy array; only that slice is read."""
    dtype, shape, begin = self._entries[name]
    if self._mmap is None:
      self._mmap = np.memmap(self.path, dtype=np.uint8, mode='r')
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    start = self._data_start + begin
    flat = self._mmap[start : start + nbytes].view(dtype)
    arr = flat.reshape(shape)
    return np.array(arr if index is None else arr[index])


def save_file(tensors, path, metadata=None):
  """Writes `{name: np.ndarray}` (any dtype in DTYPES, bfloat16 included)."""
  tensors = {k: np.ascontiguousarray(v) for k, v in tensors.items()}
  safetensors.numpy.save_file(tensors, os.fspath(path), metadata=metadata)
