// Decode attention over the paged KV cache on the CPU, as an XLA FFI custom
// call (`jrl.sampler.cpu_kernel` builds and registers it).
//
// The contract of `jrl.sampler.attention.paged_attention_gather`: one query
// per slot, page pools [K, N, P, d], a page table [S, M] and a length per
// slot; query head h reads kv head h / (H / K). Each (slot, kv head) reads its
// keys and values where they lie in the pool: nothing is gathered into a
// copy, and no position at or past the slot's length is read (so garbage in
// a page the slot does not own cannot leak). Scores, soft-cap and softmax are
// float32 and in the gather path's order: q.k, divided by sqrt(d) (or times
// an explicit scale), soft-capped, softmax normalised, then the weighted sum
// of values. A slot of length 0 gets zeros, as the gather path gives it.
//
// Page ids are read as JAX's indexing reads them (negative from the end,
// clamped into the pool) and lengths are clamped into [0, M * P], so a bad
// table cannot read outside the buffers. Work items (slot, kv head) are
// shared by the calling thread and one task per other thread of XLA's
// intra-op pool, taken from an atomic counter; the call returns when every
// item is done.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <memory>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

struct Problem {
  const float* q;      // [S, H, d]
  const float* k;      // [K, N, P, d]
  const float* v;      // [K, N, P, d]
  const int32_t* table;  // [S, M]
  const int32_t* lengths;  // [S]
  float* out;          // [S, H, d]
  int64_t S, H, K, N, P, M, d;
  float scale, softcap;
  bool divide;
};

// A table entry as JAX's indexing reads it: negative ids count from the end,
// and ids outside the pool are clamped into it.
inline int64_t PageId(int64_t id, int64_t n) {
  return std::clamp<int64_t>(id < 0 ? id + n : id, 0, n - 1);
}

// One (slot, kv head): its g query heads against the slot's first `length`
// positions. `scores` is scratch of at least g * M * P floats.
void Attend(const Problem& pb, int64_t item, std::vector<float>& scores) {
  const int64_t s = item / pb.K, kv = item % pb.K;
  const int64_t g = pb.H / pb.K, d = pb.d, P = pb.P;
  const int64_t length = std::clamp<int64_t>(pb.lengths[s], 0, pb.M * P);
  float* out = pb.out + (s * pb.H + kv * g) * d;
  if (length == 0) {
    std::fill(out, out + g * d, 0.0f);
    return;
  }
  const float* q = pb.q + (s * pb.H + kv * g) * d;
  const int32_t* row = pb.table + s * pb.M;
  const float root = std::sqrt(static_cast<float>(d));
  scores.resize(g * length);
  float* sc = scores.data();
  for (int64_t t0 = 0; t0 < length; t0 += P) {
    const int64_t page = PageId(row[t0 / P], pb.N);
    const float* keys = pb.k + ((kv * pb.N + page) * P) * d;
    const int64_t n = std::min(P, length - t0);
    for (int64_t j = 0; j < g; ++j) {
      const float* qj = q + j * d;
      for (int64_t t = 0; t < n; ++t) {
        const float* key = keys + t * d;
        float acc = 0.0f;
        for (int64_t i = 0; i < d; ++i) acc += qj[i] * key[i];
        acc = pb.divide ? acc / root : acc * pb.scale;
        if (pb.softcap > 0.0f) acc = pb.softcap * std::tanh(acc / pb.softcap);
        sc[j * length + t0 + t] = acc;
      }
    }
  }
  for (int64_t j = 0; j < g; ++j) {
    float* sj = sc + j * length;
    float top = sj[0];
    for (int64_t t = 1; t < length; ++t) top = std::max(top, sj[t]);
    float total = 0.0f;
    for (int64_t t = 0; t < length; ++t) {
      sj[t] = std::exp(sj[t] - top);
      total += sj[t];
    }
    for (int64_t t = 0; t < length; ++t) sj[t] = sj[t] / total;
    float* oj = out + j * d;
    std::fill(oj, oj + d, 0.0f);
    for (int64_t t0 = 0; t0 < length; t0 += P) {
      const int64_t page = PageId(row[t0 / P], pb.N);
      const float* vals = pb.v + ((kv * pb.N + page) * P) * d;
      const int64_t n = std::min(P, length - t0);
      for (int64_t t = 0; t < n; ++t) {
        const float w = sj[t0 + t];
        const float* val = vals + t * d;
        for (int64_t i = 0; i < d; ++i) oj[i] += w * val[i];
      }
    }
  }
}

// Items shared between the caller and pool tasks that may start late: a task
// touches the buffers only for an item it claimed before all were claimed,
// and the caller waits until every claimed item is finished.
struct Shared {
  Problem pb;
  int64_t items;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> finished{0};
};

void Work(Shared& sh) {
  std::vector<float> scores;
  for (;;) {
    const int64_t item = sh.next.fetch_add(1);
    if (item >= sh.items) return;
    Attend(sh.pb, item, scores);
    sh.finished.fetch_add(1, std::memory_order_release);
  }
}

ffi::Error PagedAttention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q,
                          ffi::Buffer<ffi::F32> k_pages,
                          ffi::Buffer<ffi::F32> v_pages,
                          ffi::Buffer<ffi::S32> table,
                          ffi::Buffer<ffi::S32> lengths, float scale,
                          float softcap, bool divide,
                          ffi::ResultBuffer<ffi::F32> out) {
  const auto qd = q.dimensions();
  const auto kd = k_pages.dimensions();
  const auto td = table.dimensions();
  if (qd.size() != 3 || kd.size() != 4 || td.size() != 2 ||
      v_pages.dimensions().size() != 4 || lengths.dimensions().size() != 1) {
    return ffi::Error::InvalidArgument(
        "paged attention: q [S, H, d], pages [K, N, P, d], table [S, M] and "
        "lengths [S] expected");
  }
  const int64_t S = qd[0], H = qd[1], d = qd[2];
  const int64_t K = kd[0], N = kd[1], P = kd[2];
  const auto vd = v_pages.dimensions();
  if (kd[3] != d || K < 1 || H % K != 0 || td[0] != S ||
      lengths.dimensions()[0] != S || vd[0] != K || vd[1] != N ||
      vd[2] != P || vd[3] != d || N < 1 || P < 1) {
    return ffi::Error::InvalidArgument("paged attention: shapes disagree");
  }
  auto sh = std::make_shared<Shared>();
  sh->pb = Problem{q.typed_data(), k_pages.typed_data(), v_pages.typed_data(),
                   table.typed_data(), lengths.typed_data(),
                   out->typed_data(), S, H, K, N, P, td[1], d,
                   scale, softcap, divide};
  sh->items = S * K;
  const int64_t helpers =
      std::min<int64_t>(std::max<int64_t>(pool.num_threads() - 1, 0),
                        sh->items - 1);
  for (int64_t i = 0; i < helpers; ++i) {
    pool.Schedule([sh] { Work(*sh); });
  }
  Work(*sh);
  while (sh->finished.load(std::memory_order_acquire) < sh->items) {
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JrlPagedAttention, PagedAttention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Attr<float>("scale")
                                  .Attr<float>("softcap")
                                  .Attr<bool>("divide")
                                  .Ret<ffi::Buffer<ffi::F32>>());
